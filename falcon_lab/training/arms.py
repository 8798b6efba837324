"""Provenance of a run: its effective Falcon knobs and label, and the name of its multirun arm.

- :func:`effective_mixer`: the mixer config with the Falcon preset applied (``qk_norm``, ``gate``, ``lam``,
  ``window`` as the model really uses them, via ``FalconConfig.resolved()``); MLflow params and ``knob.*`` tags
  carry these instead of ``None``.
- :func:`falcon_label`: ``Falcon-1A.2`` from the effective knobs, whatever preset was configured (the ctx_eta
  arm of ``experiment=ablate_eta`` sets preset ``.1`` but is effectively ``.2``); knobs that match no preset
  are spelled out (``Falcon-1A.3+gate=ctx_beta``).
- :func:`arm_of_job`: in a Hydra multirun, the overrides that differ between the jobs (``gate=ctx_eta``), as
  the MLflow run name, the run folder (``${falcon_arm:}`` in train.yaml) and the ``arm`` tag compare groups by.
- :class:`MultirunSummary`: a Hydra callback that ends a multirun by printing compare's arms table.
"""
from __future__ import annotations

import logging
import re
import sys

log = logging.getLogger(__name__)

FALCON_KNOBS = ("qk_norm", "gate", "lam", "window")
SEED_KEYS = ("seed", "data.seed")


def effective_mixer(mixer: dict) -> dict:
    """A copy of the mixer config with the preset's knobs filled in (Falcon only; others unchanged). A config
    the mixer would refuse is returned as it is (validation reports it)."""
    mixer = dict(mixer or {})
    if mixer.get("name") != "falcon":
        return mixer
    from falcon_lab.layers.falcon_config import FalconConfig, normalize_preset

    try:
        c = FalconConfig(variant=mixer.get("variant"), preset=mixer.get("preset"),
                         **{k: mixer.get(k) for k in FALCON_KNOBS}).resolved()
    except (ValueError, TypeError):
        return mixer
    mixer.update({k: getattr(c, k) for k in FALCON_KNOBS})
    mixer["preset"] = normalize_preset(mixer.get("preset"))
    return mixer


def effective_preset(mixer: dict) -> str | None:
    """The preset whose knobs the (effective) Falcon mixer has, or None when it matches none."""
    from falcon_lab.layers.falcon import PRESETS

    eff = effective_mixer(mixer)
    for name, knobs in PRESETS.items():
        if all(eff.get(k) == v for k, v in knobs.items()):
            return name
    return None


def falcon_label(mixer: dict) -> str:
    """``Falcon-<variant><effective preset>``; off-preset knobs appended to the configured preset."""
    from falcon_lab.layers.falcon import PRESETS, normalize_preset

    eff = effective_mixer(mixer)
    base = f"Falcon-{eff.get('variant')}"
    p = effective_preset(eff)
    if p is not None:
        return base + p
    conf = normalize_preset(eff.get("preset"))
    ref = PRESETS.get(conf, {})
    extra = [f"{k}={eff.get(k)}" for k in ("qk_norm", "gate", "lam") if ref.get(k) != eff.get(k)]
    return base + (conf or "") + "+" + "+".join(extra)


# ---- multirun arms -------------------------------------------------------------------------------------
def _short(keys: list[str]) -> dict:
    """Each key by its last component where that is unambiguous (mixer.gate -> gate)."""
    last = [k.split(".")[-1].lstrip("+~") for k in keys]
    return {k: (s if last.count(s) == 1 else k.lstrip("+~")) for k, s in zip(keys, last)}


def swept_keys(hc, argv: list[str] | None = None) -> list[str]:
    """The keys a Hydra multirun sweeps: the experiment's hydra.sweeper.params with several values, and
    command-line overrides with several values (``key=a,b``, ``range()``, ``choice()``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    texts = [f"{k}={v}" for k, v in (hc.sweeper.get("params") or {}).items()]
    texts += [a for a in (sys.argv[1:] if argv is None else argv) if "=" in a and not a.startswith("-")]
    keys: list[str] = []
    for t in texts:
        try:
            ov = parser.parse_override(t)
        except Exception:  # not an override Hydra accepted anyway
            continue
        if ov.is_sweep_override() and len(list(ov.sweep_string_iterator())) > 1 and ov.key_or_group not in keys:
            keys.append(ov.key_or_group)
    return keys


def arm_of_job(hc, argv: list[str] | None = None) -> tuple[str, str]:
    """(arm, run name) of this multirun job: the swept overrides' values, seed excluded from the arm but kept
    in the run name (``gate=ctx_eta``, ``gate=ctx_eta,seed=2``). ("", "") outside a multirun / no sweep."""
    keys = swept_keys(hc, argv)
    if not keys:
        return "", ""
    vals = {}
    for t in hc.overrides.task:
        k, _, v = str(t).partition("=")
        if k in keys:
            vals[k] = v
    short = _short([k for k in keys if k in vals])
    arm = ",".join(f"{short[k]}={vals[k]}" for k in short if k.lstrip("+~") not in SEED_KEYS)
    name = ",".join(f"{short[k]}={vals[k]}" for k in short)
    return arm, name


def safe_dirname(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.,=+@-]+", "_", name)[:120].strip("._") or "arm"


def arm_dirname() -> str:
    """``${falcon_arm:}`` (hydra.sweep.subdir): the run folder of a multirun job named by its arm."""
    from hydra.core.hydra_config import HydraConfig

    try:
        hc = HydraConfig.get()
    except ValueError:
        return "0"
    _, name = arm_of_job(hc)
    return safe_dirname(name) if name else str(hc.job.num)


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("falcon_arm"):
        OmegaConf.register_new_resolver("falcon_arm", arm_dirname, use_cache=False)


# ---- the end of a multirun -----------------------------------------------------------------------------
try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover
    _HydraCallback = object


class MultirunSummary(_HydraCallback):
    """Ends ``python -m falcon_lab.fit -m`` (and ``experiment=ablate_*``) with compare's arms table for the runs
    of this multirun (tag ``multirun``), and the command that redraws it. Never fails the multirun."""

    def on_multirun_end(self, config, **kwargs) -> None:
        try:
            self._summary(config)
        except Exception as e:
            print(f"[falcon_lab] no summary table: {type(e).__name__}: {str(e)[:300]}", flush=True)

    @staticmethod
    def _summary(config) -> None:
        from omegaconf import OmegaConf

        lg = config.get("logger") or {}
        exp = str(lg.get("experiment_name"))
        if lg.get("name", "mlflow") in (None, "none", False):
            print("[falcon_lab] multirun done (logger=none: no MLflow runs to compare)", flush=True)
            return
        from falcon_lab.compare import compare, format_arms
        from falcon_lab.training.mlflow import resolve_tracking_uri

        sweep_dir = str(OmegaConf.select(config, "hydra.sweep.dir"))
        uri = resolve_tracking_uri(lg)
        res = compare(experiment_name=exp, tracking_uri=uri, tags={"multirun": multirun_id(sweep_dir)},
                      out_dir=sweep_dir, plots=False)
        print("\n" + format_arms(res), flush=True)
        print(f"[falcon_lab] table: {res['markdown']}\n[falcon_lab] all runs of the experiment, any time: "
              f"python -m falcon_lab.compare experiment={exp}", flush=True)


def multirun_id(sweep_dir) -> str:
    from pathlib import Path

    return str(Path(str(sweep_dir)).expanduser().resolve())
