"""Where an op's host time goes: cProfile over back-to-back forward+backward calls on the GPU machine.

At the benchmark's small shapes Falcon-1A's op (and at times Falcon-1's) runs at its host's pace: `bench kernels` and
`switch_ab.py` report a host submit time of 1.4-1.9 ms against 0.8-1.5 ms of GPU time (2026-12-03). On a CPU machine
with every Triton launch stubbed the Python around the kernels costs ~0.25 ms per fwd+bwd (Falcon-1 and -1A at a tiny
shape, 2 cores): the rest is launches, CUDA-side torch calls and autograd, which only the GPU machine can show. Ours.

    python3 experiments/h200/host_profile.py --ops falcon-1A,falcon-1 --shape 0 --calls 200 --out $OUT/host_profile

Per op: OUT/<op>.txt with the calls' host time per fwd+bwd (no synchronisation inside the loop) and the cProfile
tables by total and by own time, and OUT/host_profile.json with the per-call time and the top functions.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

SHAPES = [(16, 2048, 12, 64), (1, 32768, 6, 128), (4, 8192, 12, 64), (16, 2048, 6, 128)]  # bench kernels' order


def top_functions(stats: pstats.Stats, n: int = 25) -> list:
    """The n functions with the most own time: (file:line(name), calls, own seconds, cumulative seconds)."""
    rows = []
    for (file, line, name), (_cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append(dict(function=f"{Path(file).name}:{line}({name})", calls=nc, own_s=round(tt, 6),
                         cum_s=round(ct, 6)))
    return sorted(rows, key=lambda r: -r["own_s"])[:n]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="falcon-1A,falcon-1")
    ap.add_argument("--shape", type=int, default=0)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from falcon_lab.benchmarking.kernels import make_fn, make_inputs

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    B, T, H, K = SHAPES[a.shape]
    result = {}
    for op in a.ops.split(","):
        ins = [t.requires_grad_(True) for t in make_inputs(op, B, T, H, K, K)]
        fn = make_fn(op)
        do = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)

        def fb():
            for t in ins:
                t.grad = None
            fn(*ins).backward(do)
        for _ in range(20):  # compile, autotune, warm the allocator
            fb()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fb()
        host_ms = (time.perf_counter() - t0) / a.calls * 1e3
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            fb()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        st = pstats.Stats(prof, stream=text)
        text.write(f"{op} {B}x{T}x{H}x{K}: host {host_ms:.3f} ms per fwd+bwd without the profiler, "
                   f"{a.calls} calls\n\n")
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(30)
        (out / f"{op}.txt").write_text(text.getvalue())
        result[op] = dict(shape=[B, T, H, K], host_ms=round(host_ms, 4), calls=a.calls, top=top_functions(st))
        print(f"{op}: host {host_ms:.3f} ms per fwd+bwd", flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    (out / "host_profile.json").write_text(json.dumps(dict(meta=meta, ops=result), indent=1))


if __name__ == "__main__":
    main()
