"""Cases for tests/test_triton_interp.py, run in a subprocess with TRITON_INTERPRET=1 (set before
triton is imported). Each case compares backend-triton core against a float64 step-by-step loop,
forward and backward (q, xw, vw, eta, g, S0 and through S_T, or with S_T unused: `no_dst`). Prints one JSON line
per case."""

import json
import os
import sys
import time

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import interp_case_helpers  # noqa: E402,F401  (one torch thread; device calls without the interpreter's re-patching)
import torch  # noqa: E402

torch.set_num_threads(1)

from falcon_lab.kernels.triton import core  # noqa: E402


from falcon_lab.benchmarking.ref64 import ref_core, make_core_inputs  # noqa: E402


def make(B, T, H, K, V, W, strong, seed, per_col=False):
    return make_core_inputs(B, T, H, K, V, W, strong=strong, per_col=per_col, seed=seed)


def run_case(c):
    B, T, H, K, V = c["B"], c["T"], c["H"], c["K"], c["V"]
    W, delta, after, C = c["W"], c["delta"], c["after"], c["C"]
    dtype = getattr(torch, c["dtype"])
    q, xw, vw, eta, g, S0 = make(B, T, H, K, V, W, c.get("strong", False), c["seed"], per_col=c.get("per_col", False))
    if not c.get("s0", True):
        S0 = None
    ins = [q, xw, vw, eta, g] + ([S0] if S0 is not None else [])
    for t in ins:
        t.requires_grad_(True)
    o_ref, s_ref = ref_core(q, xw, vw, eta, g, S0, delta=delta, window=W, read_after=after)
    gen = torch.Generator().manual_seed(c["seed"] + 7)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    ds = torch.randn(s_ref.shape, generator=gen, dtype=torch.float64)
    no_dst = c.get("no_dst", False)  # S_T unused: the op's backward gets no dS_T at all (None, not zeros)
    if no_dst:
        ds = torch.zeros_like(ds)
    ref_grads = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), ins)

    # inputs of the kernel in the case dtype (eta, g, S0 in fp32 as the contract says)
    qi = q.detach().to(dtype).requires_grad_(True)
    xi = xw.detach().to(dtype).requires_grad_(True)
    vi = vw.detach().to(dtype).requires_grad_(True)
    ei = eta.detach().float().requires_grad_(True)
    gi = g.detach().float().requires_grad_(True)
    si = S0.detach().float().requires_grad_(True) if S0 is not None else None
    kins = [qi, xi, vi, ei, gi] + ([si] if si is not None else [])
    import falcon_lab.kernels.triton.ops as kops

    fam = kops._FAMILIES["window_delayed"]
    n_wd = [0]

    def counted(*a):
        n_wd[0] += 1
        return fam[0](*a)
    kops._FAMILIES["window_delayed"] = (counted, *fam[1:])
    try:
        o, s = core(qi, xi, vi, ei, gi, si, delta=delta, window=W, read_after=after, chunk_size=C,
                    fused_window=c.get("fused"))
    finally:
        kops._FAMILIES["window_delayed"] = fam
    loss = (o.double() * do).sum() + (0 if no_dst else (s.double() * ds).sum())
    grads = torch.autograd.grad(loss, kins)

    def rel(a, b):
        a = a.double()
        if not torch.isfinite(a).all():
            return float("inf")
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    names = ["q", "xw", "vw", "eta", "g", "S0"]
    res = {"o": rel(o, o_ref), "S_T": rel(s, s_ref)}
    for n, a, b in zip(names, grads, ref_grads):
        res["d" + n] = rel(a, b)
    if c.get("delayed"):  # the delayed form (window_delayed.py) ran, once: 0 (an error-like entry) when it did
        res["delayed_off"] = float(n_wd[0] != 1)
    if c.get("lean_meta"):  # the lean form's saved buffers agree with the custom operator's fakes
        cfg = [1, int(after), C, 0, 0, 0, W, 1]
        with torch.no_grad():
            outs = kops._scalar_fwd(qi, xi, vi, ei, gi, si, cfg)
        meta = kops._scalar_saved_shapes(qi, xi, vi, cfg)
        res["saved_meta_off"] = float(len(outs) != 6 or any(tuple(t.shape) != tuple(sh) or t.dtype != dt
                                                             for t, (sh, dt) in zip(outs[2:], meta)))
    if c.get("state_dtype") and W == 1:  # the saved states' dtype, and the custom operator's fake outputs agree with it
        cfg = [int(delta), int(after), C, 0, 0, 0, 1, 0]
        with torch.no_grad():
            outs = kops._scalar_fwd(qi, xi, vi, ei, gi, si, cfg)
        meta = kops._scalar_saved_shapes(qi, xi, vi, cfg)
        want = dtype if c["state_dtype"] == "input" else torch.float32
        res["hs_dtype_off"] = float(outs[2].dtype != want)
        res["saved_meta_off"] = float(any(tuple(t.shape) != tuple(sh) or t.dtype != dt
                                          for t, (sh, dt) in zip(outs[2:], meta)))
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


def compile_case(c):
    """A decoder block with every Triton path on (the op's custom operators, the fused modules) under
    torch.compile(fullgraph=True): no graph break, and the same output and parameter gradients as eager."""
    from falcon_lab.models import build_model

    torch.manual_seed(c["seed"])
    mix = dict(name="falcon", variant=c["variant"], backend="triton", module_backend="triton", chunk_size=16)
    blk = build_model(dict(d_model=32, n_layers=1, n_heads=2, head_dim=16), mix, vocab_size=64).blocks[0]
    h = torch.randn(2, 20, 32)

    def f(h):
        return blk(h)[0]

    params = list(blk.parameters())
    ref = f(h)
    gref = torch.autograd.grad(ref.square().sum(), params)
    torch._dynamo.reset()
    res = {}
    if c.get("prep_op"):  # FALCON_TRITON_PREP_COMPILED=op: the fused prep's custom operators inside the graph
        import falcon_lab.kernels.triton as kt
        from falcon_lab.kernels.triton import prep_ops

        calls, fwd = {"prep": 0}, prep_ops._forward

        def counted(*a):
            calls["prep"] += 1
            return fwd(*a)

        prev, kt._PREP_COMPILED, prep_ops._forward = kt._PREP_COMPILED, "op", counted
        try:
            out = torch.compile(f, backend="aot_eager", fullgraph=True)(h)
        finally:
            kt._PREP_COMPILED, prep_ops._forward = prev, fwd
        res["prep_op_calls"] = calls["prep"]
    else:
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(h)
    g = torch.autograd.grad(out.square().sum(), params)
    res["max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip((out, *g), (ref, *gref)))
    return res


def recompute_case(c):
    """mixer.recompute=true (selective activation checkpointing of the glue): the same output and
    parameter gradients as without it, eager and under torch.compile(fullgraph=True), and the op's Triton
    core forward runs once per training step (kept, not recomputed) while the glue is recomputed."""
    from falcon_lab.kernels.triton import ops
    from falcon_lab.models import build_model

    fam = {"2A": "percol", "2": "percol_delta"}.get(c["variant"], "scalar")
    calls = {"core": 0}
    fwd, bwd, shapes = ops._FAMILIES[fam]

    def counted(*a, **k):
        calls["core"] += 1
        return fwd(*a, **k)

    ops._FAMILIES[fam] = (counted, bwd, shapes)
    out = {}
    grads = {}
    for label, rc, comp in (("plain", False, False), ("recompute", True, False), ("recompute_compiled", True, True)):
        torch.manual_seed(c["seed"])
        mix = dict(name="falcon", variant=c["variant"], backend="triton", module_backend="triton", chunk_size=16,
                   recompute=rc)
        blk = build_model(dict(d_model=32, n_layers=1, n_heads=2, head_dim=16), mix, vocab_size=64).blocks[0]
        h = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(1))

        def f(h):
            return blk(h)[0]

        if comp:
            torch._dynamo.reset()
            f = torch.compile(f, backend="aot_eager", fullgraph=True)
        else:  # count the glue's runs (eager only: compiled, the recompute is inside the traced graph)
            glue = blk.mixer._glue_and_op

            def counted_glue(*a, **k):
                calls["glue"] += 1
                return glue(*a, **k)

            blk.mixer._glue_and_op = counted_glue
        calls["core"] = calls["glue"] = 0
        y = f(h)
        g = torch.autograd.grad(y.square().sum(), list(blk.parameters()))
        out[f"{label}_core_calls"] = calls["core"]
        if not comp:
            out[f"{label}_glue_calls"] = calls["glue"]
        grads[label] = (y, *g)
    for label in ("recompute", "recompute_compiled"):
        out[f"{label}_max_abs_diff"] = max(float((a - b).detach().abs().max()) for a, b in zip(grads[label], grads["plain"]))
    return out


if __name__ == "__main__":
    import falcon_lab.kernels.triton as kt

    import falcon_lab.kernels.triton.chunk as kchunk
    import falcon_lab.kernels.triton.common as kcommon
    import falcon_lab.kernels.triton.pair_sum as kpair
    import falcon_lab.kernels.triton.percol as kpercol
    import falcon_lab.kernels.triton.percol_delta as kpdelta
    import falcon_lab.kernels.triton.window_linear as kwl

    cases = json.loads(sys.argv[1])
    default_3a = kt._FALCON_3A
    default_packed3a = kt._FALCON_3A_PACKED
    default_a_dtype = kchunk.A_DTYPE
    default_a_inv = kchunk.A_INV
    default_du_dtype = kchunk.DU_DTYPE
    default_gate_fold = kchunk.GATE_FOLD
    default_dq_sum = kchunk.DQ_SUM
    default_step_rows, srows_of, seen_sr = kchunk.STEP_ROWS, kchunk.step_rows, []

    def seen_srows(*a):  # whether each chunk.py call ran the step rows (SROWS), for the step_rows cases
        out = srows_of(*a)
        seen_sr.append(out)
        return out
    kchunk.step_rows = seen_srows
    default_state_dtype = kchunk.STATE_DTYPE
    default_intra = kpercol.INTRA
    default_fwd_grid = kpercol.FWD_GRID
    default_rows_bv = kpercol.ROWS_BV
    default_rows_grid = kpercol.ROWS_GRID
    default_bwd_intra = kpercol.BWD_INTRA
    default_fwd_inter = kpercol.FWD_INTER
    default_diag, default_spans = kpercol.DIAG, dict(kpercol.DIAG_SPANS)
    default_pair_sum = kpair.PAIR_SUM
    default_state_bv = kcommon.STATE_BV
    default_ksplit, default_ksplit_bk = kcommon.LINEAR_KSPLIT, kcommon.KSPLIT_MIN_BK
    default_wl_bwd_bv = kwl.WL_BWD_BV
    default_wl_weights = kwl.WL_WEIGHTS
    default_solve = kpdelta.SOLVE
    default_bwd_solve = kpdelta.BWD_SOLVE
    default_inv_form = kpdelta.INV_FORM
    default_blk_bwd = kpdelta.BLK_BWD
    default_inv_keep = kpdelta.INV_KEEP
    default_launch = {(m, a): getattr(m, a) for m, a in ((kpdelta, "SOLVE_BLK_WARPS"), (kpdelta, "SOLVE_BLK_BV"),
                                                          (kpercol, "FWD_SB_WARPS"), (kpercol, "FWD_SB_BV"))}
    tiles, seen_nkb = kchunk.linear_state_tiles, []

    def seen_tiles(*a):  # the key tiles of every linear state pass (forward and backward), for the ksplit cases
        out = tiles(*a)
        seen_nkb.append(out[2])
        return out
    kchunk.linear_state_tiles = kpercol.linear_state_tiles = seen_tiles
    import falcon_lab.kernels.triton.state_split as ksplit_seq
    default_linear_split, default_split_len = ksplit_seq.LINEAR_SPLIT, ksplit_seq.SPLIT_LEN
    pieces, seen_np = ksplit_seq.split_pieces, []

    def seen_pieces(*a):  # the pieces of every state pass chunk.py runs (0: the single pass), for the split cases
        out = pieces(*a)
        seen_np.append(out)
        return out
    kchunk.split_pieces = kpercol.split_pieces = seen_pieces
    import falcon_lab.kernels.triton.delta_split as kds
    default_delta_split, default_dsplit_len = kds.DELTA_SPLIT, kds.DELTA_SPLIT_LEN
    dpieces, seen_dp = kds.dsplit_pieces, []

    def seen_dpieces(*a):  # the pieces of every delta-rule call chunk.py runs (0: the single pass), for dsplit cases
        out = dpieces(*a)
        seen_dp.append(out)
        return out
    kds.dsplit_pieces = seen_dpieces
    import falcon_lab.kernels.triton.lean as klean
    default_lean, default_lean_segments = klean.LEAN, klean.LEAN_SEGMENTS
    bounds_of, seen_lean = klean.lean_bounds, []

    def seen_bounds(*a):  # the segments of every chunk.py call ([]: one call), for the lean cases
        out = bounds_of(*a)
        seen_lean.append(len(out))
        return out
    klean.lean_bounds = seen_bounds
    for c in cases:
        # what FALCON_TRITON_3A=delayed / =banded / =scans sets (the fused=True Falcon-3A cases are the banded scan's;
        # Falcon-3's `fused` is not read by this switch); none: the default (delayed since 2026-12-04) or the env's
        kt._FALCON_3A = ("delayed" if c.get("delayed") else "banded" if c.get("banded") or c.get("fused")
                         else "scans" if c.get("scans") else default_3a)
        kt._FALCON_3A_PACKED = c.get("packed3a", default_packed3a)  # what FALCON_TRITON_3A_PACKED sets
        kpercol.INTRA = c.get("intra", default_intra)  # what FALCON_TRITON_2A sets
        kpercol.FWD_GRID = c.get("fwd_grid", default_fwd_grid)  # what FALCON_TRITON_2A_FWD_GRID sets
        kpercol.ROWS_BV = c.get("rows_bv", default_rows_bv)  # what FALCON_TRITON_2A_ROWS_BV sets
        kpercol.ROWS_GRID = c.get("rows_grid", default_rows_grid)  # what FALCON_TRITON_2A_ROWS_GRID sets
        kpercol.BWD_INTRA = c.get("bwd_intra", default_bwd_intra)  # what FALCON_TRITON_2A_BWD_INTRA sets
        kpercol.FWD_INTER = c.get("fwd_inter", default_fwd_inter)  # what FALCON_TRITON_2A_FWD_INTER sets
        kpercol.DIAG = c.get("diag", default_diag)  # what FALCON_TRITON_2A_DIAG sets
        kpercol.DIAG_SPANS = dict(default_spans, **c.get("diag_spans", {}))  # a lower bound reaches the fallback
        kpair.PAIR_SUM = c.get("pair_sum", default_pair_sum)  # what FALCON_TRITON_3_PAIR_SUM sets
        kpdelta.SOLVE = c.get("solve", default_solve)  # what FALCON_TRITON_2_SOLVE sets
        kpdelta.BWD_SOLVE = c.get("bwd_solve", default_bwd_solve)  # what FALCON_TRITON_2_BWD_SOLVE sets
        kpdelta.INV_FORM = c.get("inv_form", default_inv_form)  # what FALCON_TRITON_2_INV sets
        kpdelta.BLK_BWD = tuple(c.get("blk_bwd", default_blk_bwd))  # what FALCON_TRITON_2_BLK_BWD sets
        kpdelta.INV_KEEP = c.get("inv_keep", default_inv_keep)  # what FALCON_TRITON_2_INV_KEEP sets
        for (m, a), d in default_launch.items():  # ..._2_SOLVE_BLK_{WARPS,BV}, _2A_FWD_SB_{WARPS,BV}
            setattr(m, a, c.get(a.lower(), d))
        kcommon.STATE_BV = c.get("state_bv", default_state_bv)  # what FALCON_TRITON_STATE_BV sets
        # what FALCON_TRITON_LINEAR_KSPLIT=on sets, with key tiles down to 16 (so that the small cases split)
        kcommon.LINEAR_KSPLIT = "on" if c.get("ksplit") else default_ksplit
        kcommon.KSPLIT_MIN_BK = 16 if c.get("ksplit") else default_ksplit_bk
        kchunk.A_DTYPE = c.get("a_dtype", default_a_dtype)  # what FALCON_TRITON_A_DTYPE sets
        kchunk.A_INV = c.get("a_inv", default_a_inv)  # what FALCON_TRITON_A_INV sets
        kchunk.DU_DTYPE = c.get("du_dtype", default_du_dtype)  # what FALCON_TRITON_DU_DTYPE sets
        kchunk.GATE_FOLD = c.get("gate_fold", default_gate_fold)  # what FALCON_TRITON_GATE_FOLD sets
        kchunk.DQ_SUM = c.get("dq_sum", default_dq_sum)  # what FALCON_TRITON_3_DQ_SUM sets
        kchunk.STEP_ROWS = c.get("step_rows", default_step_rows)  # what FALCON_TRITON_3_STEP_ROWS sets
        kchunk.STATE_DTYPE = c.get("state_dtype", default_state_dtype)  # what FALCON_TRITON_STATE_DTYPE sets
        kwl.WL_BWD_BV = c.get("wl_bwd_bv", default_wl_bwd_bv)  # what FALCON_TRITON_3A_BWD_BV sets
        kwl.WL_WEIGHTS = c.get("wl_weights", default_wl_weights)  # what FALCON_TRITON_3A_WEIGHTS sets
        # what FALCON_TRITON_LINEAR_SPLIT=on sets, with pieces of `split` chunks (so that the small cases split)
        ksplit_seq.LINEAR_SPLIT = "on" if c.get("split") else default_linear_split
        ksplit_seq.SPLIT_LEN = c.get("split", default_split_len)
        # what FALCON_TRITON_DELTA_SPLIT=on sets, with pieces of `dsplit` chunks (so that the small cases split)
        kds.DELTA_SPLIT = "on" if c.get("dsplit") else default_delta_split
        kds.DELTA_SPLIT_LEN = c.get("dsplit", default_dsplit_len)
        # what FALCON_TRITON_3_LEAN=on sets, with `lean` segments
        klean.LEAN = "on" if c.get("lean") else default_lean
        klean.LEAN_SEGMENTS = c.get("lean", default_lean_segments)
        seen_nkb.clear()
        seen_sr.clear()
        seen_np.clear()
        seen_dp.clear()
        seen_lean.clear()
        t0 = time.perf_counter()
        try:
            if c.get("recompute"):
                res = recompute_case(c)
            elif c.get("compile"):
                res = compile_case(c)
            elif c.get("varlen"):
                from falcon_lab.benchmarking.gpu_check import check_varlen

                import falcon_lab.kernels.triton.ops as ops

                prep = kt._PREP
                kt._PREP = c.get("prep", prep)  # what FALCON_TRITON_PREP sets
                fam = ops._FAMILIES["window_delayed"]
                n_wd = [0]

                def counted_wd(*a, _f=fam[0]):
                    n_wd[0] += 1
                    return _f(*a)
                ops._FAMILIES["window_delayed"] = (counted_wd, *fam[1:])
                try:
                    res = check_varlen(variant=c["variant"], dtype=c["dtype"], K=c.get("K", 16), dev="cpu",
                                       seed=c["seed"],
                                       C=c["C"], read=c.get("read", "after"), shift=c.get("shift", True))
                finally:
                    kt._PREP = prep
                    ops._FAMILIES["window_delayed"] = fam
                if c.get("packed3a") == "delayed":  # the delayed form's packed branches ran (0 when they did)
                    res["delayed_off"] = float(n_wd[0] == 0)
            elif c.get("api"):
                from falcon_lab.benchmarking.gpu_check import check_api

                import falcon_lab.kernels.triton.ops as ops

                n_wl = [0]  # the one-scan Falcon-3A kernel's forward calls, for the banded cases
                family = ops._FAMILIES["window_linear"]

                def counted(*a, _f=family[0]):
                    n_wl[0] += 1
                    return _f(*a)
                ops._FAMILIES["window_linear"] = (counted, *family[1:])
                try:
                    res = check_api(variant=c["variant"], dtype=c["dtype"], K=16, dev="cpu", seed=c["seed"])
                finally:
                    ops._FAMILIES["window_linear"] = family
                if c.get("banded"):
                    res["window_linear_calls"] = n_wl[0]
            else:
                res = decode_case(c) if c.get("decode") else run_case(c)
            if c.get("split_none"):  # passes the split must leave whole (delta rule, packed): 0 when none split
                res["split_on"] = float(any(n > 0 for n in seen_np))
            elif c.get("split"):  # every linear state pass ran in pieces (0 when each did, forward and backward)
                res["split_off"] = float(not seen_np or min(seen_np) < 2)
            if c.get("lean_none"):  # calls the lean form must leave whole: 0 when none was segmented
                res["lean_on"] = float(any(n > 0 for n in seen_lean))
            elif c.get("lean"):  # the outer forward and backward ran in segments (0 when both did)
                res["lean_off"] = float(sum(n >= 2 for n in seen_lean) < 2)
            if c.get("dsplit_none"):  # calls the delta split must leave whole: 0 when none split
                res["dsplit_on"] = float(any(n > 0 for n in seen_dp))
            elif c.get("dsplit"):  # every delta-rule call ran in pieces (0 when each did, forward and backward)
                res["dsplit_off"] = float(not seen_dp or min(seen_dp) < 2)
            if c.get("srows_none"):  # calls that must keep every pseudo-token row: 0 when none ran SROWS
                res["srows_on"] = float(any(seen_sr))
            elif c.get("step_rows") == "on":  # every call ran on the step rows (0 when each did)
                res["srows_off"] = float(not seen_sr or not all(seen_sr))
            if c.get("ksplit_none"):  # a delta rule's state passes: none split (0 when none did)
                res["ksplit_on"] = float(any(n > 1 for n in seen_nkb))
            elif c.get("ksplit"):  # every linear state pass split its keys (0 when each did, forward and backward)
                res["ksplit_off"] = float(not seen_nkb or min(seen_nkb) < 2)
            print(json.dumps({"id": c["id"], "res": res, "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
        except Exception as e:  # report, the test fails on it
            print(json.dumps({"id": c["id"], "error": f"{type(e).__name__}: {e}"}), flush=True)
