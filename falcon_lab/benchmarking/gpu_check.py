"""GPU correctness check of backend="triton" (run on the H200; no timing here).

    python -m falcon_lab.benchmarking.gpu_check --out benchmarks/results

1. The Triton core against a float64 step-by-step loop (ref64.py) at real sizes: T up to 8192,
   K = V in {16, 64, 128}, chunk 16/32/64, awkward T, bf16 and fp32, forward and backward (q, xw, vw,
   η, log γ, S0 and through S_T), with outputs allocated NaN-poisoned (FALCON_TRITON_POISON=1) so an
   unwritten element fails.
2. The public op chunk_falcon(backend="triton") against recurrent_falcon (float64) with ragged
   cu_seqlens and a continuation split, forward and backward.
3. The fused decode step inside a CUDA graph against recurrent_falcon, every variant.
4. Packed sequences run natively by the chunk kernels (Falcon-1, -1A, -2, -2A): ragged lengths around the chunk size, each
   sequence from its own state, forward, final state and gradients (S0 included) against recurrent_falcon.
Writes triton_check_h200.json (every row) and triton_check_h200.md (error per variant per tensor).
A CUDA error that poisons the context (an illegal memory access: every later CUDA call fails too) stops the
check: that row keeps its error, every later row is marked "not run: CUDA context poisoned by row N" (run
them in a fresh process) and the exit code is non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("FALCON_TRITON_POISON", "1")

import torch  # noqa: E402

from falcon_lab.benchmarking.ref64 import make_core_inputs, ref_core, rel_err  # noqa: E402
from falcon_lab.kernels.spec import FalconSpec  # noqa: E402

TOL = {"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 4e-2)}  # (forward, gradients): ours

# Sticky CUDA errors: after one, the context is unusable and every later call in the process fails with it.
_STICKY = ("illegal memory access", "illegal address", "illegal instruction", "misaligned address",
           "unspecified launch failure", "device-side assert", "AcceleratorError")


def _error_status(e: BaseException) -> str:
    """"ERROR Type: first line of the message" (one line: the message becomes a markdown table cell)."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"ERROR {type(e).__name__}: {first}"[:300]


def _cuda_usable() -> bool:
    """Whether the device still synchronizes: a sticky error is returned by every later synchronize, an
    out-of-memory error is not (no allocation here, so a full GPU does not read as a poisoned one)."""
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return False


def context_poisoned(e: BaseException) -> bool:
    """Whether exception `e` from a row left the CUDA context unusable (a sticky error such as an illegal
    memory access), so that no later row in this process can be trusted. An out-of-memory error or a
    wrong-shape ValueError is not; a sticky-error marker in the message, or a failing synchronize, is."""
    msg = f"{type(e).__name__}: {e}"
    return any(m in msg for m in _STICKY) or not _cuda_usable()


def check_core(*, variant, B, T, H, K, V, C, dtype, read_after=True, strong=False, seed=0, dev="cuda"):
    from falcon_lab.kernels.triton import core

    spec = FalconSpec.from_variant(variant)
    delta, W = spec.delta, spec.window(4)
    q, xw, vw, eta, g, S0 = make_core_inputs(B, T, H, K, V, W, strong=strong, seed=seed, device=dev,
                                             per_col=spec.per_column)
    dt = getattr(torch, dtype)
    q, xw, vw = (t.to(dt).double() for t in (q, xw, vw))  # the reference sees the rounded inputs
    eta, g, S0 = (t.float().double() for t in (eta, g, S0))
    ins = [t.clone().requires_grad_(True) for t in (q, xw, vw, eta, g, S0)]
    o_ref, s_ref = ref_core(*ins, delta=delta, window=W, read_after=read_after)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64).to(dev)
    ds = torch.randn(s_ref.shape, generator=gen, dtype=torch.float64).to(dev)
    gref = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), ins)
    kin = [t.detach().to(dt).requires_grad_(True) for t in (q, xw, vw)]
    kin += [t.detach().float().requires_grad_(True) for t in (eta, g, S0)]
    o, s = core(*kin, delta=delta, window=W, read_after=read_after, chunk_size=C)
    gk = torch.autograd.grad((o.double() * do).sum() + (s.double() * ds).sum(), kin)
    res = {"o": rel_err(o, o_ref), "S_T": rel_err(s, s_ref)}
    for n, a, b in zip(["q", "xw", "vw", "eta", "g", "S0"], gk, gref):
        res["d" + n] = rel_err(a, b)
    return res


def check_api(*, variant, dtype, K, seed=0, dev="cuda"):
    """Ragged varlen + continuation through the public op, forward and backward."""
    from falcon_lab.kernels import chunk_falcon, recurrent_falcon

    torch.manual_seed(seed)
    H, V = 2, K
    lens = [1, 37, 200, 64, 515] if dev == "cuda" else [1, 7, 30]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev)
    Tt = int(cu[-1])
    dt = getattr(torch, dtype)
    nrm = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731
    q = nrm(torch.randn(1, Tt, H, K, device=dev, dtype=torch.float64)).to(dt).double()
    k = nrm(torch.randn(1, Tt, H, K, device=dev, dtype=torch.float64)).to(dt).double()
    v = torch.randn(1, Tt, H, V, device=dev, dtype=torch.float64).to(dt).double()
    pc = (V,) if FalconSpec.from_variant(variant).per_column else ()
    beta = (torch.rand(1, Tt, H, *pc, device=dev, dtype=torch.float64) * 1.8).float().double()
    lam = (torch.rand(1, Tt, H, device=dev, dtype=torch.float64) * 0.5).float().double()
    kw = dict(variant=variant, window=4, lam_mode="scaled")
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, beta, lam)]
    o_ref, _ = recurrent_falcon(*ins, cu_seqlens=cu, **kw)
    do = torch.randn_like(o_ref)
    gref = torch.autograd.grad((o_ref * do).sum(), ins)
    kin = [t.detach().to(dt).requires_grad_(True) for t in (q, k, v)] + \
          [t.detach().float().requires_grad_(True) for t in (beta, lam)]
    o, _ = chunk_falcon(*kin, cu_seqlens=cu, backend="triton", **kw)
    gk = torch.autograd.grad((o.double() * do).sum(), kin)
    res = {"o": rel_err(o, o_ref)}
    for n, a, b in zip(["q", "k", "v", "beta", "lam"], gk, gref):
        res["d" + n] = rel_err(a, b)
    # continuation: one sequence of 777 split at 300
    T, cut = (777, 300) if dev == "cuda" else (50, 21)
    q2, k2, v2 = (torch.randn(2, T, H, K, device=dev).to(dt) for _ in range(3))
    q2, k2 = nrm(q2.float()).to(dt), nrm(k2.float()).to(dt)
    b2 = torch.rand(2, T, H, *pc, device=dev) * 1.8
    l2 = torch.rand(2, T, H, device=dev) * 0.5
    full, _ = recurrent_falcon(*(t.double() for t in (q2, k2, v2, b2, l2)), **kw)
    o1, st = chunk_falcon(q2[:, :cut], k2[:, :cut], v2[:, :cut], b2[:, :cut], l2[:, :cut],
                          output_final_state=True, backend="triton", **kw)
    o2, _ = chunk_falcon(q2[:, cut:], k2[:, cut:], v2[:, cut:], b2[:, cut:], l2[:, cut:],
                         initial_state=st, backend="triton", **kw)
    res["o_continuation"] = rel_err(torch.cat([o1, o2], 1), full)
    return res


def check_varlen(*, variant, dtype, K, seed=0, dev="cuda", C=64, read="after", shift=True):
    """Packed sequences run natively by the Triton chunk kernels (no padding): ragged lengths around the chunk size
    (1, C - 1, C, C + 1, several chunks), each sequence continued from its own state (S, last_k, seen; for Falcon-3A,
    window 4, its carried pair tails too), forward, final state and the gradients of q, k, v, beta, lam and every
    part of the initial state against recurrent_falcon in float64.
    "native" in the result: 1 when the packed kernels ran (0 would mean the call was padded)."""
    from falcon_lab.kernels import chunk_falcon, recurrent_falcon
    from falcon_lab.kernels.state import FalconState
    from falcon_lab.kernels.triton import common as kcommon, varlen_check

    spec = FalconSpec.from_variant(variant)
    W = spec.window(4)
    ok, why = varlen_check(spec, window=W, device_type=torch.device(dev).type)
    if not ok:
        raise NotImplementedError(why)
    torch.manual_seed(seed)
    H, V = 2, K
    lens = [1, C - 1, C, C + 1, 3 * C + 5] + ([2048, 517] if dev == "cuda" else [])
    N = len(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev)
    Tt = int(cu[-1])
    dt = getattr(torch, dtype)
    f64 = dict(device=dev, dtype=torch.float64)
    nrm = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731
    q, k = (nrm(torch.randn(1, Tt, H, K, **f64)).to(dt).double() for _ in range(2))
    v = torch.randn(1, Tt, H, V, **f64).to(dt).double()
    beta = (torch.rand(1, Tt, H, *((V,) if spec.per_column else ()), **f64) * 1.8).float().double()
    lam = (torch.rand(1, Tt, H, **f64) * 0.5).float().double()
    S0 = (torch.randn(N, H, K, V, **f64) * 0.1).float().double()
    last_k = nrm(torch.randn(N, H, K, **f64)).to(dt).double()
    seen = torch.tensor([0, 5, 1, 0, 9] + [3, 0][:N - 5], device=dev)
    tails = []
    if W > 1:  # the pairs each sequence carries (zero where it has seen fewer than W - 1 tokens)
        have = (torch.arange(W - 1, device=dev)[None, :] >= (W - 1) - seen[:, None]).to(torch.float64)
        tails = [(nrm(torch.randn(N, W - 1, H, K, **f64)) * have[..., None, None]).to(dt).double(),
                 (torch.randn(N, W - 1, H, V, **f64) * have[..., None, None]).to(dt).double()]
    kw = dict(variant=variant, window=W, lam_mode="scaled", cu_seqlens=cu, output_final_state=True, read=read,
              shift=shift)

    def state(S, lk, *tl_):
        tx, tv = tl_ if tl_ else (None, None)
        return FalconState(S=S, last_k=lk, seen=seen, tail_x=tx, tail_v=tv, variant=variant, window=W,
                           shift=shift, read=read)

    ins = [t.clone().requires_grad_(True) for t in (q, k, v, beta, lam, S0, last_k, *tails)]
    o_ref, st_ref = recurrent_falcon(*ins[:5], initial_state=state(*ins[5:]), **kw)
    do, ds = torch.randn_like(o_ref), torch.randn_like(st_ref.S)
    gref = torch.autograd.grad((o_ref * do).sum() + (st_ref.S * ds).sum(), ins, allow_unused=True)
    kin = [t.detach().to(dt).requires_grad_(True) for t in (q, k, v)] + \
          [t.detach().float().requires_grad_(True) for t in (beta, lam, S0)] + \
          [t.detach().to(dt).requires_grad_(True) for t in (last_k, *tails)]
    calls = [0]
    plan = kcommon.varlen

    def counted(*a, **kwa):
        calls[0] += 1
        return plan(*a, **kwa)
    kcommon.varlen = counted
    try:
        o, st = chunk_falcon(*kin[:5], initial_state=state(*kin[5:]), backend="triton", chunk_size=C, **kw)
        gk = torch.autograd.grad((o.double() * do).sum() + (st.S.double() * ds).sum(), kin, allow_unused=True)
    finally:
        kcommon.varlen = plan
    res = {"o": rel_err(o, o_ref), "S_T": rel_err(st.S, st_ref.S), "last_k": rel_err(st.last_k, st_ref.last_k),
           "seen": float((st.seen != st_ref.seen).any())}
    if W > 1:
        res["tail_x"] = rel_err(st.tail_x, st_ref.tail_x)
        res["tail_v"] = rel_err(st.tail_v, st_ref.tail_v)
    names = ["q", "k", "v", "beta", "lam", "S0", "last_k", "tail_x", "tail_v"]
    for n, a, b in zip(names, gk, gref):
        if b is not None and (shift or n != "last_k"):  # without the shift the carried key is unused
            res["d" + n] = rel_err(a, b)
    # the forward's and the backward's chunk plans: one Falcon-1A scan for 3A (FALCON_TRITON_3A_PACKED=delayed, the
    # default since 2026-12-04; one banded scan with =banded; W scans with =scans), one expansion for Falcon-3
    from falcon_lab.kernels.triton import _banded_3a, _delayed_3a

    scans = W > 1 and not spec.delta and not _banded_3a(W, None, True) and not _delayed_3a(W, None, True)
    res["native"] = float(calls[0] == 2 * (W if scans else 1))
    return res


def varlen_judge(res, tol) -> bool:
    """A check_varlen row passes when the packed kernels ran, `seen` is exact and every error is within `tol`."""
    errs = {k: v for k, v in res.items() if k not in ("native", "seen")}
    return res["native"] == 1.0 and res["seen"] == 0.0 and tol(errs)


def check_decode_graph(*, variant, K=64, dev="cuda"):
    """recurrent decoding T = 1 through the public op, captured in a CUDA graph and replayed."""
    from falcon_lab.kernels import chunk_falcon, recurrent_falcon

    torch.manual_seed(3)
    B, H, V, T = 2, 3, K, 12
    per_col = FalconSpec.from_variant(variant).per_column
    nrm = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731
    q, k = (nrm(torch.randn(B, T, H, K, device=dev)) for _ in range(2))
    v = torch.randn(B, T, H, V, device=dev)
    beta = torch.rand(B, T, H, V, device=dev) * 1.8 if per_col else torch.rand(B, T, H, device=dev) * 1.8
    lam = torch.rand(B, T, H, device=dev) * 0.5
    kw = dict(variant=variant, window=4, lam_mode="scaled")
    o_ref, _ = recurrent_falcon(*(t.double() for t in (q, k, v, beta, lam)), **kw)
    with torch.no_grad():
        _, st = chunk_falcon(q[:, :4], k[:, :4], v[:, :4], beta[:, :4], lam[:, :4],
                             output_final_state=True, backend="triton", **kw)
        # static buffers for the graph
        bufs = [t[:, 4:5].clone() for t in (q, k, v, beta, lam)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up (compiles)
                chunk_falcon(*bufs, initial_state=st, output_final_state=True, backend="triton", **kw)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_g, st_g = chunk_falcon(*bufs, initial_state=st, output_final_state=True, backend="triton", **kw)
        outs = []
        for t in range(4, T):
            for b_, src in zip(bufs, (q, k, v, beta, lam)):
                b_.copy_(src[:, t:t + 1])
            graph.replay()
            outs.append(o_g.clone())
            # carry the new state into the static input state
            st.S.copy_(st_g.S)
            st.last_k.copy_(st_g.last_k)
            st.seen.copy_(st_g.seen)
            if st.tail_x is not None:
                st.tail_x.copy_(st_g.tail_x)
                st.tail_v.copy_(st_g.tail_v)
        torch.cuda.synchronize()
    return {"o_graph_decode": rel_err(torch.cat(outs, 1), o_ref[:, 4:])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="a few configurations only")
    ap.add_argument("--final", action="store_true", help="the shortest list (one device call)")
    ap.add_argument("--variants", default="1,1A,3A,2,2A,3", help="comma-separated subset, e.g. 3,2A")
    ap.add_argument("--rows", default=None,
                    help="run only these rows of the list, by their number in a full run (core rows first, then "
                         "api, then decode; seeds unchanged), e.g. 2-10,12-14 (to rerun rows alone or under "
                         "compute-sanitizer)")
    ap.add_argument("--kinds", default=None,
                    help="run only rows of these kinds (comma-separated: core, api-varlen-continuation, "
                         "decode-cuda-graph, varlen-native); numbering as in a full run")
    args = ap.parse_args(argv)
    wanted = _parse_rows(args.rows)
    kinds = set(args.kinds.split(",")) if args.kinds else None
    torch.backends.cuda.matmul.allow_tf32 = False
    import falcon_lab.kernels.triton as kt
    from falcon_lab.kernels.triton import supports

    import triton

    rows = []
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from falcon_lab.benchmarking.kernels import run_flags

    def write():
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    commit=os.environ.get("FALCON_COMMIT", "unknown"), poisoned_outputs=True,
                    flags=run_flags(),
                    falcon_3a=kt._FALCON_3A,  # which Falcon-3A path the core rows ran (FALCON_TRITON_3A)
                    context_poisoned_by=poisoned[0] if poisoned else None,
                    tolerances={k: {"forward": a, "gradients": b} for k, (a, b) in TOL.items()},
                    seconds=round(time.time() - t0, 1))
        (out / "triton_check_h200.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        (out / "triton_check_h200.md").write_text(to_markdown(meta, rows))
        return meta
    cfgs = []
    if args.final:  # the short list that fits the last device call (see docs/kernels-triton.md)
        cfgs = [dict(variant="1", B=1, T=8192, H=2, K=128, V=128, C=64, dtype="bfloat16"),
                dict(variant="1", B=2, T=1000, H=2, K=16, V=16, C=16, dtype="bfloat16"),
                dict(variant="1", B=2, T=1000, H=2, K=64, V=64, C=32, dtype="float32", read_after=False),
                dict(variant="1", B=1, T=640, H=2, K=64, V=64, C=64, dtype="float32", strong=True),
                dict(variant="1A", B=2, T=1000, H=2, K=64, V=64, C=32, dtype="bfloat16"),
                dict(variant="3A", B=2, T=1000, H=2, K=64, V=64, C=64, dtype="bfloat16"),
                # kernels not yet run on the H200: rows say "not implemented" unless FALCON_TRITON_UNPROVEN=1
                dict(variant="3", B=2, T=1000, H=2, K=64, V=64, C=64, dtype="bfloat16"),
                dict(variant="3", B=1, T=500, H=2, K=64, V=64, C=32, dtype="float32", read_after=False),
                dict(variant="2A", B=2, T=1000, H=2, K=64, V=64, C=32, dtype="bfloat16"),
                dict(variant="2A", B=1, T=500, H=2, K=128, V=128, C=64, dtype="float32", strong=True),
                # issue 15: the shape whose fwd+bwd died with "illegal memory access" on the H200
                # (2026-12-01; check_core always has S0 and a gradient through S_T, as initial state +
                # output_final_state=True). Last core row: an illegal access poisons the CUDA context.
                dict(variant="2", B=1, T=1000, H=2, K=128, V=128, C=64, dtype="bfloat16")]
    only = [v.strip() for v in args.variants.split(",")]
    for variant in (() if args.final else only):
        for dtype in ("bfloat16", "float32"):
            cfgs.append(dict(variant=variant, B=1, T=8192, H=2, K=128, V=128, C=64, dtype=dtype))
            for K in (16, 64, 128):
                for C in (16, 32, 64):
                    if args.quick and (K, C) not in ((16, 16), (64, 32), (128, 64)):
                        continue
                    cfgs.append(dict(variant=variant, B=2, T=1000, H=2, K=K, V=K, C=C, dtype=dtype))
        cfgs.append(dict(variant=variant, B=2, T=333, H=2, K=64, V=32, C=32, dtype="float32", read_after=False))
        cfgs.append(dict(variant=variant, B=1, T=640, H=2, K=64, V=64, C=64, dtype="float32", strong=True))
    poisoned = []  # [label of the row whose error poisoned the CUDA context], at most one

    number = [0]  # the row's number in the full list, whether or not --rows runs it

    def run_row(row, label, fn, judge, not_implemented_ok=False):
        """Run one row (fn() -> errors; judge(errors) -> ok) unless an earlier row poisoned the context."""
        number[0] += 1
        if (wanted is not None and number[0] not in wanted) or (kinds is not None and row["kind"] not in kinds):
            return
        row["row"] = number[0]
        label = f"{number[0]} {label}"
        if poisoned:
            row.update(status=f"not run: CUDA context poisoned by row {poisoned[0]}")
        else:
            try:
                res = fn()
                row.update(errors=res, status="pass" if judge(res) else "FAIL")
            except Exception as e:  # recorded, not hidden
                if not_implemented_ok and isinstance(e, NotImplementedError):
                    row.update(status=f"not implemented: {e}"[:200])
                else:
                    row.update(status=_error_status(e))
                    if context_poisoned(e):
                        poisoned.append(label)
                        row["status"] += " [poisoned the CUDA context: later rows not run]"
        rows.append(row)
        write()
        print(f"[{time.time() - t0:6.1f}s] {row['status'][:5]:5s} {label} {row.get('errors', '')}", flush=True)

    def tol_judge(dtype, fwd_keys):
        ftol, gtol = TOL[dtype]
        return lambda res: all(v <= (ftol if fwd_keys(k) else gtol) for k, v in res.items())

    for i, c in enumerate(cfgs):
        spec = FalconSpec.from_variant(c["variant"])
        row = dict(kind="core", **c)
        if not supports(spec, window=4):
            number[0] += 1
            row.update(status="not implemented in Triton")
            rows.append(row)
            continue
        run_row(row, f"(core {c})", lambda c=c, i=i: check_core(seed=i, **c),
                tol_judge(c["dtype"], lambda k: k in ("o", "S_T")))
    api_cfgs = [("1", "bfloat16"), ("3A", "float32"), ("3", "bfloat16"), ("2A", "float32")] if args.final else \
        [(v, d) for v in only for d in ("bfloat16", "float32")]
    for variant, dtype in api_cfgs:
        row = dict(kind="api-varlen-continuation", variant=variant, dtype=dtype, K=64)
        run_row(row, f"(api {variant} {dtype})",
                lambda variant=variant, dtype=dtype: check_api(variant=variant, dtype=dtype, K=64),
                tol_judge(dtype, lambda k: k.startswith("o")), not_implemented_ok=True)
    for variant in (("1", "2A", "3") if args.final else only):
        row = dict(kind="decode-cuda-graph", variant=variant, dtype="float32", K=64)
        run_row(row, f"(decode-graph {variant})",
                lambda variant=variant: check_decode_graph(variant=variant), lambda res: res["o_graph_decode"] <= 1e-4)

    # native packed sequences (chunk kernels reading cu_seqlens; "not implemented" unless proven or
    # FALCON_TRITON_UNPROVEN=1): after the decode rows, so the earlier rows keep their numbers
    for variant in [v for v in (("1", "1A") if args.final else only) if v in ("1", "1A", "2", "2A", "3A", "3")]:
        for dtype in ("bfloat16", "float32"):
            for C in ((64,) if args.final else (16, 64)):
                row = dict(kind="varlen-native", variant=variant, dtype=dtype, K=64, C=C)
                run_row(row, f"(varlen-native {variant} {dtype} C={C})",
                        lambda variant=variant, dtype=dtype, C=C: check_varlen(variant=variant, dtype=dtype, K=64, C=C),
                        lambda res, dtype=dtype: varlen_judge(res, tol_judge(
                            dtype, lambda k: k in ("o", "S_T", "last_k", "tail_x", "tail_v"))),
                        not_implemented_ok=True)

    meta = write()
    n_fail = sum(r["status"] not in ("pass",) and not r["status"].startswith("not implemented") for r in rows)
    print(f"done: {len(rows)} rows, {n_fail} failing/erroring/not run, {meta}")
    if poisoned:
        print(f"STOPPED: row {poisoned[0]} poisoned the CUDA context; the rows after it were not run", flush=True)
    return n_fail


def _parse_rows(spec):
    """"2-10,12,14-25" -> {2, ..., 10, 12, 14, ..., 25}; None -> None (every row)."""
    if spec is None:
        return None
    out = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise SystemExit(f"--rows: {part!r} is not a row number or a range a-b")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def to_markdown(meta, rows):
    lines = [f"# Triton kernel check on {meta['gpu']} (torch {meta['torch']}, triton {meta['triton']}, "
             f"commit {meta['commit']})", "",
             "Relative error ‖out − ref‖/‖ref‖ against a float64 loop (inputs rounded to the kernel dtype first); "
             f"outputs NaN-poisoned before each run. Tolerances (ours): {meta['tolerances']}.", ""]
    keys = ["o", "S_T", "dq", "dxw", "dvw", "deta", "dg", "dS0"]
    lines.append("| variant | B×T×H | K/V | C | dtype | read | status | " + " | ".join(keys) + " |")
    lines.append("|---|---|---|---|---|---|---|" + "---|" * len(keys))
    for r in rows:
        if r["kind"] != "core":
            continue
        e = r.get("errors", {})
        lines.append(f"| {r['variant']} | {r['B']}×{r['T']}×{r['H']} | {r['K']}/{r['V']} | {r['C']} | {r['dtype']} | "
                     f"{'before' if r.get('read_after') is False else 'after'}{' strong-decay' if r.get('strong') else ''} | "
                     f"{r['status']} | " + " | ".join(f"{e[k]:.1e}" if k in e else "–" for k in keys) + " |")
    lines += ["", "## Public op (ragged cu_seqlens, continuation) and CUDA-graph decode", "",
              "| kind | variant | dtype | status | errors |", "|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "core":
            continue
        e = ", ".join(f"{k} {v:.1e}" for k, v in r.get("errors", {}).items())
        lines.append(f"| {r['kind']} | {r['variant']} | {r['dtype']} | {r['status']} | {e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(1 if main() else 0)
