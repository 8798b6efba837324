"""Is a Falcon op bound by the host (Python, dispatch, launches) or by its kernels? One process, one GPU, alone.

For each op and shape, forward+backward, bf16, same inputs as `falcon_lab.bench kernels`:
  * `bench_ms`: triton.testing.do_bench's median (what the kernel benchmark reports);
  * `host_ms`:  host time per call with the GPU never waited for (N calls submitted back to back, then one sync:
                the time to *submit* one call). When host_ms >= the GPU's busy time the GPU waits for the host;
  * `gpu_ms`:   the GPU's busy time per call (sum of the device kernels' durations in a torch.profiler trace);
  * `peak_mb`:  peak allocated memory of one forward+backward.
Variants of the Falcon ops, each its own row, in the same run:
  * `eager_path=function|operator`: the Triton core through its autograd.Function (the default for plain eager
    calls since this script was written) or forced through the `falcon_lab::chunk_core_fwd` custom operator (the
    default before);
  * `prep=fused|torch`: the op's prep as the Triton kernels (kernels/triton/prep.py, prep_window.py for 3A; run with
    FALCON_TRITON_UNPROVEN=1 for those not in PROVEN_PREP) or as PyTorch (kernels/prep.py); `prep_used` says
    which one the dispatch chose.
Run on the GPU machine from the repo root:
    FALCON_TRITON_UNPROVEN=1 python3 experiments/h200/host_bound.py --out $OUT/host_bound
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch

from falcon_lab.benchmarking.kernels import WINDOW, _commit, gpu_ms, host_ms, make_fn, make_inputs

SHAPES = [(16, 2048, 12, 64), (1, 32768, 6, 128)]
# falcon-3A: the default (the banded scan since 2026-12-03); falcon-3A-scans: its W scans (bench kernels' op labels)
OPS = ["falcon-1", "falcon-1A", "falcon-3A", "falcon-3A-scans", "fla_chunk_delta_rule", "sdpa_flash"]


@contextlib.contextmanager
def eager_path(path: str):
    """Force the Triton core's eager calls through the custom operator ("operator") or leave the default."""
    import falcon_lab.kernels.triton as kt
    from falcon_lab.kernels.triton import ops

    if path == "function":
        yield
        return

    def via_operator(q, x, v, eta, g, S0, family, cfg):
        out = ops.chunk_core_fwd(q, x, v, eta, g, S0, family, [int(c) for c in cfg])
        return out[0], out[1]

    prev = kt.chunk_core
    kt.chunk_core = via_operator
    try:
        yield
    finally:
        kt.chunk_core = prev


@contextlib.contextmanager
def prep_path(path: str):
    """The Triton backend's prep: "fused" (kernels/triton/prep.py, prep_window.py) or "torch" (kernels/prep.py).
    The fused one runs on CUDA for the variants in PROVEN_PREP, or any with FALCON_TRITON_UNPROVEN=1."""
    import falcon_lab.kernels.triton as kt

    prev = kt._PREP
    kt._PREP = path
    try:
        yield
    finally:
        kt._PREP = prev


def measure(op, shape, n_host=30):
    import triton

    B, T, H, K = shape
    ins = [t.requires_grad_(True) for t in make_inputs(op, B, T, H, K, K)]
    fn = make_fn(op)
    do = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)

    def fb():
        fn(*ins).backward(do)

    bench = triton.testing.do_bench(fb, warmup=25, rep=100, grad_to_none=ins, return_mode="median")
    host = host_ms(fb, ins, n=n_host)
    gpu, per, n_kernels = gpu_ms(fb, ins, n=5)
    kernel_ms = {k: round(v, 4) for k, v in per.items()}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fb()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2 ** 20
    return dict(bench_ms=round(bench, 4), host_ms=round(host, 4),
                gpu_ms=round(gpu, 4) if gpu is not None else None,
                gpu_kernels_per_call=round(n_kernels, 1) if n_kernels is not None else None,
                peak_mb=round(peak, 1), kernel_ms=kernel_ms)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ops", default=",".join(OPS))
    a = ap.parse_args()
    import triton

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=_commit())
    rows = []
    for shape in SHAPES:
        for op in a.ops.split(","):
            combos = [("fused", "function"), ("torch", "function"), ("torch", "operator")] if op.startswith("falcon") \
                else [("-", "-")]
            for prep, path in combos:
                row = dict(op=op, shape=list(shape), prep=prep, eager_path=path, **meta)
                try:
                    with prep_path(prep if prep != "-" else "fused"), eager_path(path if path != "-" else "function"):
                        if op.startswith("falcon"):  # what the op's dispatch says it runs, not what was asked
                            import falcon_lab.kernels.triton as kt
                            from falcon_lab.benchmarking.kernels import op_variant
                            from falcon_lab.kernels.spec import FalconSpec

                            row["prep_used"] = kt.prep_check(FalconSpec.from_variant(op_variant(op)), window=WINDOW,
                                                             dtype=torch.bfloat16)[1]
                        row.update(measure(op, shape))
                except Exception as e:  # noqa: BLE001 - a failing row is reported, the run goes on
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
                (out / "host_bound.json").write_text(json.dumps(rows, indent=1))
                torch.cuda.empty_cache()
    lines = [f"{meta}", "",
             "| op | shape | prep | eager path | bench ms | host ms | GPU busy ms | kernels/call | peak MB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {'x'.join(map(str, r['shape']))} | {r['prep']} | {r['eager_path']} | "
                     f"{r.get('bench_ms')} | {r.get('host_ms')} | {r.get('gpu_ms')} | "
                     f"{r.get('gpu_kernels_per_call')} | "
                     f"{r.get('peak_mb')} | {r.get('error', '')}")
    (out / "host_bound.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
