"""Search-space files: load, validate, and turn into Optuna samplers, pruners and trial overrides.

A search space ("ablation") is a YAML file in ``falcon_lab/configs/ablation/NAME.yaml`` (or any
path given as ``ablation=path/to/space.yaml``)::

    description: window B and lambda scale of Falcon-3 / 3A
    metric: val/loss          # the metric the LightningModule logs at validation (pruning + value)
    direction: minimize       # minimize | maximize
    n_trials: 16              # budget: COMPLETE + PRUNED trials
    sampler: {name: tpe, seed: 0}              # any keyword of the Optuna sampler class
    pruner: {name: median, n_warmup_steps: 2}  # any keyword of the Optuna pruner class
    overrides:                # fit overrides applied to every trial (Hydra syntax)
      - model/mixer=falcon
    parameters:               # fit config keys -> distribution
      model.mixer.window: {type: categorical, choices: [1, 2, 4, 8]}
      optim.lr: {type: log, low: 1.0e-4, high: 3.0e-3}
      model.mixer.lam_scale: {type: float, low: 0.1, high: 2.0}
      data.batch_size: {type: int, low: 4, high: 16, step: 4}

Every mistake is reported with the path of the bad key (``parameters.optim.lr.low``) and the file.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
from pathlib import Path
from typing import Any

ABLATION_DIR = Path(__file__).resolve().parent.parent / "configs" / "ablation"

TOP_KEYS = ("description", "metric", "direction", "n_trials", "sampler", "pruner", "overrides",
            "parameters", "max_failed")
PARAM_TYPES = ("categorical", "float", "int", "log")
PARAM_KEYS = {
    "categorical": ("type", "choices"),
    "float": ("type", "low", "high", "log", "step"),
    "log": ("type", "low", "high"),
    "int": ("type", "low", "high", "log", "step"),
}
SAMPLERS = {
    "tpe": "TPESampler",
    "random": "RandomSampler",
    "grid": "GridSampler",
    "bruteforce": "BruteForceSampler",
    "qmc": "QMCSampler",
    "gp": "GPSampler",
    "cmaes": "CmaEsSampler",
}
PRUNERS = {
    "median": "MedianPruner",
    "percentile": "PercentilePruner",
    "successive_halving": "SuccessiveHalvingPruner",
    "hyperband": "HyperbandPruner",
    "threshold": "ThresholdPruner",
    "nop": "NopPruner",
    "none": "NopPruner",
}


class SearchSpaceError(ValueError):
    """A search-space file is malformed; the message names the file and the bad key."""


@dataclasses.dataclass(frozen=True)
class Param:
    key: str                      # fit config key (Hydra override path), also the Optuna name
    type: str                     # categorical | float | int | log
    choices: tuple = ()
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None

    def suggest(self, trial) -> Any:
        if self.type == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.type == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high),
                                     step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.key, float(self.low), float(self.high),
                                   step=self.step, log=self.log or self.type == "log")

    def grid_values(self) -> list:
        if self.type == "categorical":
            return list(self.choices)
        if self.type == "int" and not self.log:
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))
        if self.type == "float" and self.step is not None and not self.log:
            n = int(round((self.high - self.low) / self.step))
            return [self.low + i * self.step for i in range(n + 1)]
        raise SearchSpaceError(
            f"parameters.{self.key}: a grid sampler needs a finite set of values "
            f"(categorical, int without log, or float with step); got type {self.type!r}")


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    name: str
    path: str
    description: str
    metric: str
    direction: str
    n_trials: int
    sampler: dict
    pruner: dict
    overrides: tuple[str, ...]
    params: tuple[Param, ...]
    max_failed: int

    # ---- Optuna objects -------------------------------------------------------------------
    def make_sampler(self, seed_offset: int = 0):
        import optuna

        spec = dict(self.sampler)
        name = spec.pop("name")
        cls = getattr(optuna.samplers, SAMPLERS[name])
        if name == "grid":
            spec["search_space"] = {p.key: p.grid_values() for p in self.params}
        if "seed" in spec and spec["seed"] is not None and seed_offset:
            spec["seed"] = int(spec["seed"]) + seed_offset
        try:
            return cls(**spec)
        except Exception as e:  # wrong value types for a valid keyword
            raise SearchSpaceError(f"{self.path}: sampler ({name}): {e}") from e

    def make_pruner(self):
        import optuna

        spec = dict(self.pruner)
        name = spec.pop("name")
        cls = getattr(optuna.pruners, PRUNERS[name])
        try:
            return cls(**spec)
        except Exception as e:
            raise SearchSpaceError(f"{self.path}: pruner ({name}): {e}") from e

    def suggest(self, trial) -> dict[str, Any]:
        return {p.key: p.suggest(trial) for p in self.params}

    def grid_size(self) -> int | None:
        if self.sampler["name"] not in ("grid", "bruteforce"):
            return None
        try:
            return math.prod(len(p.grid_values()) for p in self.params)
        except SearchSpaceError:
            return None

    def as_dict(self) -> dict:
        return {
            "description": self.description, "metric": self.metric, "direction": self.direction,
            "n_trials": self.n_trials, "sampler": dict(self.sampler), "pruner": dict(self.pruner),
            "overrides": list(self.overrides), "max_failed": self.max_failed,
            "parameters": {p.key: _param_dict(p) for p in self.params},
        }


def _param_dict(p: Param) -> dict:
    d: dict[str, Any] = {"type": p.type}
    if p.type == "categorical":
        d["choices"] = list(p.choices)
    else:
        d.update(low=p.low, high=p.high)
        if p.log and p.type != "log":
            d["log"] = True
        if p.step is not None:
            d["step"] = p.step
    return d


# ---- overrides -------------------------------------------------------------------------------
_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./:")


def format_value(value: Any) -> str:
    """A parameter value as a Hydra override value (``true``, ``null``, ``1e-05``, ``'a b'``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    s = str(value)
    if s and set(s) <= _SAFE and s.lower() not in ("true", "false", "null", "none"):
        try:
            float(s)          # a string that looks like a number must stay a string
        except ValueError:
            return s
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def trial_overrides(params: dict[str, Any]) -> list[str]:
    return [f"{k}={format_value(v)}" for k, v in params.items()]


# ---- loading and validation --------------------------------------------------------------------
def available() -> list[str]:
    return sorted(p.stem for p in ABLATION_DIR.glob("*.yaml"))


def resolve_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise SearchSpaceError(f"ablation={name_or_path}: no such file")
        return p.resolve()
    cand = ABLATION_DIR / f"{name_or_path}.yaml"
    if not cand.is_file():
        close = difflib.get_close_matches(name_or_path, available(), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise SearchSpaceError(
            f"ablation={name_or_path}: no search space of that name{hint}; available: "
            f"{', '.join(available())}; or pass a path to a .yaml file")
    return cand


def load_space(name_or_path: str, *, n_trials: int | None = None) -> SearchSpace:
    """Load and validate a search space; ``n_trials`` overrides the file's budget."""
    path = resolve_path(name_or_path)
    from omegaconf import OmegaConf

    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:
        raise SearchSpaceError(f"{path}: cannot parse YAML: {e}") from e
    return parse_space(raw, name=path.stem, path=str(path), n_trials=n_trials)


def _err(path: str, key: str, msg: str) -> SearchSpaceError:
    return SearchSpaceError(f"{path}: {key}: {msg}")


def _unknown(path: str, prefix: str, got: dict, allowed) -> None:
    for k in got:
        if k not in allowed:
            close = difflib.get_close_matches(str(k), list(allowed), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _err(path, f"{prefix}{k}", f"unknown key{hint}; allowed: {', '.join(allowed)}")


def _number(path: str, key: str, v: Any, integer: bool = False) -> float | int:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _err(path, key, f"must be a{'n integer' if integer else ' number'}, got {v!r}")
    if integer and not (isinstance(v, int) or float(v).is_integer()):
        raise _err(path, key, f"must be an integer, got {v!r}")
    if not math.isfinite(v):
        raise _err(path, key, f"must be finite, got {v!r}")
    return int(v) if integer else v


def _parse_param(path: str, key: str, spec: Any) -> Param:
    where = f"parameters.{key}"
    if not isinstance(key, str) or not key or "=" in key or " " in key:
        raise _err(path, where, "a parameter name must be a fit config key such as optim.lr")
    if not isinstance(spec, dict):
        raise _err(path, where, f"must be a mapping with a 'type' ({', '.join(PARAM_TYPES)}), got {spec!r}")
    if "type" not in spec:
        raise _err(path, f"{where}.type", f"missing; one of {', '.join(PARAM_TYPES)}")
    t = spec["type"]
    if t not in PARAM_TYPES:
        raise _err(path, f"{where}.type", f"unknown type {t!r}; one of {', '.join(PARAM_TYPES)}")
    _unknown(path, f"{where}.", spec, PARAM_KEYS[t])
    if t == "categorical":
        ch = spec.get("choices")
        if not isinstance(ch, list) or not ch:
            raise _err(path, f"{where}.choices", f"must be a non-empty list, got {ch!r}")
        for i, c in enumerate(ch):
            if c is not None and not isinstance(c, (bool, int, float, str)):
                raise _err(path, f"{where}.choices[{i}]",
                           f"choices must be scalars (str, number, bool, null), got {c!r}")
        if len(set(map(repr, ch))) != len(ch):
            raise _err(path, f"{where}.choices", f"duplicate choices in {ch!r}")
        return Param(key=key, type=t, choices=tuple(ch))
    integer = t == "int"
    for b in ("low", "high"):
        if b not in spec:
            raise _err(path, f"{where}.{b}", "missing")
    low = _number(path, f"{where}.low", spec["low"], integer)
    high = _number(path, f"{where}.high", spec["high"], integer)
    if high < low or (t != "int" and high == low):
        raise _err(path, f"{where}.high", f"must be greater than low ({low}), got {high}")
    log = t == "log"
    if "log" in spec:
        if not isinstance(spec["log"], bool):
            raise _err(path, f"{where}.log", f"must be true or false, got {spec['log']!r}")
        log = spec["log"]
    if log and low <= 0:
        raise _err(path, f"{where}.low", f"a log-scaled range needs low > 0, got {low}")
    step = None
    if spec.get("step") is not None:
        step = _number(path, f"{where}.step", spec["step"], integer)
        if step <= 0:
            raise _err(path, f"{where}.step", f"must be > 0, got {step}")
        if log and t == "float":
            raise _err(path, f"{where}.step", "cannot be combined with log: true")
    return Param(key=key, type=t, low=low, high=high, log=log, step=step)


def _parse_component(path: str, key: str, spec: Any, table: dict, default: str) -> dict:
    import optuna

    if spec is None:
        spec = {"name": default}
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict):
        raise _err(path, key, f"must be a mapping with a 'name', got {spec!r}")
    spec = dict(spec)
    name = spec.get("name", default)
    if name not in table:
        close = difflib.get_close_matches(str(name), list(table), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise _err(path, f"{key}.name", f"unknown {key} {name!r}{hint}; one of {', '.join(table)}")
    spec["name"] = name
    mod = optuna.samplers if key == "sampler" else optuna.pruners
    sig = inspect.signature(getattr(mod, table[name]).__init__)
    accepted = [p for p in sig.parameters if p != "self"]
    if key == "sampler" and name == "grid":
        accepted = [p for p in accepted if p != "search_space"]  # built from `parameters`
    _unknown(path, f"{key}.", {k: v for k, v in spec.items() if k != "name"}, accepted)
    return spec


def parse_space(raw: Any, *, name: str, path: str, n_trials: int | None = None) -> SearchSpace:
    if not isinstance(raw, dict):
        raise SearchSpaceError(f"{path}: the file must hold a mapping of {', '.join(TOP_KEYS)}")
    _unknown(path, "", raw, TOP_KEYS)
    for req in ("metric", "direction", "parameters"):
        if req not in raw:
            raise _err(path, req, "missing")
    metric = raw["metric"]
    if not isinstance(metric, str) or not metric:
        raise _err(path, "metric", f"must be a metric name such as val/loss, got {metric!r}")
    direction = raw["direction"]
    if direction not in ("minimize", "maximize"):
        raise _err(path, "direction", f"must be minimize or maximize, got {direction!r}")
    params_raw = raw["parameters"]
    if not isinstance(params_raw, dict) or not params_raw:
        raise _err(path, "parameters", "must be a non-empty mapping of fit config keys")
    params = tuple(_parse_param(path, k, v) for k, v in params_raw.items())
    overrides = raw.get("overrides") or []
    if not isinstance(overrides, list):
        raise _err(path, "overrides", f"must be a list of Hydra overrides, got {overrides!r}")
    for i, o in enumerate(overrides):
        if not isinstance(o, str) or "=" not in o:
            raise _err(path, f"overrides[{i}]", f"must be a 'key=value' string, got {o!r}")
        okey = o.split("=", 1)[0].lstrip("+~")
        if okey in params_raw:
            raise _err(path, f"overrides[{i}]", f"{okey!r} is also a searched parameter")
    sampler = _parse_component(path, "sampler", raw.get("sampler"), SAMPLERS, "tpe")
    pruner = _parse_component(path, "pruner", raw.get("pruner"), PRUNERS, "median")
    if n_trials is None:
        n_trials = raw.get("n_trials")
    if n_trials is None and sampler["name"] in ("grid", "bruteforce"):
        n_trials = math.prod(len(p.grid_values()) for p in params)
    if n_trials is None:
        raise _err(path, "n_trials", "missing (the budget of COMPLETE + PRUNED trials)")
    n_trials = _number(path, "n_trials", n_trials, integer=True)
    if n_trials < 1:
        raise _err(path, "n_trials", f"must be >= 1, got {n_trials}")
    max_failed = raw.get("max_failed", max(3, n_trials))
    max_failed = _number(path, "max_failed", max_failed, integer=True)
    desc = raw.get("description", "")
    if not isinstance(desc, str):
        raise _err(path, "description", "must be a string")
    space = SearchSpace(
        name=name, path=path, description=desc.strip(), metric=metric, direction=direction,
        n_trials=n_trials, sampler=sampler, pruner=pruner, overrides=tuple(overrides),
        params=params, max_failed=max_failed)
    if sampler["name"] == "grid":
        for p in params:
            p.grid_values()  # raises with the key if the parameter is not finite
    return space


def corner_params(space: SearchSpace, limit: int = 16, seed: int = 0) -> list[dict]:
    """Parameter combinations at the corners of the space (every categorical choice, the low and
    high end of each range): at most ``limit`` of them, a fixed random subset if there are more."""
    import itertools
    import random

    axes = []
    for p in space.params:
        if p.type == "categorical":
            axes.append([(p.key, c) for c in p.choices])
        else:
            lo, hi = p.low, p.high
            if p.type == "int" and p.step:
                hi = lo + (int(hi) - int(lo)) // int(p.step) * int(p.step)
            axes.append([(p.key, lo), (p.key, hi)] if lo != hi else [(p.key, lo)])
    combos = [dict(c) for c in itertools.product(*axes)]
    if len(combos) > limit:
        combos = random.Random(seed).sample(combos, limit)
    return combos


def check_keys(space: SearchSpace, cfg) -> None:
    """Every searched key must exist in the composed fit config (``+key`` adds a new one)."""
    from omegaconf import OmegaConf

    missing = object()
    flat = _flat_keys(OmegaConf.to_container(cfg, resolve=False))
    for p in space.params:
        if p.key.startswith("+"):
            continue
        if OmegaConf.select(cfg, p.key.lstrip("~"), default=missing) is missing:
            close = difflib.get_close_matches(p.key, flat, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise _err(space.path, f"parameters.{p.key}",
                       f"no such key in the fit config{hint}; use +{p.key} to add a new key")


def _flat_keys(d: Any, prefix: str = "") -> list[str]:
    out: list[str] = []
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}{k}"
            out.append(key)
            out.extend(_flat_keys(v, key + "."))
    return out
