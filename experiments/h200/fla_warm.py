"""Autotune fla's chunk_delta_rule (forward and backward) at the kernel benchmark's four shapes and keep the results
on disk, so that a later `python -m falcon_lab.bench kernels` (even on a fresh machine) finishes within one 10-minute
device call: on 2026-12-02 fla's first-call autotuning took ~140 s per shape and the default run ran out of time at
three of the four (benchmarks/results/h200_logs/kernels_2026-12-02e/). Triton writes each autotuned kernel's timings
to its cache when TRITON_CACHE_AUTOTUNING=1 and reads them back at the next call with the same key (same Triton, GPU,
kernel source and tuning key).

On the GPU machine, from the repo root (one call, ~10 min; then bring the cache back):
    export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=$PWD/.tcache
    python3 experiments/h200/fla_warm.py
    (cd .tcache && find . -name '*.autotune.json' | tar czf $OUT/tcache.tgz -T -)
Here: `mkdir -p .tcache && tar xzf .../tcache.tgz -C .tcache` (ignored by git); the next call carries it
(`carry: [".whl", ".tcache"]`) and runs
    TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=$PWD/.tcache python3 -m falcon_lab.bench kernels
Only the autotune timings need to travel (kernels recompile in seconds); `--shapes` takes a subset, e.g. 2,3,4.
"""
import argparse
import time

import torch

from falcon_lab.benchmarking.kernels import SHAPES, make_fn, make_inputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1,2,3,4", help="1-based indices into the benchmark's SHAPES")
    a = ap.parse_args()
    fn = make_fn("fla_chunk_delta_rule")
    for i in (int(s) for s in a.shapes.split(",")):
        B, T, H, K = SHAPES[i - 1]
        t0 = time.time()
        ins = [t.requires_grad_(True) for t in make_inputs("fla_chunk_delta_rule", B, T, H, K, K)]
        fn(*ins).backward(torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
        print(f"fla chunk_delta_rule {SHAPES[i - 1]}: first fwd+bwd (autotuning) {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
