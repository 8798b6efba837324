"""Compile Falcon-2's reverse state pass (_pcd_bwd_state) for the H200 (sm_90) on a machine without a GPU, with fp32
operands and "tf32x3" dots (what `_prec` picks for fp32 on a GPU), 8 warps and one stage (as the launcher), and count
the tensor-core instructions of each build. Use the H200's Triton for the same code generation:

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 .venv/bin/python experiments/h200/pcd_offline_compile.py

2026-12-02, Triton 3.6.0: K = 16 at C = 64 (the one fp32 row of `bench check --variants 2` whose gradients are wrong on
the H200) is the only build with wgmma.m64n8k8 instructions (12) beside m64n32k8 and mma.sync; K = 16 at C = 16/32
uses mma.sync only, K = 64/128 at C = 64 wgmma m64n32k8 (and m64n16k8) only, K = 64/128 at C = 16/32 mix mma.sync
and m64n32k8, and all of those rows pass. With value tiles of 32 (what the launcher uses for fp32 since, a candidate
fix not yet run on the GPU) K = 16 at C = 64 compiles to mma.sync, m64n16k8 and m64n32k8 only.
"""
import os
import re
import sys
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from falcon_lab.kernels.triton import percol_delta as pd  # noqa: E402
from falcon_lab.kernels.triton.chunk import _cfg  # noqa: E402

PTRS = ("Q", "X", "ETA", "G", "DO", "DUI", "DST", "DHS", "DSU", "DRHS", "DS0")


def compile_bwd_state(K, C, warps=8, BV=None):
    BK, BVs, *_ = _cfg(K, K)
    BVs = BV or BVs
    sig = {n: "*fp32" for n in PTRS}
    sig.update({"T": "i32", "NT": "i32"})
    consts = dict(H=2, K=K, V=K, C=C, BK=BK, BV=BVs, READ_AFTER=True, HAS_DST=True, STORE_DS0=True, PREC="tf32x3")
    sig.update({k: "constexpr" for k in consts})
    return triton.compile(ASTSource(fn=pd._pcd_bwd_state, signature=sig, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})


def mma_counts(k) -> str:
    """The build's tensor-core instructions (wgmma / mma.sync shapes) and how often each stands in its PTX."""
    mmas = Counter(re.findall(r"(wgmma\.mma_async\S*|mma\.sync\S*)", k.asm["ptx"]))
    return ", ".join(f"{n} x{c}" for n, c in sorted(mmas.items()))


def main():
    print(f"triton {triton.__version__}")
    for K in (16, 64, 128):
        for C in (16, 32, 64):
            k = compile_bwd_state(K, C)
            print(f"K={K} C={C}: shared {k.metadata.shared} B, {mma_counts(k)}")
    # the launcher's fp32 build since 2026-12-02 (value tiles >= 32): no m64n8k8 left
    print(f"K=16 C=64 BV=32: {mma_counts(compile_bwd_state(16, 64, BV=32))}")


if __name__ == "__main__":
    main()
