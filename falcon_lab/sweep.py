"""Ablation sweeps: ``python -m falcon_lab.sweep ablation=NAME [sweep options] [fit overrides...]``.

Search spaces live in ``falcon_lab/configs/ablation/NAME.yaml`` (or ``ablation=path/to/file.yaml``);
see docs/sweeps.md. Options (every other ``key=value`` is a fit override for every trial):

  ablation=NAME        the search space (required; ``list=true`` shows the shipped ones)
  n_trials=N           budget of COMPLETE + PRUNED trials (default: the space's n_trials)
  workers=N            N worker processes on one study (one per GPU when GPUs exist); default 1
  study=NAME           Optuna study name (default: the ablation name); resumes if it exists
  storage=URL          sqlite:///x.db | postgresql://... | journal:PATH (default ./sweeps/optuna.db)
  launch=MODE          auto | inprocess | subprocess (auto: a separate job for multi-device trials)
  heartbeat=S grace=S  worker heartbeat period / staleness limit in seconds (defaults 15 / 90)
  runner=MOD:FN        train function (default falcon_lab.sweeps.runner:training_runner)
  report=true          print the study table and write ablations/reports/<study>/ (no training)
  report_dir=DIR       where report=true writes (default ./ablations/reports/<study>)
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

OPTIONS = ("ablation", "n_trials", "workers", "study", "storage", "launch", "heartbeat", "grace",
           "runner", "report", "report_dir", "list")


class UsageError(ValueError):
    pass


def _bool(key: str, v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise UsageError(f"{key}={v}: expected true or false")


def _int(key: str, v: str, low: int = 1) -> int:
    try:
        n = int(v)
    except ValueError:
        raise UsageError(f"{key}={v}: expected an integer") from None
    if n < low:
        raise UsageError(f"{key}={v}: must be >= {low}")
    return n


def _float(key: str, v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise UsageError(f"{key}={v}: expected a number of seconds") from None
    if x <= 0:
        raise UsageError(f"{key}={v}: must be > 0")
    return x


def parse_args(argv: list[str]) -> tuple[dict, list[str]]:
    opts: dict = {}
    fit: list[str] = []
    for a in argv:
        if a.startswith("-"):
            raise UsageError(f"{a}: flags are not supported here; pass fit overrides as key=value "
                             f"(see python -m falcon_lab.sweep --help)")
        if "=" not in a:
            raise UsageError(f"{a!r}: expected key=value")
        k, v = a.split("=", 1)
        if k in OPTIONS:
            if k in opts:
                raise UsageError(f"{k}= given twice")
            opts[k] = v
        else:
            fit.append(a)
    out: dict = {"ablation": opts.get("ablation"), "study": opts.get("study") or None,
                 "storage": opts.get("storage"), "runner": opts.get("runner"),
                 "launch": opts.get("launch", "auto"), "report_dir": opts.get("report_dir")}
    out["n_trials"] = _int("n_trials", opts["n_trials"]) if "n_trials" in opts else None
    out["workers"] = _int("workers", opts.get("workers", "1"))
    out["report"] = _bool("report", opts.get("report", "false"))
    out["list"] = _bool("list", opts.get("list", "false"))
    timing = {}
    if "heartbeat" in opts:
        timing["heartbeat"] = _float("heartbeat", opts["heartbeat"])
    if "grace" in opts:
        timing["grace"] = _float("grace", opts["grace"])
    if timing.get("grace", 90.0) <= timing.get("heartbeat", 15.0):
        raise UsageError("grace= must be longer than heartbeat=")
    out["timing"] = timing
    if out["launch"] not in ("auto", "inprocess", "subprocess"):
        raise UsageError(f"launch={out['launch']}: one of auto, inprocess, subprocess")
    return out, fit


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
    out = Path(opts["report_dir"] or Path("ablations") / "reports" / name)
    md = write_report(study, out, space=space, storage=st.describe(url),
                      parent_run_id=study.user_attrs.get("falcon_lab:mlflow_parent_run_id"),
                      tracking_uri=study.user_attrs.get("falcon_lab:tracking_uri"))
    print(f"[sweep] report written to {md}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(__doc__)
        return 0
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

        space = load_space(opts["ablation"], n_trials=opts["n_trials"])
        command = "python -m falcon_lab.sweep " + " ".join(shlex.quote(a) for a in argv)
        ctx = driver.prepare(space, fit, study_name=opts["study"], storage=opts["storage"],
                             runner=opts["runner"], launch=opts["launch"], command=command,
                             **opts["timing"])
    except (UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted while preparing the study; nothing was trained", file=sys.stderr)
        return 130
    driver.log(f"study {ctx.study_name!r} in {driver.st.describe(ctx.storage)}: "
               f"{space.n_trials} trials, {space.direction} {space.metric}, sampler "
               f"{space.sampler['name']}, pruner {space.pruner['name']}, workers {opts['workers']}, "
               f"launch {ctx.launch}")
    rc = 0
    try:
        if opts["workers"] == 1:
            rc = 1 if driver.worker_loop(ctx, 0).get("stopped") else 0
        else:
            rc = driver.run_workers(ctx, opts["workers"], ctx.devices)
    except (KeyboardInterrupt, SystemExit):  # Lightning turns Ctrl-C into SystemExit(1)
        driver.log("interrupted: the running trial is marked FAIL and re-enqueued; rerun the "
                   "same command to resume")
        driver.finalize(ctx, interrupted=True)
        return 130
    final = driver.finalize(ctx)
    done = final["COMPLETE"] + final["PRUNED"]
    return 0 if done >= ctx.n_trials and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
