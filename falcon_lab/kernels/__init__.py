"""The six Falcon operators (falcon-math.md §4) and their state.

    from falcon_lab.kernels import chunk_falcon, fused_recurrent_falcon, naive_recurrent_falcon, FalconState

chunk_falcon (training, chunk-parallel), fused_recurrent_falcon (the fast step: decoding),
naive_recurrent_falcon (the float64 reference loop; `recurrent_falcon` is its former name, kept).

Layers (docs/kernel-contract.md): api (checks, varlen, state, dispatch) -> prep (pairs, NLMS step,
decay; shared) -> core (reference.py: step-by-step truth; chunk_torch.py: chunked PyTorch;
triton/: GPU kernels).
"""

from .api import chunk_falcon, fused_recurrent_falcon, naive_recurrent_falcon, recurrent_falcon
from .prep import VARIANTS
from .spec import FalconSpec
from .state import FalconState

__all__ = ["chunk_falcon", "fused_recurrent_falcon", "naive_recurrent_falcon", "recurrent_falcon", "FalconState",
           "FalconSpec", "VARIANTS"]
