"""Packed sequences on the GPU: native (the chunk kernels read cu_seqlens) against padded (gathered into [N, T_max]
rows first, the default before 2026-12-02), Falcon-1, -1A, -2A, -3A and -3 (W = 4), bf16, forward+backward of the
public op, one process.

    FALCON_TRITON_UNPROVEN=1 python3 experiments/h200/varlen_bench.py --out DIR

The batch: 16 x 2048 = 32768 tokens of documents whose lengths are drawn (seeded) from a log-normal around ~600
tokens, clipped to [16, 8192] (ours: a pre-training-like mix); plus the same tokens as 16 dense rows of 2048 without
cu_seqlens (no resets), the floor neither path can beat. H = 12, K = V = 64, chunk 64. Both paths are first checked
to agree (max |diff| of the output and of dq). Writes DIR/varlen_bench.json and prints one line per row.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch


def doc_lengths(total: int, seed: int = 0, mu: float = math.log(600), sigma: float = 1.0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    out = []
    while sum(out) < total:
        n = int(torch.exp(torch.randn((), generator=g) * sigma + mu).clamp(16, 8192))
        out.append(min(n, total - sum(out)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="varlen_bench")
    ap.add_argument("--variants", default="1,1A,2A,3A,3")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU under TRITON_INTERPRET=1, tiny sizes, wall-clock timing: checks the script, times nothing")
    a = ap.parse_args(argv)
    import triton

    import falcon_lab.kernels.triton as kt
    from falcon_lab.kernels import chunk_falcon
    from falcon_lab.kernels.spec import FalconSpec

    if a.smoke:
        dev, dt = "cpu", torch.float32
        B, T, H, K = 2, 64, 2, 16

        def bench(fn, grad_to_none):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        peak_mib = lambda: float("nan")  # noqa: E731
    else:
        dev, dt = "cuda", torch.bfloat16
        B, T, H, K = 16, 2048, 12, 64

        def bench(fn, grad_to_none):
            return triton.testing.do_bench(fn, warmup=10, rep=50, grad_to_none=grad_to_none, return_mode="median")

        def peak_mib():
            return torch.cuda.max_memory_allocated() / 2 ** 20
    lens = doc_lengths(B * T, mu=math.log(600 if not a.smoke else 20))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev)
    N, Tmax = len(lens), max(lens)
    torch.manual_seed(0)
    nrm = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731
    q, k = (nrm(torch.randn(1, B * T, H, K, device=dev)).to(dt) for _ in range(2))
    v = torch.randn(1, B * T, H, K, device=dev, dtype=dt)
    lam = torch.rand(1, B * T, H, device=dev) * 0.5
    do = torch.randn(1, B * T, H, K, device=dev, dtype=dt)
    rows = []
    meta = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)", torch=torch.__version__, triton=triton.__version__,
                commit=os.environ.get("FALCON_COMMIT", "unknown"), tokens=B * T, H=H, K=K, V=K, chunk=64,
                documents=N, longest=Tmax, padded_tokens=N * Tmax, padding_factor=round(N * Tmax / (B * T), 2),
                lengths=lens)
    default_mode = kt._VARLEN
    for variant in a.variants.split(","):
        kw = dict(variant=variant, window=4, lam_mode="scaled", backend="triton", chunk_size=64)  # window: 3A only
        per_col = FalconSpec.from_variant(variant).per_column
        beta = torch.rand(1, B * T, H, *((K,) if per_col else ()), device=dev) * 1.8
        ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v, beta, lam)]

        def fb(packed=True):
            if packed:
                o, _ = chunk_falcon(*ins, cu_seqlens=cu, **kw)
            else:
                o, _ = chunk_falcon(*(t.view(B, T, *t.shape[2:]) for t in ins), **kw)
            o.backward(do.view(o.shape))
            return o

        outs = {}
        for mode in ("native", "pad"):
            kt._VARLEN = mode
            for t in ins:
                t.grad = None
            o = fb()
            outs[mode] = (o.detach().float(), ins[0].grad.detach().float())
        diff = dict(o=float((outs["native"][0] - outs["pad"][0]).abs().max()),
                    dq=float((outs["native"][1] - outs["pad"][1]).abs().max()))
        for mode, packed in (("native", True), ("pad", True), ("dense rows, no resets", False)):
            kt._VARLEN = mode if packed else default_mode
            ms = bench(lambda: fb(packed), ins)
            for t in ins:
                t.grad = None
            if dev == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            fb(packed)
            if dev == "cuda":
                torch.cuda.synchronize()
            peak = peak_mib()
            rows.append(dict(variant=variant, mode=mode, fwdbwd_ms=round(ms, 3), peak_mib=round(peak, 1),
                             native_vs_pad_max_abs_diff=diff))
            print(f"[{time.strftime('%H:%M:%S')}] Falcon-{variant} {mode:22s} {ms:8.3f} ms  peak {peak:8.1f} MiB  "
                  f"native-pad diff {diff}", flush=True)
    kt._VARLEN = default_mode
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "varlen_bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"{N} documents, longest {Tmax}, padding factor {meta['padding_factor']}")


if __name__ == "__main__":
    main()
