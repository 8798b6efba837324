"""The peak memory of a Triton op's forward+backward, predicted on a CPU machine from its allocations alone.

`bench kernels` reports each op's peak on the GPU: torch.cuda.max_memory_allocated over one forward+backward, with
the inputs and the output gradient already allocated (its `peak_mem_op_mb`, the op's own, leaves out what earlier
work left allocated; `switch_ab.py` / `host_bound.py` run nothing else first, so their peak is the op's own too). The kernels write into buffers the host code allocates, so the
same number follows from the allocations: here the op runs on CPU tensors at the benchmark's real shapes with every
Triton launch replaced by a no-op (the interpreter's launcher, stubbed: no kernel runs, so nothing is computed and the
gradients are garbage), under torch.profiler's memory events, and the peak is the inputs' bytes plus the largest
total the CPU allocator reaches during the call. What it cannot see: allocations inside kernels (none in ours),
the CUDA caching allocator's 512-byte rounding, and code that allocates differently on CUDA than on CPU. Ours; a
tool for judging a memory change before a GPU session (e.g. the allocation order of chunk.py's backward), checked
against the H200's measured peaks (tests/test_op_memory.py has the CPU-side logic; the README of
benchmarks/results/h200_logs/kernels_2026-12-03f/ the comparison).

    .venv/bin/python experiments/h200/op_memory.py --ops falcon-1,falcon-3 --shapes 0,1,2,3 [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the interpreter's launcher, stubbed below

SHAPES = [(16, 2048, 12, 64), (1, 32768, 6, 128), (4, 8192, 12, 64), (16, 2048, 6, 128)]  # bench kernels' order


def stub_launches():
    """Every Triton kernel launch becomes a no-op (the interpreter's launcher)."""
    from triton.runtime import interpreter

    interpreter.InterpretedFunction.__getitem__ = lambda self, grid: (lambda *a, **k: None)


def peak_from_trace(events: list) -> int:
    """The most bytes a chrome trace's [memory] events show allocated above what was allocated when the first event
    came ('Total Allocated' counts on from an earlier profile in the same process: the baseline is the first event's
    total before its own allocation)."""
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    if not mem:
        return 0
    base = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in mem) - base


def op_peak_mb(op: str, shape) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from falcon_lab.benchmarking.kernels import make_fn, make_inputs

    B, T, H, K = shape
    ins = [t.requires_grad_(True) for t in make_inputs(op, B, T, H, K, K, dev="cpu")]
    do = torch.randn(B, T, H, K, dtype=torch.bfloat16)
    fn = make_fn(op)
    base = sum(t.numel() * t.element_size() for t in ins + [do])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*ins).backward(do)
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(str(Path(d) / "t.json"))
        events = json.loads((Path(d) / "t.json").read_text())["traceEvents"]
    peak = base + peak_from_trace(events)
    return dict(op=op, shape=list(shape), inputs_mb=round(base / 2 ** 20, 1), peak_mb=round(peak / 2 ** 20, 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="falcon-1,falcon-1A,falcon-3,falcon-3A")
    ap.add_argument("--shapes", default="0")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    stub_launches()
    rows = []
    for si in (int(s) for s in a.shapes.split(",")):
        for op in a.ops.split(","):
            r = op_peak_mb(op, SHAPES[si])
            rows.append(r)
            print(f"{op:12s} {'×'.join(map(str, r['shape'])):16s} predicted peak {r['peak_mb']:8.1f} MB "
                  f"(inputs and dO {r['inputs_mb']} MB)", flush=True)
    if a.json:
        import subprocess

        import torch

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or None
        from falcon_lab.benchmarking.kernels import run_flags

        meta = dict(tool="experiments/h200/op_memory.py (CPU, Triton launches stubbed)", commit=commit, flags=run_flags(),
                    torch=torch.__version__, measure="inputs + dO + the allocator's peak over one forward+backward, "
                    "as host_bound.measure / switch_ab.py take torch.cuda.max_memory_allocated")
        Path(a.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
