"""Mixer registry: `@register_mixer("name")` on a Mixer subclass; `build_mixer(cfg, d_model, n_heads, head_dim)`."""
from __future__ import annotations

import importlib
import inspect

_MIXERS: dict[str, type] = {}
_BUILTIN = ("falcon", "attention", "baselines")


def register_mixer(name: str):
    def deco(cls):
        if name in _MIXERS and _MIXERS[name] is not cls:
            raise ValueError(f"mixer {name!r} is already registered")
        cls.mixer_name = name
        _MIXERS[name] = cls
        return cls

    return deco


def _load_builtin():
    for m in _BUILTIN:
        importlib.import_module(f"falcon_lab.layers.{m}")


def available_mixers() -> list[str]:
    _load_builtin()
    return sorted(_MIXERS)


def get_mixer_cls(name: str):
    _load_builtin()
    if name not in _MIXERS:
        raise ValueError(f"mixer.name: unknown mixer {name!r}; available: {sorted(_MIXERS)}")
    return _MIXERS[name]


def mixer_knobs(name: str) -> dict:
    """The keyword knobs (with defaults) a mixer accepts, beyond d_model / n_heads / head_dim: the fields of
    its `Config` dataclass where it has one (the Falcon mixer), else its keyword-only parameters."""
    cls = get_mixer_cls(name)
    if hasattr(cls, "Config"):
        return cls.Config.knobs()
    sig = inspect.signature(cls.__init__)
    return {k: p.default for k, p in sig.parameters.items()
            if k not in ("self", "d_model", "n_heads", "head_dim") and p.kind == p.KEYWORD_ONLY}


def build_mixer(cfg, d_model: int, n_heads: int, head_dim: int, layer_idx: int = 0):
    """cfg: a mapping with `name` and that mixer's knobs. Unknown knobs fail naming the key."""
    cfg = dict(cfg)
    name = cfg.pop("name", None)
    cls = get_mixer_cls(name)
    knobs = mixer_knobs(name)
    for k in cfg:
        if k not in knobs:
            raise ValueError(f"mixer.{k}: not a knob of mixer {name!r} (knobs: {sorted(knobs)})")
    kwargs = {k: v for k, v in cfg.items()}
    if "layer_idx" in knobs:
        kwargs["layer_idx"] = layer_idx
    return cls(d_model, n_heads, head_dim, **kwargs)
