"""`FalconLabConfig`: the platform's model + mixer config as a Hugging Face `PretrainedConfig`.

Everything `falcon_lab.models.build_model` needs to rebuild the decoder is here, under the platform's
own names (`d_model`, `n_layers`, `n_heads`, `head_dim`, `ffn_mult`, `norm_eps`, `init_std`,
`loss_impl`, `logit_scale`, and `mixer`: the mixer's config with its `name` and every knob), so each
mixer, Falcon variant and knob round-trips through `config.json`. The standard Hugging Face names
(`hidden_size`, `num_hidden_layers`, `num_attention_heads`) are aliases of the platform's.

This module imports nothing heavier than transformers' configuration module (no torch model code):
the AutoConfig registration hook (falcon_lab/hf/_hook.py) imports it when transformers' auto
config module loads.
"""
from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

MODEL_TYPE = "falcon_lab"


class FalconLabConfig(PretrainedConfig):
    model_type = MODEL_TYPE
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layers",
                     "num_attention_heads": "n_heads"}

    vocab_size: int = 320
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    head_dim: int = 32
    mixer: dict[str, Any] | None = None
    ffn_mult: float = 8 / 3
    norm_eps: float = 1e-6
    init_std: float = 0.02
    logit_scale: float = 1.0
    loss_impl: str = "chunked"
    # the context length the model was trained at (lm-eval's hf model truncates its inputs to it, as the
    # platform's adapter does with data.seq_len); nothing in the decoder limits positions
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    use_cache: bool = True
    # provenance written by the exporter: source checkpoint, tokenizer name, the training config
    falcon_lab: dict[str, Any] | None = None

    def __post_init__(self, **kwargs):
        if self.mixer is None:
            self.mixer = {"name": "falcon"}
        self.mixer = dict(self.mixer)
        if "name" not in self.mixer:
            raise ValueError("FalconLabConfig.mixer: needs a 'name' (falcon, attention, deltanet, ...)")
        super().__post_init__(**kwargs)

    def model_cfg(self) -> dict:
        """The platform's `model` config (falcon_lab.models.build_model's first argument)."""
        return {"d_model": int(self.d_model), "n_layers": int(self.n_layers), "n_heads": int(self.n_heads),
                "head_dim": int(self.head_dim), "ffn_mult": float(self.ffn_mult), "norm_eps": float(self.norm_eps),
                "init_std": float(self.init_std), "loss_impl": str(self.loss_impl), "compile": False,
                "activation_checkpointing": False}

    @classmethod
    def from_platform(cls, model_cfg, mixer_cfg, vocab_size: int, *, logit_scale: float = 1.0,
                      max_position_embeddings: int = 2048, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None, falcon_lab: dict | None = None) -> "FalconLabConfig":
        """From the platform's `model` and `mixer` configs (a checkpoint's cfg.model / cfg.mixer)."""
        m = dict(model_cfg)
        for key in ("d_model", "n_layers", "n_heads", "head_dim"):
            if key not in m:
                raise ValueError(f"model.{key} is missing")
        return cls(vocab_size=int(vocab_size), d_model=int(m["d_model"]), n_layers=int(m["n_layers"]),
                   n_heads=int(m["n_heads"]), head_dim=int(m["head_dim"]), mixer=_plain(dict(mixer_cfg)),
                   ffn_mult=float(m.get("ffn_mult", 8 / 3)), norm_eps=float(m.get("norm_eps", 1e-6)),
                   init_std=float(m.get("init_std", 0.02)), loss_impl=str(m.get("loss_impl", "chunked")),
                   logit_scale=float(logit_scale), max_position_embeddings=int(max_position_embeddings),
                   bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                   falcon_lab=_plain(falcon_lab) if falcon_lab is not None else None)


def _plain(obj):
    """OmegaConf containers and tuples -> plain JSON-able dicts/lists."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(obj, (DictConfig, ListConfig)):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
