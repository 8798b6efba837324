"""`python -m falcon_lab.compare experiment=NAME [tracking_uri=URI] [out_dir=DIR] [metrics=[k1,k2]]`

Gathers an MLflow experiment's runs into one Markdown table (perplexities, downstream accuracy,
addition and extrapolation, tokens/s, state size, ...) and PNG plots, the paper's tables for any set
of runs. ``experiment_name=`` is accepted for ``experiment=``. Columns appear when at least one run
has the metric. Written to ``out_dir`` (default ``./outputs/compare/<experiment>``).
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

# (column title, metric key or callable(run) -> value, format, lower is better?)
BASE_COLUMNS = [
    ("val loss (best)", "best:val/loss", "{:.4f}", True),
    ("val ppl (best)", "bestppl:val/loss", "{:.2f}", True),
    ("shuffle gap", "val/shuffle_gap", "{:.3f}", False),
    ("tokens/s", "median:train/tokens_per_s", "{:,.0f}", False),  # median over logged steps (ours)
    ("MFU", "train/mfu", "{:.3f}", False),
]
EVAL_PREFIXES = [  # evaluation metrics, in this order (matched by prefix / suffix)
    ("ppl/", "/ppl", "{:.2f}", True),
    ("ppl/", "/word_ppl", "{:.2f}", True),
    ("ppl/", "/bits_per_byte", "{:.4f}", True),
    ("lm_eval/", "shot", "{:.4f}", False),
    ("addition/", "", "{:.3f}", False),
    ("extrap/", "_train_len", "{:.4f}", True),
    ("mqar/", "acc_mean", "{:.3f}", False),
    ("passkey/", "acc_mean", "{:.3f}", False),
]


def _parse_args(argv):
    out = {}
    for a in argv:
        if a in ("-h", "--help"):
            print(__doc__)
            sys.exit(0)
        if "=" not in a:
            raise SystemExit(f"compare: expected key=value arguments, got {a!r}\n{__doc__}")
        k, v = a.split("=", 1)
        k = k.lstrip("+")
        if k == "experiment":
            k = "experiment_name"
        if k not in ("experiment_name", "tracking_uri", "out_dir", "metrics"):
            raise SystemExit(f"compare: unknown argument {k!r} (experiment, tracking_uri, out_dir, metrics)")
        if k == "metrics":
            v = [x.strip() for x in v.strip("[]").split(",") if x.strip()]
        out[k] = v
    if "experiment_name" not in out:
        raise SystemExit(f"compare: experiment=NAME is required\n{__doc__}")
    return out


def _default_uri():
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{(Path.cwd() / 'mlruns' / 'mlflow.db').resolve()}"


def _value(client, run, key):
    if ":" in key:
        how, k = key.split(":", 1)
        hist = client.get_metric_history(run.info.run_id, k)
        vals = [h.value for h in hist if h.value is not None and not math.isnan(h.value)]
        if not vals:
            return None
        if how == "best":
            return min(vals)
        if how == "bestppl":
            return math.exp(min(vals)) if min(vals) < 700 else float("inf")
        if how == "median":
            v = sorted(vals)
            return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])
        raise ValueError(key)
    return run.data.metrics.get(key)


def _label(run):
    t = run.data.tags
    name = t.get("mlflow.runName") or run.info.run_id[:8]
    mix = t.get("variant") or t.get("mixer") or ""
    preset = t.get("preset")
    if preset and preset not in ("None", "null"):
        mix += f".{preset}" if not preset.startswith(".") else preset
    return name, mix


def compare(experiment_name: str, tracking_uri: str | None = None, out_dir: str | None = None,
            metrics: list[str] | None = None) -> dict:
    from mlflow.tracking import MlflowClient
    uri = tracking_uri or _default_uri()
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ValueError(f"experiment={experiment_name!r}: not in {uri} (experiments: {names})")
    runs = client.search_runs([exp.experiment_id], max_results=1000, order_by=["attributes.start_time ASC"])
    # a sweep's parent run holds no model metrics of its own: its trials are the rows
    parents = [r for r in runs if r.data.tags.get("falcon_lab.sweep") == "parent"]
    runs = [r for r in runs if r.data.tags.get("falcon_lab.sweep") != "parent"]
    if not runs:
        raise ValueError(f"experiment={experiment_name!r}: no runs")
    # columns
    cols = [(t, k, f, lo) for (t, k, f, lo) in BASE_COLUMNS]
    keys = sorted({k for r in runs for k in r.data.metrics})
    seen = {k for _, k, _, _ in cols}
    for pre, suf, fmt, lo in EVAL_PREFIXES:
        for k in keys:
            if k.startswith(pre) and k.endswith(suf) and k not in seen and "time" not in k \
                    and "tokens" not in k and "loss_at_position" not in k and "best/" not in k:
                cols.append((k, k, fmt, lo))
                seen.add(k)
    for k in metrics or []:
        if k not in seen:
            cols.append((k, k, "{:.4g}", False))
            seen.add(k)
    rows = []
    for r in runs:
        name, mix = _label(r)
        state = r.data.metrics.get("mqar/state_numel") or r.data.tags.get("state_numel_per_seq")
        params = r.data.tags.get("params_total")
        vals = [_value(client, r, k) for _, k, _, _ in cols]
        rows.append({"run": name, "run_id": r.info.run_id, "mixer": mix, "status": r.info.status, "_client": client,
                     "params": int(params) if params and params.isdigit() else None,
                     "state": int(float(state)) if state not in (None, "None") else None, "vals": vals})
    used = [i for i in range(len(cols)) if any(row["vals"][i] is not None for row in rows)]
    out = Path(out_dir or Path.cwd() / "outputs" / "compare" / experiment_name).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    head = ["run", "id", "mixer", "status", "params", "state/seq"] + [cols[i][0] for i in used]
    lines = [f"# {experiment_name}: {len(rows)} runs", "",
             f"MLflow: `{uri}`, experiment id {exp.experiment_id}. Best value per column in **bold**.", ""]
    if parents:
        lines += ["Sweep parent runs (their trials are the rows): " + ", ".join(
            f"{r.data.tags.get('mlflow.runName', r.info.run_id[:8])} ({r.info.run_id[:8]})" for r in parents), ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    best = {}
    for i in used:
        vs = [row["vals"][i] for row in rows if row["vals"][i] is not None]
        if len(vs) > 1:
            best[i] = min(vs) if cols[i][3] else max(vs)
    for row in rows:
        cells = [row["run"], row["run_id"][:8], row["mixer"], row["status"],
                 f"{row['params']:,}" if row["params"] else "", f"{row['state']:,}" if row["state"] else ""]
        for i in used:
            v = row["vals"][i]
            s = "" if v is None else cols[i][2].format(v)
            cells.append(f"**{s}**" if i in best and v == best[i] else s)
        lines.append("| " + " | ".join(cells) + " |")
    md = out / f"compare_{experiment_name}.md"
    plots = _plots(rows, cols, used, out, experiment_name)
    lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    md.write_text("\n".join(lines) + "\n")
    return {"markdown": str(md), "plots": plots, "rows": rows, "columns": [cols[i][0] for i in used]}


def _artifact_json(client, run_id, path):
    if client is None:
        return None
    import json
    import tempfile
    try:
        with tempfile.TemporaryDirectory() as d:
            local = client.download_artifacts(run_id, path, d)
            with open(local) as f:
                return json.load(f)
    except Exception:  # no such artifact
        return None


def _plots(rows, cols, used, out, exp):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plots = []
    labels = [f"{r['run']}\n{r['mixer']}" for r in rows]
    # one bar chart per headline metric that several runs have
    for title in ("val ppl (best)", "addition/ood_mean", "tokens/s"):
        idx = next((i for i in used if cols[i][0] == title), None)
        if idx is None:
            continue
        pts = [(lab, r["vals"][idx]) for lab, r in zip(labels, rows) if r["vals"][idx] is not None]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(1.5 + 0.9 * len(pts), 3.5))
        ax.bar(range(len(pts)), [v for _, v in pts])
        ax.set_xticks(range(len(pts)), [p for p, _ in pts], fontsize=6, rotation=30, ha="right")
        ax.set_title(f"{exp}: {title}")
        fig.tight_layout()
        p = out / f"compare_{title.replace('/', '_').replace(' ', '_').replace('(', '').replace(')', '')}.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        plots.append(str(p))
    # addition accuracy vs width, one curve per run that has an evaluate result
    curves = []
    for r in rows:
        d = _artifact_json(r.get("_client"), r["run_id"], "eval/addition.json")
        if d:
            res = d.get("result", {})
            pts = sorted((int(w), s["exact"]) for part in ("val", "ood") for w, s in res.get(part, {}).items())
            if pts:
                curves.append((f"{r['run']} {r['mixer']}", pts, max((int(w) for w in res.get("val", {})), default=None)))
    if curves:
        fig, ax = plt.subplots(figsize=(7, 3.8))
        for lab, pts, last_train in curves:
            ax.plot([w for w, _ in pts], [100 * v for _, v in pts], "o-", ms=2.5, label=lab)
        if curves[0][2]:
            ax.axvline(curves[0][2] + 0.5, color="gray", lw=0.8)
        ax.set_xlabel("operand width (digits)")
        ax.set_ylabel("exact match (%), teacher-forced")
        ax.set_ylim(-2, 102)
        ax.set_title(f"{exp}: addition accuracy vs width")
        ax.legend(fontsize=6)
        fig.tight_layout()
        p = out / "compare_addition_vs_width.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        plots.append(str(p))
    # MQAR accuracy vs state size (equal-memory comparison)
    idx = next((i for i in used if cols[i][0] == "mqar/acc_mean"), None)
    if idx is not None:
        from falcon_lab.evaluation.mqar import plot_accuracy_vs_state
        pts = [{"label": f"{r['run']} {r['mixer']}", "state_numel": r["state"], "acc": r["vals"][idx]}
               for r in rows if r["state"] and r["vals"][idx] is not None]
        if pts:
            plots.append(plot_accuracy_vs_state(pts, str(out / "compare_mqar_vs_state.png"),
                                                f"{exp}: MQAR accuracy vs state size"))
    return plots


def main(argv=None):
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    try:
        res = compare(**args)
    except ValueError as e:
        raise SystemExit(f"compare: {e}")
    print(Path(res["markdown"]).read_text())
    print(f"[falcon_lab] table: {res['markdown']}\n[falcon_lab] plots: {', '.join(res['plots']) or 'none'}")


if __name__ == "__main__":
    main()
