"""The six Falcon operators (falcon-math.md §4) and their state.

    from falcon_lab.kernels import chunk_falcon, recurrent_falcon, FalconState

Layers (docs/kernel-contract.md): api (checks, varlen, state, dispatch) -> prep (pairs, NLMS step,
decay; shared) -> core (reference.py: step-by-step truth; chunk_torch.py: chunked PyTorch;
triton/: GPU kernels).
"""

from .api import chunk_falcon, recurrent_falcon
from .prep import VARIANTS
from .state import FalconState

__all__ = ["chunk_falcon", "recurrent_falcon", "FalconState", "VARIANTS"]
