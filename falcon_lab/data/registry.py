"""Datamodule registry: `build_datamodule(cfg.data)` dispatches on `cfg.data.name`.

This module imports nothing else from `falcon_lab.data`: the arrows go one way. The built-in
datamodules are named below by module and class and imported only when first asked for; they do not
import this module back. Code outside the package (a user's own dataset) registers with::

    from falcon_lab.data import register_datamodule

    @register_datamodule("mine")
    class MyDataModule(L.LightningDataModule):
        def __init__(self, cfg, seed=0): ...  # cfg = the `data` config node
        tokenizer = ...                        # attribute the trainer uses for vocab size

A datamodule built here must expose `.tokenizer` (with `vocab_size`) and yield batches as dicts
{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T] (-100 = no loss)}, optionally
"cu_seqlens" (LongTensor[N+1] over the flattened B*T tokens).
"""
from __future__ import annotations

import importlib
from typing import Callable

_DATAMODULES: dict[str, Callable] = {}

# name -> "module:Class", imported on first use
_BUILTIN: dict[str, str] = {
    "lm": "falcon_lab.data.lm:LMDataModule",
    "addition": "falcon_lab.data.tasks.datamodules:AdditionDataModule",
    "mqar": "falcon_lab.data.tasks.datamodules:MQARDataModule",
}


def register_datamodule(name: str):
    def deco(cls):
        if name in _DATAMODULES and _DATAMODULES[name] is not cls:
            raise ValueError(f"datamodule {name!r} is already registered ({_DATAMODULES[name]!r})")
        if name in _BUILTIN and f"{cls.__module__}:{cls.__qualname__}" != _BUILTIN[name]:
            raise ValueError(f"datamodule {name!r} is a built-in ({_BUILTIN[name]}); pick another name")
        _DATAMODULES[name] = cls
        return cls

    return deco


def available_datamodules() -> list[str]:
    return sorted(set(_DATAMODULES) | set(_BUILTIN))


def get_datamodule_cls(name: str):
    if name in _DATAMODULES:
        return _DATAMODULES[name]
    if name in _BUILTIN:
        module, cls = _BUILTIN[name].split(":")
        _DATAMODULES[name] = getattr(importlib.import_module(module), cls)
        return _DATAMODULES[name]
    raise ValueError(f"data.name: unknown datamodule {name!r}; registered: {available_datamodules()}")


def build_datamodule(data_cfg, **kwargs):
    """Instantiate the datamodule registered under `data_cfg.name` with the `data` config node."""
    name = data_cfg.get("name", None) if hasattr(data_cfg, "get") else None
    if name is None:
        raise ValueError("data.name is missing")
    return get_datamodule_cls(name)(data_cfg, **kwargs)
