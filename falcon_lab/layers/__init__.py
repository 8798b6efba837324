"""Token mixers: one file per family, all registered in registry.py."""
from falcon_lab.layers.registry import (  # noqa: F401
    available_mixers,
    build_mixer,
    get_mixer_cls,
    mixer_knobs,
    register_mixer,
)
