"""Ablation sweeps: ``python -m falcon_lab.sweep ablation=NAME [sweep options] [fit overrides...]``.

Every argument is a Hydra override, as for ``python -m falcon_lab.fit``. Search spaces live in
``falcon_lab/configs/ablation/NAME.yaml`` (or ``ablation=path/to/file.yaml``); see docs/sweeps.md.
The sweep's own options (below) are composed into a typed config (``SweepOptions``, Hydra's Compose
API): a bad value fails at start naming the option. Every other override is a fit override for
every trial, checked against the composed fit config before anything trains.

  ablation=NAME        the search space (required; ``list=true`` shows the shipped ones)
  n_trials=N           budget of COMPLETE + PRUNED trials (default: the space's n_trials)
  workers=N            N worker processes on one study (one per GPU when GPUs exist); default 1
  study=NAME           Optuna study name (default: the ablation name); resumes if it exists
  storage=URL          sqlite:///x.db | postgresql://... | journal:PATH (default ./sweeps/optuna.db)
  launch=MODE          auto | inprocess | subprocess (auto: a separate job for multi-device trials)
  heartbeat=S grace=S  worker heartbeat period / staleness limit in seconds (defaults 15 / 90)
  runner=MOD:FN        train function (default falcon_lab.sweeps.runner:training_runner)
  report=true          print the study table and write its report (no training)
  report_dir=DIR       where report=true writes (default ./sweeps/<study>/report, beside the sweep's runs)
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import shlex
import sys
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SweepOptions:
    """The sweep's own options (the schema Hydra composes them into; defaults as documented)."""

    ablation: Optional[str] = None
    n_trials: Optional[int] = None
    workers: int = 1
    study: Optional[str] = None
    storage: Optional[str] = None
    launch: str = "auto"
    heartbeat: float = 15.0
    grace: float = 90.0
    runner: Optional[str] = None
    report: bool = False
    report_dir: Optional[str] = None
    list: bool = False


OPTIONS = tuple(f.name for f in dataclasses.fields(SweepOptions))
TEXT_OPTIONS = ("ablation", "study", "storage", "launch", "runner", "report_dir")  # str-valued
CONFIG_NAME = "falcon_lab_sweep"
EXPECTED = {int: "expected an integer", float: "expected a number of seconds", bool: "expected true or false"}


class UsageError(ValueError):
    pass


def _expected(key: str) -> str | None:
    """What a value of option ``key`` must be, from its type in SweepOptions."""
    import typing

    kind = typing.get_type_hints(SweepOptions).get(key)
    for t, what in EXPECTED.items():
        if kind is t or t in typing.get_args(kind):
            return what
    return None


def _compose(overrides: list[str]) -> SweepOptions:
    """Hydra's Compose API on the registered SweepOptions schema; errors name the option."""
    from hydra import compose, initialize
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name=CONFIG_NAME, node=SweepOptions)
    GlobalHydra.instance().clear()
    try:
        with initialize(version_base="1.3", config_path=None):
            cfg = compose(config_name=CONFIG_NAME, overrides=overrides)
    except ConfigCompositionException as e:
        bad = next((o for o in overrides if str(e).endswith(f"override {o}")), None)
        if bad is not None:  # a value of the wrong type: "Error merging override workers=two"
            key = bad.split("=", 1)[0].lstrip("+~")
            hint = _expected(key) or str(e.__cause__ or e).splitlines()[0]
            raise UsageError(f"{bad}: {hint}") from None
        raise UsageError(str(e).strip().replace("\n", " ")) from None
    finally:
        GlobalHydra.instance().clear()
    return SweepOptions(**OmegaConf.to_container(cfg, resolve=True))


def _quoted(text: str) -> str:
    """``text`` as a single-quoted Hydra string (backslashes before a quote or the end doubled)."""
    import re

    return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""),
                        text) + "'"


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """Parse every argument as a Hydra override; the sweep's options apart from the fit overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    mine: list[str] = []
    fit: list[str] = []
    seen: set[str] = set()
    for a in argv:
        if a.startswith("-"):
            raise UsageError(f"{a}: flags are not supported here; pass fit overrides as key=value "
                             f"(see python -m falcon_lab.sweep --help)")
        key = a.split("=", 1)[0].lstrip("+~")
        try:
            o = parser.parse_overrides([a])[0]
            key = o.key_or_group
            # a name or path is the text as written: study=007, study=1e3, study=true stay strings
            literal = key in TEXT_OPTIONS and isinstance(o.value(), (bool, int, float))
        except OverrideParseException as e:
            if "=" not in a:
                raise UsageError(f"{a!r}: expected key=value") from None
            if key not in OPTIONS:  # a fit override Hydra cannot parse: say so now
                raise UsageError(f"{a}: not a Hydra override ({str(e).splitlines()[0]})") from None
            literal = True  # e.g. storage=postgresql://...?sslmode=require (an '=' in the value)
        if literal:
            a = f"{key}={_quoted(a.split('=', 1)[1])}"
        if key in OPTIONS:
            if key in seen:
                raise UsageError(f"{key}= given twice")
            seen.add(key)
            mine.append(a)
        else:
            fit.append(a)
    return mine, fit


def parse_args(argv: list[str]) -> tuple[dict, list[str]]:
    """``(options, fit overrides)`` of a sweep command line; a bad option raises UsageError naming it."""
    mine, fit = _split(argv)
    o = _compose(mine)
    if o.n_trials is not None and o.n_trials < 1:
        raise UsageError(f"n_trials={o.n_trials}: must be >= 1")
    if o.workers < 1:
        raise UsageError(f"workers={o.workers}: must be >= 1")
    for k in ("heartbeat", "grace"):
        if getattr(o, k) <= 0:
            raise UsageError(f"{k}={getattr(o, k):g}: must be > 0")
    if o.grace <= o.heartbeat:
        raise UsageError("grace= must be longer than heartbeat=")
    if o.launch not in ("auto", "inprocess", "subprocess"):
        raise UsageError(f"launch={o.launch}: one of auto, inprocess, subprocess")
    opts = dataclasses.asdict(o)
    opts["study"] = opts["study"] or None
    opts["timing"] = {"heartbeat": opts.pop("heartbeat"), "grace": opts.pop("grace")}
    return opts, fit


def _did_you_mean(fit: list[str], msg: str) -> str:
    """A hint when the fit override an error names looks like a misspelt sweep option."""
    for o in fit:
        key = o.split("=", 1)[0].lstrip("+~")
        if f"'{key}'" not in msg:
            continue
        close = difflib.get_close_matches(key, OPTIONS, n=1, cutoff=0.8)
        if close:
            return f" ({key}: did you mean the sweep option {close[0]}=?)"
    return ""


def _list() -> None:
    from falcon_lab.sweeps.space import ABLATION_DIR, available, load_space

    print(f"search spaces in {ABLATION_DIR}:")
    for name in available():
        try:
            s = load_space(name)
            first = s.description.splitlines()[0] if s.description else ""
            print(f"  {name:<22} {s.n_trials:>3} trials, {s.direction} {s.metric}: {first}")
        except Exception as e:
            print(f"  {name:<22} INVALID: {e}")


def report(opts: dict, fit: list[str]) -> int:
    import optuna

    from falcon_lab.sweeps import storage as st
    from falcon_lab.sweeps.report import format_table, write_report
    from falcon_lab.sweeps.space import load_space

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    abl = opts["ablation"]
    name = opts["study"] or (Path(abl).stem if abl and abl.endswith((".yaml", ".yml")) else abl)
    url = st.resolve_storage(opts["storage"])
    try:
        study = optuna.load_study(study_name=name, storage=st.open_storage(url))
    except KeyError:
        names = [s.study_name for s in optuna.get_all_study_summaries(st.open_storage(url))]
        raise UsageError(f"study={name}: not found in {st.describe(url)}; studies there: "
                         f"{', '.join(names) or 'none'}") from None
    space = None
    path = study.user_attrs.get("falcon_lab:space_path") or opts["ablation"]
    try:
        space = load_space(path) if path else None
    except Exception:
        space = None
    print(format_table(study))
    # beside the sweep's own folder (./sweeps/<study>), not into the repository's tracked ablations/reports/
    out = Path(opts["report_dir"] or Path("sweeps") / name / "report")
    md = write_report(study, out, space=space, storage=st.describe(url),
                      parent_run_id=study.user_attrs.get("falcon_lab:mlflow_parent_run_id"),
                      tracking_uri=study.user_attrs.get("falcon_lab:tracking_uri"))
    print(f"[sweep] report written to {md}")
    return 0


def _say_if_finished(ctx) -> bool:
    """A rerun of a finished study trains nothing: say so, and how to start a new one."""
    import optuna

    from falcon_lab.sweeps import storage as st

    try:
        study = optuna.load_study(study_name=ctx.study_name, storage=st.open_storage(ctx.storage))
        c = st.counts(study)
    except Exception:  # the workers report any storage problem themselves
        return False
    done = c["COMPLETE"] + c["PRUNED"]
    if done < ctx.n_trials:
        return False
    log.info("study %r already has %d/%d trials done: nothing to train (its table follows). To run the "
             "sweep again, pass a new study name (study=%s_2), or raise n_trials= to add trials to this one",
             ctx.study_name, done, ctx.n_trials, ctx.study_name)
    return True


def main(argv: list[str] | None = None) -> int:
    from falcon_lab import logs

    logs.setup()
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(__doc__)
        return 0
    fit: list[str] = []
    try:
        opts, fit = parse_args(argv)
        if opts["list"]:
            _list()
            return 0
        if not opts["ablation"] and not (opts["report"] and opts["study"]):
            raise UsageError("ablation=NAME is required (list=true shows the search spaces)")
        if opts["report"]:
            return report(opts, fit)
        from falcon_lab.sweeps import driver
        from falcon_lab.sweeps.space import load_space
        from falcon_lab.sweeps.storage import describe

        space = load_space(opts["ablation"], n_trials=opts["n_trials"])
        command = "python -m falcon_lab.sweep " + " ".join(shlex.quote(a) for a in argv)
        ctx = driver.prepare(space, fit, study_name=opts["study"], storage=opts["storage"],
                             runner=opts["runner"], launch=opts["launch"], command=command,
                             **opts["timing"])
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}{_did_you_mean(fit, str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted while preparing the study; nothing was trained", file=sys.stderr)
        return 130
    log.info("study %r in %s: %d trials, %s %s, sampler %s, pruner %s, workers %d, launch %s",
             ctx.study_name, describe(ctx.storage), space.n_trials, space.direction, space.metric,
             space.sampler["name"], space.pruner["name"], opts["workers"], ctx.launch)
    _say_if_finished(ctx)
    rc = 0
    try:
        if opts["workers"] == 1:
            rc = 1 if driver.worker_loop(ctx, 0).get("stopped") else 0
        else:
            rc = driver.run_workers(ctx, opts["workers"], ctx.devices)
    except (KeyboardInterrupt, SystemExit):  # Lightning turns Ctrl-C into SystemExit(1)
        log.info("interrupted: the running trial is marked FAIL and re-enqueued; rerun the same "
                 "command to resume")
        driver.finalize(ctx, interrupted=True)
        return 130
    final = driver.finalize(ctx)
    done = final["COMPLETE"] + final["PRUNED"]
    return 0 if done >= ctx.n_trials and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
