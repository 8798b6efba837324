"""Study tables, plots (optuna.visualization.matplotlib, PNG) and the Markdown report."""
from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import warnings
from pathlib import Path
from typing import Any

PLOTS = {
    "optimization_history": "plot_optimization_history",
    "param_importances": "plot_param_importances",
    "parallel_coordinate": "plot_parallel_coordinate",
    "intermediate_values": "plot_intermediate_values",
}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}" if math.isfinite(v) else str(v)
    return str(v)


def rows(study) -> tuple[list[str], list[list[str]]]:
    """Header and one row per trial: number, state, value, last step, each parameter, MLflow run."""
    trials = study.get_trials(deepcopy=False)
    keys: list[str] = []
    for t in trials:
        for k in t.params:
            if k not in keys:
                keys.append(k)
    header = ["trial", "state", "value", "steps", *keys, "note"]
    out = []
    for t in trials:
        steps = max(t.intermediate_values) if t.intermediate_values else None
        note = t.user_attrs.get("fail_reason") or t.user_attrs.get("error") or ""
        if t.user_attrs.get("pruned_at_step") is not None:
            note = f"pruned at step {t.user_attrs['pruned_at_step']}"
        out.append([str(t.number), t.state.name, _fmt(t.value), _fmt(steps),
                    *[_fmt(t.params.get(k)) for k in keys], note.splitlines()[0][:80] if note else ""])
    return header, out


def format_table(study) -> str:
    header, body = rows(study)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h)
              for i, h in enumerate(header)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


def markdown_table(study) -> str:
    header, body = rows(study)
    esc = lambda c: c.replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in body]
    return "\n".join(lines)


SEED_KEYS = ("seed", "data.seed", "+seed")


def arms_table(study) -> str | None:
    """Mean / min / max of the COMPLETE values per arm, an arm being the parameters other than
    the seed (ours: only drawn when the space searches a seed)."""
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    seed_keys = {k for t in done for k in t.params if k in SEED_KEYS}
    if not seed_keys or not done:
        return None
    arms: dict[tuple, list[float]] = {}
    keys = sorted({k for t in done for k in t.params if k not in seed_keys})
    for t in done:
        arms.setdefault(tuple(t.params.get(k) for k in keys), []).append(float(t.value))
    reverse = study.direction.name == "MAXIMIZE"
    order = sorted(arms.items(), key=lambda kv: sum(kv[1]) / len(kv[1]), reverse=reverse)
    lines = ["| " + " | ".join([*keys, "n", "mean", "min", "max"]) + " |",
             "|" + "---|" * (len(keys) + 4)]
    for arm, vals in order:
        lines.append("| " + " | ".join([*map(_fmt, arm), str(len(vals)), _fmt(sum(vals) / len(vals)),
                                         _fmt(min(vals)), _fmt(max(vals))]) + " |")
    return "\n".join(lines)


def write_csv(study, path: Path) -> Path:
    header, body = rows(study)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(body)
    return path


def make_plots(study, out_dir: Path) -> tuple[list[Path], dict[str, str]]:
    """Write the PNG plots; returns (written files, {plot: why it was skipped})."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ovm
    from optuna.trial import TrialState

    out_dir.mkdir(parents=True, exist_ok=True)
    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    written, skipped = [], {}
    for name, fn in PLOTS.items():
        if name == "param_importances" and len(done) < 2:
            skipped[name] = f"needs >= 2 COMPLETE trials, have {len(done)}"
            continue
        if name in ("optimization_history", "parallel_coordinate") and not done:
            skipped[name] = "no COMPLETE trial yet"
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ax = getattr(ovm, fn)(study)
            fig = (ax.flat[0] if hasattr(ax, "flat") else ax).get_figure()
            fig.set_size_inches(9, 5)
            fig.tight_layout()
            path = out_dir / f"{name}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
        except Exception as e:  # e.g. importances with a single distinct value
            skipped[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            plt.close("all")
    return written, skipped


def write_report(study, out_dir: Path, *, space=None, storage: str = "",
                 parent_run_id: str | None = None, tracking_uri: str | None = None) -> Path:
    """A Markdown report (README.md) with the table, best trial, plots and how to reproduce it."""
    from optuna.trial import TrialState

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots, skipped = make_plots(study, out_dir)
    write_csv(study, out_dir / "trials.csv")
    trials = study.get_trials(deepcopy=False)
    n = {s.name: sum(t.state == s for t in trials) for s in TrialState}
    attrs = study.user_attrs
    lines = [f"# Sweep report: {study.study_name}", ""]
    desc = (space.description if space is not None else attrs.get("falcon_lab:description", ""))
    if desc:
        lines += [desc, ""]
    metric = attrs.get("falcon_lab:metric", "value")
    lines += [
        f"- generated: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- objective: {study.direction.name.lower()} `{metric}`",
        f"- trials: {n['COMPLETE']} complete, {n['PRUNED']} pruned, {n['FAIL']} failed, "
        f"{n['RUNNING']} running, {n['WAITING']} waiting (budget "
        f"{attrs.get('falcon_lab:n_trials', '?')} complete + pruned)",
        f"- storage: `{storage}` (study `{study.study_name}`)",
    ]
    if parent_run_id:
        lines.append(f"- MLflow parent run: `{parent_run_id}` (tracking URI `{tracking_uri}`)")
    cmd = attrs.get("falcon_lab:command")
    if cmd:
        lines.append(f"- command: `{cmd}`")
    lines.append("")
    try:
        best = study.best_trial
    except ValueError:
        best = None
    if best is not None:
        lines += ["## Best trial", "", f"Trial {best.number}: `{metric}` = {_fmt(best.value)}", ""]
        lines += [f"- `{k}` = `{v}`" for k, v in best.params.items()]
        lines.append("")
    arms = arms_table(study)
    if arms:
        lines += ["## Arms (over seeds)", "", arms, ""]
    lines += ["## Trials", "", markdown_table(study), ""]
    if plots or skipped:
        lines += ["## Plots", ""]
        for p in plots:
            lines += [f"![{p.stem}]({p.name})", ""]
        for name, why in skipped.items():
            lines.append(f"- {name}: not drawn ({why})")
        lines.append("")
    if space is not None:
        lines += ["## Search space", "", "```json", json.dumps(space.as_dict(), indent=2, default=str),
                  "```", ""]
    path = out_dir / "README.md"
    path.write_text("\n".join(lines))
    return path
