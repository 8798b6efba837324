"""falcon_lab: a benchmark and ablation platform for the Falcon fast-weight attention family.

Importing the package is cheap: subpackages (kernels, models, training, evaluation) are imported
on use, so `import falcon_lab` never pulls in Lightning, MLflow or lm-eval.
"""

__version__ = "0.1.0"

# transformers' AutoConfig / AutoModelForCausalLM learn model_type "falcon_lab" when transformers loads them
# (an import hook; nothing is imported here): exported folders load with from_pretrained (docs/hf.md)
from falcon_lab.hf import _hook as _hf_hook  # noqa: E402

_hf_hook.install()
