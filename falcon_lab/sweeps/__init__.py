"""Ablation sweeps driven by Optuna (ask/tell): search spaces, pruning, resume, parallel workers,
MLflow grouping and reports. Entry point: ``python -m falcon_lab.sweep ablation=NAME``.

Light to import: Lightning is only loaded by :mod:`falcon_lab.sweeps.pruning`.
"""
from .space import SearchSpace, SearchSpaceError, available, load_space

__all__ = ["SearchSpace", "SearchSpaceError", "available", "load_space"]
