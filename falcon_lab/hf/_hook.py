"""Register falcon_lab's classes with transformers' Auto classes without importing transformers.

`import falcon_lab` calls `install()`: if transformers' Auto modules are already loaded the classes are
registered at once; otherwise a meta-path finder waits for them and registers the config when
`transformers.models.auto.configuration_auto` finishes loading and the model when
`transformers.models.auto.modeling_auto` does. So `import falcon_lab` stays cheap (this module imports only
the standard library), and `AutoConfig` / `AutoModelForCausalLM.from_pretrained(<exported folder>)` work in
any process that imported falcon_lab, whenever transformers is imported. A failure to register is a warning,
never an error inside someone else's `import transformers`.
"""
from __future__ import annotations

import sys

CONFIG_MODULE = "transformers.models.auto.configuration_auto"
MODEL_MODULE = "transformers.models.auto.modeling_auto"


def _register_config(_module=None) -> None:
    from falcon_lab.hf.configuration import FalconLabConfig

    sys.modules[CONFIG_MODULE].AutoConfig.register(FalconLabConfig.model_type, FalconLabConfig, exist_ok=True)


def _register_model(_module=None) -> None:
    from falcon_lab.hf.configuration import FalconLabConfig
    from falcon_lab.hf.modeling import FalconLabForCausalLM

    sys.modules[MODEL_MODULE].AutoModelForCausalLM.register(FalconLabConfig, FalconLabForCausalLM, exist_ok=True)


_CALLBACKS = {CONFIG_MODULE: _register_config, MODEL_MODULE: _register_model}


def _safe(fn, name):
    try:
        fn()
    except Exception as e:  # never break the importer's own import
        import warnings

        warnings.warn(f"falcon_lab: could not register its Hugging Face classes when {name} loaded: "
                      f"{type(e).__name__}: {e} (import falcon_lab.hf to see the error)", stacklevel=2)


class _AutoRegisterFinder:  # a meta-path finder (importlib.abc is not imported: it costs more than this module)
    def __init__(self):
        self.pending = dict(_CALLBACKS)

    def find_spec(self, fullname, path, target=None):
        cb = self.pending.get(fullname)
        if cb is None:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        inner = loader.exec_module

        def exec_module(module, _inner=inner, _name=fullname, _cb=cb):
            _inner(module)
            self.pending.pop(_name, None)
            if not self.pending:
                uninstall()
            _safe(_cb, _name)

        loader.exec_module = exec_module  # this loader instance serves this one module
        return spec


_FINDER: _AutoRegisterFinder | None = None


def uninstall() -> None:
    global _FINDER
    if _FINDER is not None and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    _FINDER = None


def install() -> None:
    """Register now what transformers has already loaded; wait for the rest."""
    global _FINDER
    pending = {}
    for name, cb in _CALLBACKS.items():
        if name in sys.modules:
            _safe(cb, name)
        else:
            pending[name] = cb
    if not pending or _FINDER is not None:
        return
    _FINDER = _AutoRegisterFinder()
    _FINDER.pending = pending
    sys.meta_path.insert(0, _FINDER)
