"""Cases for tests/test_models_loss.py, run in ONE subprocess with TRITON_INTERPRET=1 (set before
triton is imported). Each case runs xent_rows_(backend="triton") and reports the relative errors of
the per-row NLL and the in-place gradient against the torch body computed in float64 on the same
(rounded) logits. Prints one JSON line per case."""

from interp_case_helpers import rel, run_cases  # first: checks TRITON_INTERPRET=1, one torch thread

import torch

from falcon_lab.modules.xent import xent_rows_, xent_rows_torch_


def run(c):
    gen = torch.Generator().manual_seed(c["seed"])
    dtype = getattr(torch, c["dtype"])
    C, V = c["C"], c["V"]
    z = (torch.randn(C, V, generator=gen) * c.get("spread", 3.0)).to(dtype)
    y = torch.randint(0, V, (C,), generator=gen)
    y[::5] = -100
    if c.get("edge"):
        y[1] = 0
        y[2] = V - 1
    z64 = z.double()
    ref = xent_rows_torch_(z64, y, c["scale"], -100, grad=True)  # float64 copy: nll, and z64 becomes grad
    zt = z.clone()
    nll = xent_rows_(zt, y, c["scale"], -100, grad=c["grad"], backend="triton")
    out = {"nll": rel(nll, ref), "ignored_zero": bool((nll[y == -100] == 0).all())}
    if c["grad"]:
        out["grad"] = rel(zt, z64)
        out["ignored_grad_zero"] = bool((zt[y == -100] == 0).all())
    else:
        out["untouched"] = bool(torch.equal(zt, z))
    return out


if __name__ == "__main__":
    run_cases(run)
