"""One trial as a separate job: ``python -m falcon_lab.sweeps.job SPEC.json``.

Used for trials that need several devices: the job is the root of its own Lightning process tree
(DDP ranks are relaunched by Lightning from this same command). Rank 0 reports the validation
metric to the Optuna trial through the storage and the pruning decision is broadcast to the other
ranks; the ask/tell loop itself stays in the worker that launched the job. Rank 0 writes the
outcome (result dict, metric history, pruned flag) to ``result_path`` for the worker to tell.
"""
from __future__ import annotations

import json
import os
import sys
import traceback


def _rank_zero() -> bool:
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(open(argv[0]).read())
    import optuna

    from falcon_lab import logs
    from falcon_lab.sweeps.pruning import StepPruningCallback
    from falcon_lab.sweeps.runner import load_runner

    logs.setup()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trial = None
    if _rank_zero():
        from falcon_lab.sweeps.space import load_space
        from falcon_lab.sweeps.study import trial_in_job

        # the study's pruner decides should_prune(): rebuild it from the search space
        pruner = load_space(spec["space_path"]).make_pruner()
        trial = trial_in_job(spec["storage"], spec["study_name"], spec["trial_number"], pruner)
    cb = StepPruningCallback(trial, spec["metric"], spec["direction"])
    out: dict = {}
    try:
        res = load_runner(spec["runner"])(spec["overrides"], [cb], spec["tracking"])
        out["result"] = {k: v for k, v in (res or {}).items()  # scalars only (ids, paths, losses)
                         if v is None or isinstance(v, (int, float, str, bool))}
    except Exception:
        out["error"] = traceback.format_exc()
    out.update(history=cb.history, pruned=cb.pruned, pruned_at_step=cb.pruned_at_step,
               available_metrics=cb.available_metrics)
    if _rank_zero():
        tmp = spec["result_path"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, spec["result_path"])
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
