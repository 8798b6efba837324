"""`python -m falcon_lab.compare experiment=NAME [tracking_uri=URI] [out_dir=DIR] [metrics=[k1,k2]]
    [status=FINISHED] [min_steps=N] [tag=KEY=VALUE ...] [ref=ARM] [group=false]`

Gathers an MLflow experiment's runs into one Markdown table (perplexities, downstream accuracy,
addition and extrapolation, tokens/s, state size, ...) and PNG plots, the paper's tables for any set
of runs. ``experiment_name=`` is accepted for ``experiment=``. Columns appear when at least one run
has the metric. Written to ``out_dir`` (default ``./outputs/compare/<experiment>``).

Filters: ``status=FINISHED`` (or ``FINISHED,KILLED``), ``min_steps=N`` (runs that trained fewer steps
are left out, e.g. a stale 20-step smoke run), ``tag=KEY=VALUE`` (repeatable; e.g. ``tag=arm=gate=ctx_eta``).

Arms: runs are grouped by arm (the ``arm`` tag a multirun sets, e.g. ``gate=ctx_eta``; otherwise the
label plus the settings that differ between the runs, seed excluded) into a second table: n, mean ± std
over seeds of every column, and a paired difference of the first column (val loss) against the
reference arm ``ref=ARM`` (default: the first arm), over the seeds both arms ran. ``group=false`` omits it.
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
        if k not in ("experiment_name", "tracking_uri", "out_dir", "metrics", "status", "min_steps", "tag", "ref",
                     "group"):
            raise SystemExit(f"compare: unknown argument {k!r} (experiment, tracking_uri, out_dir, metrics, "
                             "status, min_steps, tag, ref, group)")
        if k == "metrics":
            v = [x.strip() for x in v.strip("[]").split(",") if x.strip()]
        if k == "min_steps":
            try:
                v = int(v)
            except ValueError:
                raise SystemExit(f"compare: min_steps={v!r}: expected an integer") from None
        if k == "group":
            if v.lower() not in ("true", "false"):
                raise SystemExit(f"compare: group={v!r}: expected true or false")
            v = v.lower() == "true"
        if k == "tag":
            tk, eq, tv = v.partition("=")
            if not eq or not tk:
                raise SystemExit(f"compare: tag={v!r}: expected tag=KEY=VALUE")
            out.setdefault("tags", {})[tk] = tv
            continue
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
    """(run name, mixer label). The label is the effective one: `label` tag of newer runs, else recomputed from
    the knob.* tags (runs logged before the tags carried effective knobs: the ctx_eta arm of a `.1` config is
    Falcon-1A.2)."""
    t = run.data.tags
    name = t.get("mlflow.runName") or run.info.run_id[:8]
    if t.get("label"):
        return name, t["label"]
    if t.get("mixer") == "falcon" and t.get("variant"):
        from falcon_lab.training.arms import falcon_label

        none = (None, "None", "null")
        mixer = {"name": "falcon", "variant": t["variant"].removeprefix("Falcon-"),
                 "preset": None if t.get("preset") in none else t.get("preset")}
        for k in ("qk_norm", "gate", "lam"):
            mixer[k] = None if t.get(f"knob.{k}") in none else t.get(f"knob.{k}")
        w = t.get("knob.window")
        mixer["window"] = int(w) if w and w.isdigit() else None
        try:
            return name, falcon_label(mixer)
        except Exception:  # unreadable tags: the old label
            pass
    mix = t.get("variant") or t.get("mixer") or ""
    preset = t.get("preset")
    if preset and preset not in ("None", "null"):
        mix += f".{preset}" if not preset.startswith(".") else preset
    return name, mix


SEED_PARAMS = ("seed", "data.seed")
NOT_ARM_PARAMS = ("logger.", "hydra", "ckpt_path", "run_dir", "checkpoint.", "metrics.", "checks.")


def _steps(client, run):
    """Optimizer steps the run trained: its `steps` tag, else the last step of train/loss."""
    s = run.data.tags.get("steps")
    if s and s.isdigit():
        return int(s)
    hist = client.get_metric_history(run.info.run_id, "train/loss")
    return max((h.step for h in hist), default=0) + (1 if hist else 0)


def _arms(runs, labels) -> list[str]:
    """The arm of each run: its `arm` tag (a multirun's, e.g. gate=ctx_eta), else its label plus the settings
    that differ between the untagged runs (seed and per-invocation keys excluded)."""
    from falcon_lab.training.arms import _short

    untagged = [i for i, r in enumerate(runs) if not r.data.tags.get("arm")]
    keys = sorted({k for i in untagged for k in runs[i].data.params})
    # a key differs when the runs that log it disagree: a knob logged only where it acts (Falcon's eta_max with
    # gate=ctx_eta) follows from one that differs (gate), and would only repeat it
    differ = [k for k in keys if k not in SEED_PARAMS and not k.startswith(NOT_ARM_PARAMS)
              and len({runs[i].data.params[k] for i in untagged if k in runs[i].data.params}) > 1]
    short = _short(differ)
    out = []
    for i, r in enumerate(runs):
        if r.data.tags.get("arm"):
            out.append(r.data.tags["arm"])
            continue
        diff = ",".join(f"{short[k]}={r.data.params.get(k)}" for k in differ)
        out.append(labels[i] + (f" {diff}" if diff else ""))
    return out


def compare(experiment_name: str, tracking_uri: str | None = None, out_dir: str | None = None,
            metrics: list[str] | None = None, status: str | list[str] | None = None, min_steps: int | None = None,
            tags: dict | None = None, ref: str | None = None, group: bool = True, plots: bool = True) -> dict:
    """The experiment's table (Markdown file in out_dir) and plots; returns {"markdown", "plots", "rows",
    "columns", "arms", "ref", "filtered"}. Filters: status, min_steps, tags; arms grouped unless group=False."""
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
    n_all = len(runs)
    if status:
        want = {x.strip().upper() for x in (status.split(",") if isinstance(status, str) else status) if x.strip()}
        runs = [r for r in runs if r.info.status in want]
    for tk, tv in (tags or {}).items():
        runs = [r for r in runs if r.data.tags.get(str(tk)) == str(tv)]
    steps = {r.info.run_id: _steps(client, r) for r in runs}
    if min_steps:
        runs = [r for r in runs if steps[r.info.run_id] >= int(min_steps)]
    if not runs:
        what = ", ".join(f"{k}={v}" for k, v in (("status", status), ("min_steps", min_steps), ("tags", tags)) if v)
        raise ValueError(f"experiment={experiment_name!r}: none of its {n_all} runs passes the filters ({what})")
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
    labels = [_label(r) for r in runs]
    arm_of = _arms(runs, [mix for _, mix in labels])
    for r, (name, mix), arm in zip(runs, labels, arm_of):
        state = r.data.metrics.get("mqar/state_numel") or r.data.tags.get("state_numel_per_seq")
        params = r.data.tags.get("params_total")
        vals = [_value(client, r, k) for _, k, _, _ in cols]
        rows.append({"run": name, "run_id": r.info.run_id, "mixer": mix, "status": r.info.status, "_client": client,
                     "arm": arm, "seed": r.data.params.get("seed"), "steps": steps[r.info.run_id],
                     "params": int(params) if params and params.isdigit() else None,
                     "state": int(float(state)) if state not in (None, "None") else None, "vals": vals})
    used = [i for i in range(len(cols)) if any(row["vals"][i] is not None for row in rows)]
    out = Path(out_dir or Path.cwd() / "outputs" / "compare" / experiment_name).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    head = ["run", "id", "mixer", "status", "seed", "steps", "params", "state/seq"] + [cols[i][0] for i in used]
    lines = [f"# {experiment_name}: {len(rows)} runs", "",
             f"MLflow: `{uri}`, experiment id {exp.experiment_id}. Best value per column in **bold**.", ""]
    if len(rows) < n_all:
        lines += [f"{n_all - len(rows)} of {n_all} runs left out by the filters ("
                  + ", ".join(f"{k}={v}" for k, v in (("status", status), ("min_steps", min_steps), ("tags", tags))
                              if v) + ").", ""]
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
        cells = [row["run"], row["run_id"][:8], row["mixer"], row["status"], row["seed"] or "", str(row["steps"]),
                 f"{row['params']:,}" if row["params"] else "", f"{row['state']:,}" if row["state"] else ""]
        for i in used:
            v = row["vals"][i]
            s = "" if v is None else cols[i][2].format(v)
            cells.append(f"**{s}**" if i in best and v == best[i] else s)
        lines.append("| " + " | ".join(cells) + " |")
    md = out / f"compare_{experiment_name}.md"
    arms, ref_arm = (_group(rows, cols, used, ref) if group else ([], None))
    res = {"markdown": str(md), "rows": rows, "columns": [cols[i][0] for i in used], "arms": arms, "ref": ref_arm,
           "experiment": experiment_name, "filtered": n_all - len(rows)}
    if arms:
        lines += ["", arms_markdown(res)]
    plots = _plots(rows, cols, used, out, experiment_name) if plots else []
    lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    md.write_text("\n".join(lines) + "\n")
    res["plots"] = plots
    return res


def _mean_std(vs):
    vs = [v for v in vs if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vs:
        return None, None, 0
    m = sum(vs) / len(vs)
    sd = math.sqrt(sum((v - m) ** 2 for v in vs) / (len(vs) - 1)) if len(vs) > 1 else None
    return m, sd, len(vs)


def _group(rows, cols, used, ref=None):
    """One entry per arm (in order of first run): n, seeds, (mean, std, n) per used column, and the paired
    difference of the first used column against the reference arm over the seeds both ran."""
    order: list[str] = []
    by: dict[str, list] = {}
    for row in rows:
        if row["arm"] not in by:
            order.append(row["arm"])
        by.setdefault(row["arm"], []).append(row)
    if ref is not None and ref not in by:
        raise ValueError(f"ref={ref!r}: no such arm; arms: {order}")
    ref = ref if ref is not None else (order[0] if len(order) > 1 else None)
    key = used[0] if used else None

    def per_seed(rs):
        d: dict = {}
        for r in rs:
            if r["vals"][key] is not None:
                d.setdefault(r["seed"], []).append(r["vals"][key])
        return {s: sum(v) / len(v) for s, v in d.items()}

    ref_seed = per_seed(by[ref]) if ref is not None and key is not None else {}
    arms = []
    for a in order:
        rs = by[a]
        stats = {cols[i][0]: _mean_std([r["vals"][i] for r in rs]) for i in used}
        diff = None
        if ref is not None and key is not None and a != ref:
            mine = per_seed(rs)
            pairs = [mine[s] - ref_seed[s] for s in mine if s in ref_seed]
            diff = _mean_std(pairs)
        mixers = sorted({r["mixer"] for r in rs})
        arms.append({"arm": a, "mixer": ", ".join(mixers), "n": len(rs),
                     "seeds": sorted({str(r["seed"]) for r in rs if r["seed"] is not None}),
                     "stats": stats, "diff": diff, "diff_column": cols[key][0] if key is not None else None,
                     "formats": {cols[i][0]: cols[i][2] for i in used}})
    return arms, ref


def _pm(m, sd, fmt):
    if m is None:
        return ""
    return fmt.format(m) + (f" ± {fmt.format(sd)}" if sd is not None else "")


def arms_markdown(res) -> str:
    """The arms table of a compare result (Markdown)."""
    arms = res.get("arms") or []
    if not arms:
        return ""
    cols = list(arms[0]["formats"])
    dcol = arms[0]["diff_column"]
    head = ["arm", "mixer", "n", "seeds"] + [f"{c} (mean ± std)" for c in cols]
    if res.get("ref") is not None and dcol:
        head.append(f"Δ {dcol} vs {res['ref']} (paired by seed)")
    lines = ["## Arms: mean ± std over runs (seeds)", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in arms:
        cells = [a["arm"], a["mixer"], str(a["n"]), ",".join(a["seeds"])]
        cells += [_pm(a["stats"][c][0], a["stats"][c][1], a["formats"][c]) for c in cols]
        if res.get("ref") is not None and dcol:
            if a["arm"] == res["ref"]:
                cells.append("(reference)")
            elif a["diff"] and a["diff"][2]:
                m, sd, n = a["diff"]
                fmt = a["formats"][dcol]
                cells.append(f"{m:+.4f}" + (f" ± {fmt.format(sd)}" if sd is not None else "") + f" (n={n})")
            else:
                cells.append("no common seed")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def format_arms(res) -> str:
    """What a multirun prints at its end: the arms table, or the per-run count when nothing groups."""
    title = f"[falcon_lab] {res.get('experiment', '')}: {len(res['rows'])} runs in {len(res['arms'])} arms"
    return title + "\n" + arms_markdown(res)


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
    print(Path(res["markdown"]).read_text())  # holds the arms table too
    print(f"[falcon_lab] table: {res['markdown']}\n[falcon_lab] plots: {', '.join(res['plots']) or 'none'}")


if __name__ == "__main__":
    main()
