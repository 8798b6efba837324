"""falcon_lab models in the Hugging Face ecosystem (docs/hf.md).

    import falcon_lab                                    # model_type "falcon_lab" known to the Auto classes
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exported/")   # a folder from python -m falcon_lab.export
    tok = AutoTokenizer.from_pretrained("exported/")

- `FalconLabConfig` / `FalconLabForCausalLM` (configuration.py, modeling.py): the platform's Decoder as a
  `PreTrainedModel` with `generate()` through `FalconLabCache` (cache.py: the mixers' recurrent states or
  KV caches);
- `export_checkpoint` (export.py; CLI `python -m falcon_lab.export ckpt=... out=...`) and the tokenizer
  export (tokenizer.py);
- `FalconAttention` (layer.py): the platform's Falcon mixer with fla's layer signature.

Registration is lazy: `import falcon_lab` (or `falcon_lab.hf`) does not import transformers; it installs an
import hook (falcon_lab/hf/_hook.py) that registers the classes as soon as transformers' Auto modules load (at
once if they already have). The names below are imported on first use.
"""
from __future__ import annotations

import importlib

from falcon_lab.hf import _hook

_LAZY = {
    "FalconLabConfig": "falcon_lab.hf.configuration",
    "FalconLabForCausalLM": "falcon_lab.hf.modeling",
    "FalconLabPreTrainedModel": "falcon_lab.hf.modeling",
    "FalconLabCache": "falcon_lab.hf.cache",
    "FalconAttention": "falcon_lab.hf.layer",
    "export_checkpoint": "falcon_lab.hf.export",
    "export_tokenizer": "falcon_lab.hf.tokenizer",
    "hf_tokenizer": "falcon_lab.hf.tokenizer",
}


def register() -> None:
    """Register model_type "falcon_lab" with AutoConfig and AutoModelForCausalLM now (idempotent; imports
    transformers). Not needed after `import falcon_lab`, whose import hook does it when transformers' Auto
    classes load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from falcon_lab.hf.configuration import FalconLabConfig
    from falcon_lab.hf.modeling import FalconLabForCausalLM

    AutoConfig.register(FalconLabConfig.model_type, FalconLabConfig, exist_ok=True)
    AutoModelForCausalLM.register(FalconLabConfig, FalconLabForCausalLM, exist_ok=True)


def __getattr__(name):  # each piece imported on first use (transformers, torch model code)
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'falcon_lab.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)


_hook.install()  # no-op when `import falcon_lab` already installed it

__all__ = sorted(_LAZY) + ["register"]
