"""Compile the one-scan Falcon-3A read-out kernel (_wl_fwd_out) for the H200 (sm_90) on a machine without a GPU,
and report what the compiler made of it: shared memory, registers and stack per thread (cuobjdump -res-usage),
and whether its dots became Hopper wgmma or mma.sync. Use the H200's Triton (3.6) for the same code generation:

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 .venv/bin/python experiments/h200/wl_offline_compile.py

2026-12-02 with Triton 3.6.0 (docs/kernels-triton.md): the rows that failed on the H200 (K = 128, C = 64) use wgmma
(C = 64 gives the 64-row tiles wgmma needs), 255 registers and a stack of 96 B (bf16) / 912 B (fp32); K = 128 at
C = 32 (passed) compiles to mma.sync with 192 registers and no stack; K = 64 at C = 64 (passed) uses wgmma too, with
255 registers and 120 B of stack; at 8 warps K = 128, C = 64 (failed too) has 199 registers and no stack. So
spilling does not separate pass from fail; the failing rows are the wgmma ones with K = 128. The fp32 K = 128, C = 32
build (what `chunk_for` now runs) reports 32 registers and a 7984-B stack: slow if it runs, and unproven.
"""
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from falcon_lab.kernels.triton import window_linear as wl  # noqa: E402


def compile_out(K, C, dt="bf16", warps=4, W=4):
    BK, BV = wl._tiles(K, K)
    sig = {"Q": f"*{dt}", "XW": f"*{dt}", "VW": f"*{dt}", "ETA": "*fp32", "G": "*fp32", "HS": "*fp32", "O": f"*{dt}",
           "T": "i32", "XT": "i32", "NT": "i32"}
    consts = {"H": 2, "K": K, "V": K, "C": C, "W": W, "BK": BK, "BV": BV, "BWc": wl.BW, "READ_AFTER": True,
              "PREC": "tf32x3" if dt == "fp32" else "tf32"}  # what _prec picks on a GPU (fp32: tf32x3; 16-bit: unused)
    sig.update({k: "constexpr" for k in consts})
    opts = {"num_warps": warps, **({"num_stages": 1} if dt == "fp32" else {})}  # as chunk._stages
    return triton.compile(ASTSource(fn=wl._wl_fwd_out, signature=sig, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def main():
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    print(f"triton {triton.__version__}")
    for K, C, dt, warps in [(128, 64, "bf16", 4), (128, 32, "bf16", 4), (64, 64, "bf16", 4), (128, 64, "bf16", 8),
                            (128, 64, "fp32", 4), (128, 32, "fp32", 4)]:
        k = compile_out(K, C, dt, warps)
        ptx = k.asm["ptx"]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        use = next((ln.strip() for ln in res.splitlines() if "REG:" in ln), "?")
        print(f"K={K} C={C} {dt} warps={warps}: shared {k.metadata.shared} B, wgmma {ptx.count('wgmma.mma_async')}, "
              f"mma.sync {ptx.count('mma.sync')}, {use}")


if __name__ == "__main__":
    main()
