"""Falcon-2 Triton kernels (percol_delta.py, with percol.py's read-out and backward) under the Triton
interpreter with every tensor the kernels touch inside a NaN-padded buffer (issue 15).

The H200 run of 2026-12-01 died with "illegal memory access" at B=1, T=1000, H=2, K=V=128, bf16, with an
initial state and output_final_state=True (/work/shared/reference/h200-measurements-2026-12-01.md). Here
each input, each upstream gradient (dO, dS_T), each saved tensor handed to the backward, and each buffer
the kernels' wrappers allocate (outputs and scratch: torch.empty / _empty in percol*.py) is a view into a
larger buffer whose padding on both sides is NaN. So
  * an out-of-bounds READ that a mask lets through pulls NaN into an output or gradient (the float64
    comparison then fails: non-finite -> inf error), and
  * an out-of-bounds WRITE changes the padding (checked: every pad must still be all-NaN afterwards).
Shapes are awkward on purpose: T not a multiple of the chunk (T = 104 leaves 40 rows in the last chunk
of 64, as T = 1000 does; 8 rows for chunks of 16/32), K != V, V not a power of two, with/without an
initial state and a final-state gradient. fp32 only: bf16 arithmetic is wrong in the interpreter
(platform-notes.md); the indexing does not depend on the dtype (typed pointers).

The case runner is this file itself, started in a subprocess with TRITON_INTERPRET=1 (interp_helpers).
"""

from __future__ import annotations

import json
import os
import sys

if __name__ != "__main__":
    import pytest

    from interp_helpers import run_interp_cases


def _c(id, **kw):
    base = dict(B=1, T=104, H=2, K=128, V=128, C=64, after=True, s0=True, dst=True, seed=0)
    base.update(kw)
    base["id"] = id
    return base


CASES = [
    # the H200 failure's pattern (initial state, final-state gradient, K=V=128, last chunk partial), shrunk in T
    _c("K128-V128-C64-T104-S0-dST"),
    _c("K32-V32-C32-T40-noS0-nodST", T=40, K=32, V=32, C=32, s0=False, dst=False, seed=1),
    _c("K48-V80-C16-T25-before-B2", B=2, T=25, K=48, V=80, C=16, after=False, seed=2),
    _c("K64-V16-C16-T21-H3-S0-nodST", T=21, H=3, K=64, V=16, C=16, dst=False, seed=3),
]


# ---------------------------------------------------------------------------------------------------
# the subprocess side (TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------------
def _run_cases(cases):
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch

    torch.set_num_threads(1)
    from falcon_lab.benchmarking.ref64 import make_core_inputs
    from falcon_lab.kernels.reference import core_recurrent
    from falcon_lab.kernels.triton import core, ops, percol, percol_delta

    pads = []  # (buffer, pad, n) of every padded tensor made during one case

    def padded(shape, dtype, fill=None):
        n = 1
        for s in shape:
            n *= int(s)
        pad = max(4096, n)  # a whole tensor's worth of NaN on each side
        buf = torch.full((n + 2 * pad,), float("nan"), dtype=dtype)
        t = buf[pad:pad + n].view(*shape)
        if fill is not None:
            t.copy_(fill)
        pads.append((buf, pad, n))
        return t

    class _TorchPadded:  # percol*.py allocate their outputs and scratch with torch.empty / _empty
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*shape, dtype=None, device=None):
            if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
                shape = tuple(shape[0])
            return padded(shape, dtype or torch.float32)

    def _empty(shape, dtype, device):
        return padded(tuple(shape), dtype)

    for m in (percol, percol_delta):
        m.torch = _TorchPadded()
        m._empty = _empty

    def repad(a):  # every tensor argument of the family's forward/backward, into a padded buffer
        if isinstance(a, torch.Tensor) and a.numel() > 0:
            return padded(tuple(a.shape), a.dtype, fill=a.detach())
        if isinstance(a, (list, tuple)):
            return type(a)(repad(x) for x in a)
        return a

    fwd, bwd, shapes = ops._FAMILIES["percol_delta"]
    ops._FAMILIES["percol_delta"] = (lambda *a: fwd(*[repad(x) for x in a]),
                                     lambda *a: bwd(*[repad(x) for x in a]), shapes)

    def pad_damage():
        bad = []
        for buf, pad, n in pads:
            lo = int((~torch.isnan(buf[:pad])).sum())
            hi = int((~torch.isnan(buf[pad + n:])).sum())
            if lo or hi:
                bad.append(f"buffer of {n} elements: {lo} written below, {hi} above")
        return bad

    def rel(a, b):
        a = a.detach().double()
        if not torch.isfinite(a).all():
            return float("inf")
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    for c in cases:
        try:
            pads.clear()
            B, T, H, K, V, C = c["B"], c["T"], c["H"], c["K"], c["V"], c["C"]
            q, xw, vw, eta, g, S0 = make_core_inputs(B, T, H, K, V, 1, per_col=True, seed=c["seed"])
            ins = [q, xw, vw, eta, g] + ([S0] if c["s0"] else [])
            ins = [t.clone().requires_grad_(True) for t in ins]
            s0_ref = ins[5] if c["s0"] else None
            o_ref, s_ref = core_recurrent(*ins[:5], s0_ref, delta=True, window=1, read_after=c["after"])
            gen = torch.Generator().manual_seed(c["seed"] + 7)
            do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
            ds = torch.randn(s_ref.shape, generator=gen, dtype=torch.float64)
            loss_ref = (o_ref * do).sum() + ((s_ref * ds).sum() if c["dst"] else 0)
            gref = torch.autograd.grad(loss_ref, ins)
            kin = [padded(tuple(t.shape), torch.float32, fill=t.detach()).requires_grad_(True) for t in ins]
            o, s = core(*kin[:5], kin[5] if c["s0"] else None, delta=True, window=1, read_after=c["after"],
                        chunk_size=C)
            loss = (o.double() * do).sum() + ((s.double() * ds).sum() if c["dst"] else 0)
            gk = torch.autograd.grad(loss, kin)
            res = {"o": rel(o, o_ref), "S_T": rel(s, s_ref)}
            for name, a, b in zip(["q", "xw", "vw", "eta", "g", "S0"], gk, gref):
                res["d" + name] = rel(a, b)
            print(json.dumps({"id": c["id"], "res": res, "pads": pad_damage(), "n_padded": len(pads)}),
                  flush=True)
        except Exception as e:  # reported; the test fails on it
            print(json.dumps({"id": c["id"], "error": f"{type(e).__name__}: {e}"}), flush=True)


if __name__ == "__main__":
    _run_cases(json.loads(sys.argv[1]))
else:
    @pytest.fixture(scope="module")
    def results():
        return run_interp_cases("test_triton_falcon2_bounds.py", CASES, timeout=600)

    @pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
    def test_falcon2_kernels_stay_in_bounds_and_match_float64(results, case):
        r = results.get(case["id"])
        assert r is not None, f"case {case['id']} did not run"
        assert "error" not in r, r["error"]
        assert r["n_padded"] >= 20, r  # inputs, dO/dS_T, saved tensors and the wrappers' buffers were padded
        assert not r["pads"], f"{case['id']}: out-of-bounds writes into the NaN padding: {r['pads']}"
        want = {"o", "S_T", "dq", "dxw", "dvw", "deta", "dg"} | ({"dS0"} if case["s0"] else set())
        assert set(r["res"]) == want, r["res"]
        for k, e in r["res"].items():  # fp32, full-precision dots: ~3e-7 measured; inf = NaN read from padding
            assert e <= 2e-5, f"{case['id']}: {k} relative error {e:.3e} ({r['res']})"
