"""Datamodule registry: `build_datamodule(cfg.data)` dispatches on `cfg.data.name`.

Other areas register their own (e.g. the evaluation engineer's task datamodules in
falcon_lab/data/tasks/) with::

    from falcon_lab.data import register_datamodule

    @register_datamodule("addition")
    class AdditionDataModule(L.LightningDataModule):
        def __init__(self, cfg): ...      # cfg = the `data` config node
        tokenizer = ...                    # attribute the trainer uses for vocab size

A datamodule built here must expose `.tokenizer` (with `vocab_size`) and yield batches as dicts
{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T] (-100 = no loss)}, optionally
"cu_seqlens" (LongTensor[N+1] over the flattened B*T tokens).
"""
from __future__ import annotations

import importlib
from typing import Callable

_DATAMODULES: dict[str, Callable] = {}


def register_datamodule(name: str):
    def deco(cls):
        if name in _DATAMODULES and _DATAMODULES[name] is not cls:
            raise ValueError(f"datamodule {name!r} is already registered ({_DATAMODULES[name]!r})")
        _DATAMODULES[name] = cls
        return cls

    return deco


def _load_plugins() -> None:
    # the built-in LM datamodule, and task datamodules if that package exists
    importlib.import_module("falcon_lab.data.lm")
    try:
        importlib.import_module("falcon_lab.data.tasks")
    except ModuleNotFoundError as e:
        if e.name not in ("falcon_lab.data.tasks",):
            raise


def available_datamodules() -> list[str]:
    _load_plugins()
    return sorted(_DATAMODULES)


def get_datamodule_cls(name: str):
    _load_plugins()
    if name not in _DATAMODULES:
        raise ValueError(f"data.name: unknown datamodule {name!r}; registered: {sorted(_DATAMODULES)}")
    return _DATAMODULES[name]


def build_datamodule(data_cfg, **kwargs):
    """Instantiate the datamodule registered under `data_cfg.name` with the `data` config node."""
    name = data_cfg.get("name", None) if hasattr(data_cfg, "get") else None
    if name is None:
        raise ValueError("data.name is missing")
    return get_datamodule_cls(name)(data_cfg, **kwargs)
