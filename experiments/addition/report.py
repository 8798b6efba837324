"""Table 3 side by side and the per-width plot, from the row JSONs that run_addition.py writes.

    python experiments/addition/report.py [--scale h200] [--results experiments/addition/results]

Writes <results>/<scale>/table.md and <results>/<scale>/per_width.png (accuracy per OOD width at the
best step, exact widths and, for the variable format, capped widths; ID accuracy against training
step). Numbers are read from the
row files only; the paper's column is its Table 3 as cited in PLAN.md (falcon-math.md §9). Rows
marked incomplete (a run stopped before its last step) are shown as such, never mixed silently
with complete ones.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# the paper's Table 3: mean OOD 33-48, d33, d48 (percent); Falcon-2A.3 and 3.3 were never run there
PAPER = {"transformer": (65.8, 97.0, 49.0), "retnet": (82.9, 99.0, 63.0), "mamba2": (75.2, 100.0, 51.0),
         "falcon_1a_1": (80.6, 100.0, 59.0), "falcon_1a_2": (85.2, 100.0, 63.0),
         "falcon_1a_3": (85.9, 100.0, 69.0), "falcon_3a_3": (87.2, 100.0, 69.0),
         "falcon_1_3": (68.8, 100.0, 48.0), "falcon_2a_3": None, "falcon_3_3": None, "falcon_2_3": None}
ORDER = list(PAPER)
LABEL = {"transformer": "Transformer (RoPE)", "retnet": "RetNet", "mamba2": "Mamba-2",
         "falcon_1a_1": "Falcon-1A.1", "falcon_1a_2": "Falcon-1A.2", "falcon_1a_3": "Falcon-1A.3",
         "falcon_3a_3": "Falcon-3A.3", "falcon_1_3": "Falcon-1.3", "falcon_2a_3": "Falcon-2A.3",
         "falcon_3_3": "Falcon-3.3", "falcon_2_3": "Falcon-2.3"}


def _pct(v):
    return "—" if v is None else f"{100 * v:.1f}"


def _agg(vals):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "—"
    if len(vals) == 1:
        return f"{100 * vals[0]:.1f}"
    return f"{100 * statistics.mean(vals):.1f} ({100 * min(vals):.1f}–{100 * max(vals):.1f})"


def load(results: Path, scale: str) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for p in sorted((results / scale).glob("*_seed*.json")):
        r = json.loads(p.read_text())
        rows.setdefault(r["row"], []).append(r)
    return rows


def table(rows: dict[str, list[dict]], scale: str) -> str:
    fmts = sorted({r["format"] for rs in rows.values() for r in rs})
    lo, hi = next(iter(rows.values()))[0]["ood_widths"]
    capped = any(r.get("ood_cap_mean") is not None for rs in rows.values() for r in rs)
    out = [f"Scale `{scale}`; surface format(s): {', '.join(fmts) or '—'}. Percent exact match of the whole "
           "answer (teacher-forced), at the best step by ID validation; several seeds: mean (min–max).", ""]
    if capped:
        out += ["OOD at an exact width: both operands have exactly that many digits. Capped: each operand's "
                "width drawn from U{1..cap}, as the authors' generator reads a width (most capped examples lie "
                "inside the training widths).", ""]
    head = f"| model | seeds | best step | ID val | mean OOD {lo}–{hi} | d{lo} | d{hi} |"
    rule = "|---|---|---|---|---|---|---|"
    if capped:
        head += f" capped: mean {lo}–{hi} | capped d{lo} | capped d{hi} |"
        rule += "---|---|---|"
    out += [head + " paper: mean OOD 33–48 / d33 / d48 |", rule + "---|"]
    for name in ORDER + sorted(set(rows) - set(ORDER)):
        rs = rows.get(name)
        if not rs:
            continue
        inc = [r for r in rs if not r.get("complete")]
        seeds = ", ".join(str(r["seed"]) + ("*" if not r.get("complete") else "") for r in rs)
        steps = ", ".join(str(r.get("best_step")) for r in rs)
        paper = PAPER.get(name)
        ptxt = "not run in the paper" if paper is None else " / ".join(f"{v:.1f}" for v in paper)
        line = (f"| {LABEL.get(name, name)} | {seeds} | {steps} | {_agg([r['val_acc'] for r in rs])} | "
                f"{_agg([r['ood_mean'] for r in rs])} | {_agg([r['acc_first_ood'] for r in rs])} | "
                f"{_agg([r['acc_last_ood'] for r in rs])} |")
        if capped:
            line += (f" {_agg([r.get('ood_cap_mean') for r in rs])} | {_agg([r.get('acc_cap_first') for r in rs])} | "
                     f"{_agg([r.get('acc_cap_last') for r in rs])} |")
        out.append(line + f" {ptxt} |")
        if inc:
            out[-1] = out[-1][:-1] + f" (* incomplete: stopped at step {', '.join(str(r['last_eval_step']) for r in inc)}) |"
    return "\n".join(out) + "\n"


def _per_width(rs: list[dict], key: str) -> dict[int, float] | None:
    """Mean over seeds of one per-width split (``ood_by_width`` / ``ood_cap_by_width``) at the best step."""
    per = []
    for r in rs:
        best = next((h for h in r["history"] if h["step"] == r.get("best_step")), None)
        if best and best.get(key):
            per.append({int(w): v for w, v in best[key].items()})
    if not per:
        return None
    ws = sorted(set.intersection(*[set(p) for p in per]))
    return {w: 100 * statistics.mean(p[w] for p in per) for w in ws}


def plot(rows: dict[str, list[dict]], path: Path, scale: str) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ORDER + sorted(set(rows) - set(ORDER))
    capped = any(_per_width(rows.get(n, []), "ood_cap_by_width") for n in names)
    panels = [("ood_by_width", "OOD, exact width (both operands that many digits)")]
    if capped:
        panels.insert(0, ("ood_cap_by_width", "OOD, capped width (each operand U{1..cap} digits)"))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5.2 * (len(panels) + 1), 4.3))
    drawn = 0
    for i, name in enumerate(names):
        rs = rows.get(name, [])
        style = dict(linestyle="-" if name.startswith("falcon") else "--", color=plt.get_cmap("tab10")(i % 10))
        for ax, (key, _) in zip(axes, panels):
            pw = _per_width(rs, key)
            if pw:
                ax.plot(list(pw), list(pw.values()), marker="o", ms=3, **style)
                drawn += 1
        curves = [{h["step"]: h["addition/val_acc"] for h in r["history"]} for r in rs if r.get("history")]
        if curves:
            steps = sorted(set.intersection(*[set(c) for c in curves]))
            axes[-1].plot(steps, [100 * statistics.mean(c[t] for c in curves) for t in steps], **style,
                          label=f"{LABEL.get(name, name)} (n={len(curves)})")
    if not drawn:
        plt.close(fig)
        return None
    for ax, (_, title) in zip(axes, panels):
        ax.set_xlabel("operand width (digits)")
        ax.set_ylabel("exact match of the whole answer (%)")
        ax.set_title(title + ", best step", fontsize=8)
    axes[-1].set_xlabel("training step")
    axes[-1].set_ylabel("ID validation exact match (%)")
    axes[-1].set_title("in distribution (widths 1–32) while training", fontsize=8)
    for ax in axes:
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(f"Variable-length addition ({scale}); mean over seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="h200")
    ap.add_argument("--results", default=str(HERE / "results"))
    a = ap.parse_args(argv)
    results = Path(a.results)
    rows = load(results, a.scale)
    if not rows:
        print(f"[report] no row files in {results / a.scale}", file=sys.stderr)
        return 1
    md = table(rows, a.scale)
    (results / a.scale / "table.md").write_text(md)
    p = plot(rows, results / a.scale / "per_width.png", a.scale)
    print(md)
    print(f"[report] wrote {results / a.scale / 'table.md'}" + (f" and {p}" if p else " (no per-width data to plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
