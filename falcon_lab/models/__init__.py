"""Models: one decoder with a mixer slot, and the mixer registry."""
from falcon_lab.models.decoder import SIZE_PRESETS, Decoder, build_model  # noqa: F401
from falcon_lab.layers import available_mixers, build_mixer, register_mixer  # noqa: F401
