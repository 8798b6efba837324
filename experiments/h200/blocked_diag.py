"""Why FALCON_TRITON_2A=blocked is off in fp32 on the H200 (issue 15): on 2026-12-02 (3e9d5f3) every fp32 row of
`bench check --variants 2A,2` with it had dq and dk off by ~3.8e-4 (all else <= 1.4e-6), C = 16 included, where
the blocked kernels have no off-diagonal block; the interpreter gets the same rows right. dq and dk are the two
gradients that depend only on the intra-chunk matrix M, which the blocked path writes to memory (_pc_bwd_rows) and
_pc_bwd_main reads back. This script runs the Falcon-2A core forward and backward at one small fp32 shape in the
exact and the blocked mode, under each fp32 dot precision, and reports (1) each gradient's max difference
blocked - exact, relative to the exact gradient's max, and (2) the M that _pc_bwd_rows wrote against M computed in
float64 from the same inputs. One process, correctness only:

    python3 experiments/h200/blocked_diag.py --json out.json     (on CPU: TRITON_INTERPRET=1, tiny)
"""
import argparse
import json

import torch

from falcon_lab.kernels.triton import common, percol as pc


def inputs(B, T, H, K, V, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q = r(B, T, H, K) / K ** 0.5
    x = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, V)
    eta = torch.rand(B, T, H, V, generator=g) * 0.5
    lg = -torch.rand(B, T, H, V, generator=g) * 0.2
    dO = r(B, T, H, V)
    return [t.to(dev).contiguous() for t in (q, x, v, eta, lg, dO)]


def m_reference(v, eta, lg, dO, C):
    """M[b, t, h, s] for t, s in one chunk, s <= t (read after write): sum_c e^{u_tc - u_sc} U_sc dO_tc, float64."""
    B, T, H, V = v.shape
    out = torch.zeros(B, T, H, C, dtype=torch.float64)
    U = (v * eta).double().cpu()
    do = dO.double().cpu()
    g = lg.double().cpu()
    for n0 in range(0, T, C):
        n1 = min(n0 + C, T)
        u = g[:, n0:n1].cumsum(1)                                                    # [B, L, H, V]
        D = torch.exp(u[:, :, None] - u[:, None, :])                                 # [B, t, s, H, V]
        M = (D * U[:, None, n0:n1] * do[:, n0:n1, None]).sum(-1)                      # [B, t, s, H]
        L = n1 - n0
        M = M * torch.tril(torch.ones(L, L, dtype=torch.float64))[None, :, :, None]
        out[:, n0:n1, :, :L] = M.permute(0, 1, 3, 2)
    return out


class _Grab:
    """Stands in for a jitted kernel: launches it and keeps one of its arguments (by position)."""

    def __init__(self, kern, pos):
        self.kern, self.pos, self.kept = kern, pos, None

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.kept = args[self.pos]
            return self.kern[grid](*args, **kw)
        return launch


def run(mode, prec, ins, C):
    q, x, v, eta, lg, dO = ins
    pc.INTRA = mode
    old = common.FP32_DOT
    common.FP32_DOT = prec
    grab = _Grab(pc._pc_bwd_rows, 7)
    real = pc._pc_bwd_rows
    pc._pc_bwd_rows = grab
    try:
        O, ST, saved = pc.percol_forward(q, x, v, eta, lg, None, read_after=True, C=C, allow_tf32=False)
        grads = pc.percol_backward(q, x, v, eta, lg, saved, dO, None, read_after=True, C=C, allow_tf32=False,
                                   need_ds0=False)
        if q.is_cuda:
            torch.cuda.synchronize()
    finally:
        pc._pc_bwd_rows = real
        common.FP32_DOT = old
        pc.INTRA = "exact"
    names = ("dq", "dx", "dv", "deta", "dg")
    out = {"o": O.double().cpu()}
    out.update({k: t.double().cpu() for k, t in zip(names, grads[:5])})
    kept = grab.kept
    if kept is not None and kept.dim() == 5:  # [B, T, H, parts, C] since 2026-12-03: the parts sum to M
        kept = kept.sum(-2)
    return out, (kept.double().cpu() if kept is not None else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--H", type=int, default=1)
    ap.add_argument("--K", type=int, default=16)
    ap.add_argument("--V", type=int, default=16)
    ap.add_argument("--C", type=int, default=16)
    ap.add_argument("--precs", default="tf32x3,ieee")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ins = inputs(a.B, a.T, a.H, a.K, a.V, dev)
    Mref = m_reference(ins[2], ins[3], ins[4], ins[5], a.C)
    report = {"shape": vars(a), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "torch": torch.__version__, "rows": []}
    for prec in a.precs.split(","):
        ex, _ = run("exact", prec, ins, a.C)
        bl, MM = run("blocked", prec, ins, a.C)
        row = {"prec": prec}
        for k in ex:
            den = ex[k].abs().max().item() or 1.0
            row[f"{k} blocked-exact"] = (bl[k] - ex[k]).abs().max().item() / den
        if MM is not None:
            mask = Mref != 0
            row["M blocked vs float64"] = ((MM - Mref).abs() * mask).max().item() / Mref.abs().max().item()
            row["M rows off (of T)"] = int((((MM - Mref).abs() * mask).amax(dim=(0, 2, 3)) >
                                           1e-4 * Mref.abs().max()).sum())
        print(json.dumps(row), flush=True)
        report["rows"].append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
