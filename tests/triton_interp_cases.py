"""Cases for tests/test_triton_interp.py, run in a subprocess with TRITON_INTERPRET=1 (set before
triton is imported). Each case compares backend-triton core against a float64 step-by-step loop,
forward and backward (q, xw, vw, eta, g, S0 and through S_T). Prints one JSON line per case."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

torch.set_num_threads(1)

from falcon_lab.kernels.triton import core  # noqa: E402


def ref_core(q, xw, vw, eta, g, S0, *, delta, window, read_after):
    """float64 loop of the contract's recurrence (kernel-contract.md), independent of the lead's."""
    B, T, H, K = q.shape
    V = vw.shape[-1]
    W = window
    S = S0.clone() if S0 is not None else q.new_zeros(B, H, K, V)
    outs = []
    per_col = eta.dim() == 4
    for t in range(T):
        e = t + W - 1
        gam = torch.exp(g[:, t])  # [B,H] or [B,H,V]
        et = eta[:, t]
        gam = gam[:, :, None, :] if per_col else gam[:, :, None, None]
        et = et[:, :, None, :] if per_col else et[:, :, None, None]
        upd = 0
        for m in range(W):
            x = xw[:, e - m]  # [B,H,K]
            y = vw[:, e - m]
            r = y - torch.einsum("bhkv,bhk->bhv", S, x) if delta else y
            upd = upd + x[..., :, None] * r[..., None, :]
        Sn = gam * S + et * upd
        outs.append(torch.einsum("bhkv,bhk->bhv", Sn if read_after else S, q[:, t]))
        S = Sn
    return torch.stack(outs, 1), S


def make(B, T, H, K, V, W, strong, seed, per_col=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = r(B, T, H, K) / K ** 0.5
    xw = r(B, T + W - 1, H, K) / K ** 0.5
    vw = r(B, T + W - 1, H, V)
    es = (B, T, H, V) if per_col else (B, T, H)
    eta = torch.rand(*es, generator=gen, dtype=torch.float64) * 1.5 / W
    lo = -1.4 if strong else -0.1  # strong: γ down to 0.25 (the hazard of falcon-math.md §6.4)
    g = torch.rand(*es, generator=gen, dtype=torch.float64) * lo
    eta[:, 0] = 0.0  # the shift sentinel
    g[:, 0] = 0.0
    S0 = r(B, H, K, V) * 0.3
    return q, xw, vw, eta, g, S0


def run_case(c):
    B, T, H, K, V = c["B"], c["T"], c["H"], c["K"], c["V"]
    W, delta, after, C = c["W"], c["delta"], c["after"], c["C"]
    dtype = getattr(torch, c["dtype"])
    q, xw, vw, eta, g, S0 = make(B, T, H, K, V, W, c.get("strong", False), c["seed"])
    if not c.get("s0", True):
        S0 = None
    ins = [q, xw, vw, eta, g] + ([S0] if S0 is not None else [])
    for t in ins:
        t.requires_grad_(True)
    o_ref, s_ref = ref_core(q, xw, vw, eta, g, S0, delta=delta, window=W, read_after=after)
    gen = torch.Generator().manual_seed(c["seed"] + 7)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    ds = torch.randn(s_ref.shape, generator=gen, dtype=torch.float64)
    ref_grads = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), ins)

    # inputs of the kernel in the case dtype (eta, g, S0 in fp32 as the contract says)
    qi = q.detach().to(dtype).requires_grad_(True)
    xi = xw.detach().to(dtype).requires_grad_(True)
    vi = vw.detach().to(dtype).requires_grad_(True)
    ei = eta.detach().float().requires_grad_(True)
    gi = g.detach().float().requires_grad_(True)
    si = S0.detach().float().requires_grad_(True) if S0 is not None else None
    kins = [qi, xi, vi, ei, gi] + ([si] if si is not None else [])
    o, s = core(qi, xi, vi, ei, gi, si, delta=delta, window=W, read_after=after, chunk_size=C)
    grads = torch.autograd.grad((o.double() * do).sum() + (s.double() * ds).sum(), kins)

    def rel(a, b):
        a = a.double()
        if not torch.isfinite(a).all():
            return float("inf")
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    names = ["q", "xw", "vw", "eta", "g", "S0"]
    res = {"o": rel(o, o_ref), "S_T": rel(s, s_ref)}
    for n, a, b in zip(names, grads, ref_grads):
        res["d" + n] = rel(a, b)
    return res


def decode_case(c):
    """T = 1 without grad: the fused decode kernel, for every variant (per-column, window)."""
    B, H, K, V, W, delta, after = c["B"], c["H"], c["K"], c["V"], c["W"], c["delta"], c["after"]
    q, xw, vw, eta, g, S0 = make(B, 1, H, K, V, W, False, c["seed"], per_col=c["per_col"])
    eta = eta + 0.3  # make the single step non-trivial (sentinel not at play here)
    g = g - 0.05
    o_ref, s_ref = ref_core(q, xw, vw, eta, g, S0, delta=delta, window=W, read_after=after)
    with torch.no_grad():
        o, s = core(q.float(), xw.float(), vw.float(), eta.float(), g.float(), S0.float(), delta=delta,
                    window=W, read_after=after, chunk_size=16)
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    return {"o": rel(o, o_ref), "S_T": rel(s, s_ref)}


if __name__ == "__main__":
    cases = json.loads(sys.argv[1])
    for c in cases:
        try:
            res = decode_case(c) if c.get("decode") else run_case(c)
            print(json.dumps({"id": c["id"], "res": res}), flush=True)
        except Exception as e:  # report, the test fails on it
            print(json.dumps({"id": c["id"], "error": f"{type(e).__name__}: {e}"}), flush=True)
