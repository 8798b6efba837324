"""Deprecated alias: the token mixers moved to `falcon_lab.layers` (fla's tier name: ops / modules / layers /
models). `falcon_lab.models.mixers` and its submodules (`.falcon`, `.attention`, `.baselines`, `.base`,
`.registry`, `.falcon_config`) stay importable, as the same module objects, for one release."""
import importlib
import sys

from falcon_lab.layers import available_mixers, build_mixer, get_mixer_cls, mixer_knobs, register_mixer  # noqa: F401

for _name in ("attention", "base", "baselines", "falcon", "falcon_config", "registry"):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"falcon_lab.layers.{_name}")
del _name
