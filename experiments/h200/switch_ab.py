"""A/B of a kernel switch inside one process: the same op, shape and inputs timed with each value of a module-level
switch, interleaved, so that process-to-process spread (which made Falcon-1A's rowsum-vs-split comparison of
2026-12-03 inconclusive: kernels_2026-12-03e) does not enter the comparison. One GPU, alone.

    python3 experiments/h200/switch_ab.py --switch chunk.A_DTYPE=auto,fp32 --ops falcon-1,falcon-3 \
        --shapes 0,1,2,3 --reps 3 --out $OUT/switch_ab

`--switch MODULE.ATTR=v1,v2[,...]`: an attribute of `falcon_lab.kernels.triton.MODULE` read at call time (the
kernels' switches are: chunk.A_DTYPE, common.STATE_BV, window_linear.WL_BWD_BV, percol.INTRA, percol_delta.SOLVE,
percol_delta.BWD_SOLVE, and the package's own as triton._FALCON_3, triton._FALCON_3A); values are strings as the environment variable takes them. For each shape and op, `--reps`
rounds; each round times every value once, in an order that alternates between rounds. Per (op, shape, value):
the medians over rounds of `gpu_ms` (the kernels' summed device time per forward+backward, torch.profiler: what a
kernel choice changes), `bench_ms` (do_bench's median, as `bench kernels`), `host_ms`, and the peak; then each value's
gpu_ms against the first value's. Output: OUT/switch_ab.json and .md with GPU, versions and commit.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

SHAPES = [(16, 2048, 12, 64), (1, 32768, 6, 128), (4, 8192, 12, 64), (16, 2048, 6, 128)]  # bench kernels' order


def parse_switch(text: str):
    """'chunk.BWD_MAIN=split,rowsum' -> ('chunk', 'BWD_MAIN', ['split', 'rowsum'])."""
    try:
        target, values = text.split("=", 1)
        module, attr = target.rsplit(".", 1)
        vals = [v for v in values.split(",") if v]
        assert module and attr and len(vals) >= 2 and len(set(vals)) == len(vals)
    except (ValueError, AssertionError):
        raise SystemExit(f"--switch must be MODULE.ATTR=v1,v2[,...] with distinct values, got {text!r}") from None
    return module, attr, vals


def module_path(module: str) -> str:
    """'chunk' -> falcon_lab.kernels.triton.chunk; 'triton' -> the package itself (its switches: _FALCON_3, _FALCON_3A,
    _PREP, _VARLEN, read at call time by `core`)."""
    return "falcon_lab.kernels.triton" + ("" if module == "triton" else f".{module}")


def round_order(values: list, r: int) -> list:
    """The order of the values in round r: as given in even rounds, reversed in odd ones."""
    return list(values) if r % 2 == 0 else list(reversed(values))


def summarize(rows: list, values: list) -> list:
    """rows: dicts with op, shape, value, gpu_ms, bench_ms, host_ms, peak_mb (one per round) -> one dict per
    (op, shape, value) with the medians over rounds, the round count and gpu_ms / gpu_ms of values[0]."""
    out = []
    keys = []
    for r in rows:
        k = (r["op"], tuple(r["shape"]))
        if k not in keys:
            keys.append(k)
    for op, shape in keys:
        med = {}
        for v in values:
            sel = [r for r in rows if r["op"] == op and tuple(r["shape"]) == shape and r["value"] == v]
            if not sel:
                continue
            med[v] = dict(op=op, shape=list(shape), value=v, rounds=len(sel),
                          **{m: round(statistics.median(r[m] for r in sel), 4)
                             for m in ("gpu_ms", "bench_ms", "host_ms", "peak_mb")},
                          gpu_ms_spread=[round(min(r["gpu_ms"] for r in sel), 4),
                                         round(max(r["gpu_ms"] for r in sel), 4)])
        base = med.get(values[0])
        for v in values:
            if v in med:
                med[v]["gpu_vs_first"] = round(med[v]["gpu_ms"] / base["gpu_ms"], 3) if base else None
                out.append(med[v])
    return out


def to_markdown(summary: list, meta: dict) -> str:
    head = (f"Switch {meta['switch']} — {meta['gpu']}, torch {meta['torch']}, Triton {meta['triton']}, commit "
            f"{meta['commit']}, {meta['reps']} interleaved rounds per value (medians; fwd+bwd, bf16)\n\n"
            "| op | B×T×H×K | value | gpu ms | gpu ms min–max | vs first value | bench ms | host ms | peak MB |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {s['op']} | {'×'.join(map(str, s['shape']))} | {s['value']} | {s['gpu_ms']} | "
             f"{s['gpu_ms_spread'][0]}–{s['gpu_ms_spread'][1]} | {s['gpu_vs_first']} | {s['bench_ms']} | "
             f"{s['host_ms']} | {s['peak_mb']} |" for s in summary]
    return head + "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--switch", required=True)
    ap.add_argument("--ops", default="falcon-1,falcon-1A")
    ap.add_argument("--shapes", default="0,1,2,3", help="indices into bench kernels' four shapes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    module, attr, values = parse_switch(a.switch)
    import torch
    import triton

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from host_bound import measure  # noqa: E402 (this folder's scripts are not a package)

    from falcon_lab.benchmarking.kernels import _commit

    mod = importlib.import_module(module_path(module))
    if not hasattr(mod, attr):
        raise SystemExit(f"falcon_lab.kernels.triton.{module} has no attribute {attr!r}")
    default = getattr(mod, attr)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(switch=a.switch, default=str(default), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, commit=_commit(), reps=a.reps)
    rows = []
    try:
        for si in (int(s) for s in a.shapes.split(",")):
            shape = SHAPES[si]
            for op in a.ops.split(","):
                for r in range(a.reps):
                    for v in round_order(values, r):
                        setattr(mod, attr, v)
                        m = measure(op, shape)
                        rows.append(dict(op=op, shape=list(shape), value=v, round=r, **m))
                        print(f"{op:12s} {shape} {attr}={v:8s} round {r}: gpu {m['gpu_ms']} ms, bench "
                              f"{m['bench_ms']} ms, host {m['host_ms']} ms", flush=True)
    finally:
        setattr(mod, attr, default)
        summary = summarize(rows, values)
        (out / "switch_ab.json").write_text(json.dumps(dict(meta=meta, rows=rows, summary=summary), indent=1))
        (out / "switch_ab.md").write_text(to_markdown(summary, meta))
    print(to_markdown(summary, meta))


if __name__ == "__main__":
    main()
