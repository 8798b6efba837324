"""CPU benchmark: the chunked PyTorch form against the token-by-token recurrence.

    python -m falcon_lab.kernels.benchmark_cpu [--T 4096] [--H 4] [--D 64] [--reps 3]

Times forward and forward+backward (median of --reps after one warm-up) for all six variants in fp32,
checks that both forms agree before timing, and writes benchmarks/results/cpu_chunk_vs_recurrent.json
plus a Markdown table (the README's performance section quotes it). A script, not a test: timings
depend on the machine and are never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import chunk_falcon, recurrent_falcon

VARIANTS = ["1", "2", "3", "1A", "2A", "3A"]


def _inputs(variant, B, T, H, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
    v = torch.randn(B, T, H, D, generator=g)
    bshape = (B, T, H, D) if variant in ("2", "2A") else (B, T, H)
    beta = 0.2 + 1.6 * torch.rand(*bshape, generator=g)
    lam = 0.5 * torch.rand(B, T, H, generator=g)
    return [t.requires_grad_() for t in (q, k, v, beta, lam)]


def _time(fn, reps):
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _commit():
    try:
        root = Path(__file__).resolve().parents[2]
        sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True).strip()
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD", "--", "falcon_lab"], cwd=root) != 0
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def _cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--out", default="benchmarks/results/cpu_chunk_vs_recurrent.json")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = []
    print(f"CPU benchmark B={a.B} T={a.T} H={a.H} K=V={a.D} fp32, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {_cpu_name()}", flush=True)
    for variant in a.variants.split(","):
        x = _inputs(variant, a.B, a.T, a.H, a.D)
        kw = dict(variant=variant, window=a.window, lam_mode="scaled")
        with torch.no_grad():
            o_c, _ = chunk_falcon(*x, chunk_size=a.chunk_size, **kw)
            o_r, _ = recurrent_falcon(*x, **kw)
        err = ((o_c - o_r).norm() / o_r.norm()).item()
        if not err < 1e-4:
            raise SystemExit(f"variant {variant}: chunk and recurrent disagree (rel {err:.2e}); not timing")

        def fwd(f, **e):
            with torch.no_grad():
                f(*x, **kw, **e)

        def fwdbwd(f, **e):
            o, _ = f(*x, **kw, **e)
            o.square().mean().backward()
            for t in x:
                t.grad = None

        row = dict(variant=variant, B=a.B, T=a.T, H=a.H, K=a.D, V=a.D, window=a.window,
                   chunk_size=a.chunk_size, dtype="float32", rel_err=err)
        row["chunk_fwd_ms"] = _time(lambda: fwd(chunk_falcon, chunk_size=a.chunk_size), a.reps)
        row["recurrent_fwd_ms"] = _time(lambda: fwd(recurrent_falcon), max(1, a.reps // 2))
        row["chunk_fwdbwd_ms"] = _time(lambda: fwdbwd(chunk_falcon, chunk_size=a.chunk_size), a.reps)
        row["recurrent_fwdbwd_ms"] = _time(lambda: fwdbwd(recurrent_falcon), max(1, a.reps // 2))
        row["speedup_fwd"] = row["recurrent_fwd_ms"] / row["chunk_fwd_ms"]
        row["speedup_fwdbwd"] = row["recurrent_fwdbwd_ms"] / row["chunk_fwdbwd_ms"]
        rows.append(row)
        print(f"  Falcon-{variant:<2}  fwd {row['chunk_fwd_ms']:8.1f} ms vs {row['recurrent_fwd_ms']:8.1f} ms "
              f"({row['speedup_fwd']:5.1f}x)   fwd+bwd {row['chunk_fwdbwd_ms']:8.1f} ms vs "
              f"{row['recurrent_fwdbwd_ms']:8.1f} ms ({row['speedup_fwdbwd']:5.1f}x)", flush=True)
    meta = dict(cpu=_cpu_name(), cores=os.cpu_count(), threads=torch.get_num_threads(),
                torch=torch.__version__, python=platform.python_version(), commit=_commit(),
                date=time.strftime("%Y-%m-%d"))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [f"CPU: {meta['cpu']}, {meta['threads']} threads, torch {meta['torch']}, commit {meta['commit']}",
             "", "| variant | chunk fwd ms | recurrent fwd ms | speed-up | chunk fwd+bwd ms | recurrent fwd+bwd ms | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| Falcon-{r['variant']} | {r['chunk_fwd_ms']:.1f} | {r['recurrent_fwd_ms']:.1f} | "
                     f"{r['speedup_fwd']:.1f}× | {r['chunk_fwdbwd_ms']:.1f} | {r['recurrent_fwdbwd_ms']:.1f} | "
                     f"{r['speedup_fwdbwd']:.1f}× |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
