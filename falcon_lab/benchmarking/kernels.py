"""Kernel benchmark: the six Falcon ops (backend="triton"), fla chunk_delta_rule, SDPA flash
attention (causal) and the torch chunk form, in ONE run, at the issue's bf16 shapes.

Every op is first checked against a float64 reference at a small shape (B=1, T=256, H=2, same K/V);
an op that fails (or does not exist) gets no speed numbers, only a note. Timing: forward and
forward+backward medians of triton.testing.do_bench after warm-up, the host time to submit one forward+backward
(when it reaches the measured time the op is bound by its host, not its kernels) and the GPU time of one
(`gpu_ms_fwdbwd`: its kernels' device time from torch.profiler, summed; since 2026-12-04's twenty-first session);
peak memory of one forward+backward
(torch.cuda.max_memory_allocated, inputs included). Also reports the distance to the physical limit:
the bandwidth floor (the bytes that must move — inputs read once, outputs written once; forward+backward also
reads dO and the inputs again and writes their gradients — over 4.8 TB/s) and the tensor-core floor (the
op's model FLOPs, falcon-math.md §7, forward+backward = 3 × forward, over the dense bf16 peak), each as a
fraction of the measured time; the larger one names what bounds the op (`bound`: "memory" or "compute").
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import torch

# the two target shapes of the issue first, so a run cut short still has them
SHAPES = [(16, 2048, 12, 64), (1, 32768, 6, 128), (4, 8192, 12, 64), (16, 2048, 6, 128)]
FALCON = ["falcon-1", "falcon-2", "falcon-3", "falcon-1A", "falcon-2A", "falcon-3A"]
# falcon-3A runs the default Falcon-3A path, the one-scan banded kernel (window_linear.py; FALCON_TRITON_3A=banded,
# the default since 2026-12-03); falcon-3A-scans forces its W Falcon-1A scans (FALCON_TRITON_3A=scans) in the same
# run (until c2485d2 the pair was falcon-3A = the W scans and falcon-3A-banded, in the files of benchmarks/results/)
OPS = FALCON + ["falcon-3A-scans", "fla_chunk_delta_rule", "sdpa_flash", "torch_chunk_falcon-1"]
# Timed only when named (--ops), never part of the full default run: the PyTorch chunk forms that the Triton kernels
# replaced as the CUDA default (Falcon-2 since 2026-12-02), for a same-run ratio.
EXTRA_OPS = ["torch_chunk_falcon-2", "torch_chunk_falcon-2A"]
# the ops `--profile` traces at the first shape (torch.profiler table + chrome trace each)
PROFILED = ("falcon-1", "falcon-1A", "falcon-2", "falcon-2A", "falcon-3", "falcon-3A", "fla_chunk_delta_rule")
# ... and at every shape with T >= 8192, where Falcon-1 was 1.32-1.42x fla on the H200 (kernels_2026-12-02f)
PROFILED_LONG = ("falcon-1", "fla_chunk_delta_rule")
HBM_BPS = 4.8e12  # H200 datasheet
BF16_PEAK = 989.4e12  # H200 SXM datasheet: 1,979 TFLOPS bf16 with 2:4 sparsity, i.e. 989.4 dense
WINDOW = 4
CHUNK = 64  # the ops' default chunk size


from falcon_lab.kernels.spec import FalconSpec  # noqa: E402


def run_flags() -> dict:
    """The environment switches that choose kernel paths (FALCON_TRITON_*, e.g. FALCON_TRITON_UNPROVEN=1 or
    FALCON_TRITON_2A=blocked), recorded with every result so that a file says which paths it timed."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("FALCON_TRITON")}


def _commit():
    if os.environ.get("FALCON_COMMIT"):
        return os.environ["FALCON_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def op_variant(op: str) -> str | None:
    """The Falcon variant of an op label: falcon-3A -> 3A, falcon-3A-scans -> 3A, torch_chunk_falcon-1 -> 1;
    None for the baselines (sdpa_flash, fla_chunk_delta_rule)."""
    parts = op.split("-")
    return parts[1] if len(parts) > 1 else None


def make_inputs(op, B, T, H, K, V, dtype=torch.bfloat16, dev="cuda", seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    nrm = lambda t: t / t.float().norm(dim=-1, keepdim=True).to(t.dtype)  # noqa: E731
    q = nrm(torch.randn(B, T, H, K, device=dev, dtype=dtype, generator=g))
    k = nrm(torch.randn(B, T, H, K, device=dev, dtype=dtype, generator=g))
    v = torch.randn(B, T, H, V, device=dev, dtype=dtype, generator=g)
    if op.startswith("falcon") or op.startswith("torch_chunk"):
        variant = op_variant(op)
        per_col = FalconSpec.from_variant(variant).per_column
        beta = (torch.rand(B, T, H, V, device=dev, generator=g) if per_col
                else torch.rand(B, T, H, device=dev, generator=g)) * 1.8
        lam = torch.rand(B, T, H, device=dev, generator=g) * 0.5
        return [q, k, v, beta.to(dtype), lam.to(dtype)]
    if op == "fla_chunk_delta_rule":
        beta = torch.rand(B, T, H, device=dev, generator=g).to(dtype)
        return [q, k, v, beta]
    return [q, k, v]


def make_fn(op):
    if op.startswith("falcon") or op.startswith("torch_chunk"):
        from falcon_lab.kernels import chunk_falcon

        variant = op_variant(op)
        backend = "torch" if op.startswith("torch_chunk") else "triton"

        def fn(q, k, v, beta, lam):
            return chunk_falcon(q, k, v, beta, lam, variant=variant, window=WINDOW, lam_mode="scaled",
                                backend=backend)[0]
        if op.endswith("-scans"):
            import falcon_lab.kernels.triton as kt

            plain = fn

            def fn(*ins):  # the kernel family is chosen in the forward; autograd keeps it for the backward
                prev, kt._FALCON_3A = kt._FALCON_3A, "scans"
                try:
                    return plain(*ins)
                finally:
                    kt._FALCON_3A = prev
        return fn
    if op == "fla_chunk_delta_rule":
        from fla.ops.delta_rule import chunk_delta_rule

        def fn(q, k, v, beta):
            return chunk_delta_rule(q, k, v, beta, scale=1.0)[0]
        return fn
    if op == "sdpa_flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def fn(q, k, v):
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return o.transpose(1, 2)
        return fn
    raise ValueError(f"unknown op {op!r}")


def reference(op, ins):
    """float64 reference output for the correctness gate (ins: float64 leaves)."""
    x = list(ins)
    if op.startswith("falcon") or op.startswith("torch_chunk"):
        from falcon_lab.kernels import recurrent_falcon

        return recurrent_falcon(*x, variant=op_variant(op), window=WINDOW, lam_mode="scaled")[0]
    if op == "fla_chunk_delta_rule":
        from falcon_lab.benchmarking.ref64 import ref_core

        q, k, v, beta = x
        return ref_core(q, k, v, beta, torch.zeros_like(beta), None, delta=True, window=1, read_after=True)[0]
    q, k, v = (t.transpose(1, 2) for t in x)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    T = q.shape[2]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


def correctness(op, K, V, tol=2e-2):
    """Forward and input-gradient check against float64 at (1, 256, 2, K, V)."""
    ins = [t.requires_grad_(True) for t in make_inputs(op, 1, 256, 2, K, V, seed=1)]
    fn = make_fn(op)
    o = fn(*ins)
    do = torch.randn_like(o)
    gk = torch.autograd.grad((o.float() * do.float()).sum(), ins[:3])
    rins = [t.detach().double().requires_grad_(True) for t in ins]
    ro = reference(op, rins)
    gr = torch.autograd.grad((ro * do.double()).sum(), rins[:3])
    from falcon_lab.benchmarking.ref64 import rel_err

    errs = {"o": rel_err(o, ro)}
    errs.update({f"d{n}": rel_err(a, b) for n, a, b in zip("qkv", gk, gr)})
    return all(e <= tol for e in errs.values()), errs


def bytes_floor(op, B, T, H, K, V, fwd: bool):
    el = 2  # bf16
    n = B * T * H
    gates = 0
    if op.startswith("falcon") or op.startswith("torch_chunk"):
        gates = n * (V if op.endswith("2") or op.endswith("2A") else 1) + n  # beta, lam
    elif op == "fla_chunk_delta_rule":
        gates = n
    fwd_b = el * (n * (2 * K + V) + gates + n * V)  # read q, k, v, gates; write o
    if fwd:
        return fwd_b
    bwd_b = el * (n * (2 * K + V) + gates + n * V + n * (2 * K + V) + gates)  # read again + dO; write grads
    return fwd_b + bwd_b


def flops_model(op, B, T, H, K, V, C=CHUNK, W=WINDOW) -> float:
    """Forward model FLOPs of an op at (B, T, H, K, V): falcon-math.md §7's leading terms per token and head
    (2 per multiply-add, full matmuls), times B·T·H. Falcon-3 at its chunk of C/W steps (the §7 remark, how
    our form tiles it); fla's chunk_delta_rule is §7's "F1 (FLA, precomputed inverse)" row; causal SDPA
    2·(T/2)·(K+V) per token (the average prefix). The gates' and prep's elementwise work is left out."""
    d, e = K, V
    n = B * T * H
    name = op.replace("torch_chunk_", "").replace("-scans", "")
    per_tok = {
        "falcon-1A": 2 * C * (d + e) + 4 * d * e,
        "falcon-2A": 2 * C * (d + e) + 4 * d * e + C * e,
        "falcon-3A": 2 * (C + W) * (d + e) + 4 * d * e * (1 + W / (2 * C)) + C * W,
        "falcon-1": 4 * C * d + 3 * C * e + 6 * d * e,
        "falcon-2": 4 * C * d + 3.5 * C * e + 6 * d * e,
        "falcon-3": 4 * (C // W + W) * d + (W * W * (C // W) + 2 * W * (C // W)) * e + 6 * d * e,
        "fla_chunk_delta_rule": 4 * C * d + 3 * C * e + 6 * d * e + C * C / 3 + 2 * C * (d + e),
        "sdpa_flash": T * (d + e),
    }.get(name)
    if per_tok is None:
        raise KeyError(f"no FLOP model for op {op!r}")
    return float(per_tok) * n


def limit_fractions(op, B, T, H, K, V, ms: float, fwd: bool) -> dict:
    """The measured time's distance to the H200's physical limits: bandwidth floor / time, tensor-core floor
    / time, and which of the two is larger (what bounds the op at this shape)."""
    t = ms / 1e3
    bw = bytes_floor(op, B, T, H, K, V, fwd) / HBM_BPS / t
    tc = flops_model(op, B, T, H, K, V) * (1 if fwd else 3) / BF16_PEAK / t
    return dict(bw=round(bw, 4), tc=round(tc, 4), bound="memory" if bw >= tc else "compute")


def time_op(op, shape, profile_dir=None):
    import triton

    B, T, H, K = shape
    V = K
    ins = [t.requires_grad_(True) for t in make_inputs(op, B, T, H, K, V)]
    fn = make_fn(op)
    with torch.no_grad():
        fwd = triton.testing.do_bench(lambda: fn(*ins), warmup=25, rep=100, return_mode="median")
    do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)

    def fb():
        fn(*ins).backward(do)

    fwdbwd = triton.testing.do_bench(fb, warmup=25, rep=100, grad_to_none=ins, return_mode="median")
    host = host_ms(fb, ins)
    gpu = gpu_ms(fb, ins)[0]
    torch.cuda.synchronize()
    for t in ins:
        t.grad = None
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fb()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2 ** 20
    own = own_peak_mb(torch.cuda.max_memory_allocated(), before, ins + [do])
    if profile_dir is not None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                for t in ins:  # as do_bench's grad_to_none: no AccumulateGrad add_ in the table (before 2026-12-04's
                    t.grad = None  # twenty-first session the 2nd and 3rd calls added into the 1st's gradients)
                fb()
            torch.cuda.synchronize()
        name = f"{op}_{B}x{T}x{H}x{K}"
        prof.export_chrome_trace(str(Path(profile_dir) / f"trace_{name}.json"))
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        (Path(profile_dir) / f"profile_{name}.txt").write_text(table)
    ins = None  # free the inputs (not `del`: the closures above share the name, which pyflakes then flags)
    return fwd, fwdbwd, peak, host, own, gpu


def own_peak_mb(peak: int, before: int, tensors) -> float:
    """The op's own peak (MB): the process's peak over one fwd+bwd less what was allocated before it other than the
    call's inputs and output gradient. `peak_mem_mb` also counts what earlier work left allocated (ours, added
    2026-12-03: `bench kernels`' peaks ran 64.0-64.5 MB above the same op's in a process that ran nothing else,
    switch_ab.py / host_bound.py; our reading, not checked: the cuBLAS workspaces that the float64 check's matmuls
    allocate and keep). experiments/h200/op_memory.py predicts this number."""
    own_inputs = sum(t.numel() * t.element_size() for t in tensors)
    return (peak - before + own_inputs) / 2 ** 20


def host_ms(fn, ins, n=20) -> float:
    """Host time to submit one call of fn (n calls back to back, the GPU never waited for): when it reaches the
    measured time, the op runs at its host's pace, not its kernels' (experiments/h200/host_bound.py has the GPU side)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        for t in ins:
            t.grad = None
        fn()
    host = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    return host


def gpu_ms(fn, ins, n=5):
    """(the device time of every kernel one call of fn launches, summed, in ms; {kernel: ms per call}; kernel launches
    per call) from torch.profiler's CUDA activity over n calls, the inputs' gradients cleared before each (as
    do_bench's grad_to_none); (None, {}, None) where the profiler cannot start (no CUPTI on the runtime). Ours
    (2026-12-04, twenty-first session; also experiments/h200/host_bound.py's `measure`, which switch_ab.py reports as
    `gpu ms`): at the benchmark's small shapes the ops run at their host's pace, whose submit time moves between runs,
    so a ratio of op times there measures the host as much as the kernels; the GPU time does not."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    prof = profile(activities=[ProfilerActivity.CUDA])
    try:
        prof.__enter__()
    except Exception:  # noqa: BLE001  (the profiler only: fn's own errors are not caught below)
        return None, {}, None
    try:
        for _ in range(n):
            for t in ins:
                t.grad = None
            fn()
        torch.cuda.synchronize()
    finally:
        prof.__exit__(None, None, None)
    for t in ins:
        t.grad = None
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    if not events:
        return None, {}, None
    per = {e.key: e.self_device_time_total / n / 1e3 for e in events}
    return sum(per.values()), per, sum(e.count for e in events) / n


def time_core(op, shape):
    """The Triton core alone (docs/kernel-contract.md) on inputs prepared once by the shared prep:
    separates kernel time from the torch prep (shift, NLMS step, clamp, statistic) and autograd glue."""
    import triton

    from falcon_lab.kernels.prep import VARIANTS, effective_window, prepare
    from falcon_lab.kernels.triton import core

    B, T, H, K = shape
    variant = op_variant(op)
    delta = VARIANTS[variant].delta
    W = effective_window(variant, WINDOW)
    q, k, v, beta, lam = make_inputs(op, B, T, H, K, K)
    with torch.no_grad():
        ci = prepare(k, v, beta, lam, variant=variant, window=WINDOW, step="nlms", lam_mode="scaled",
                     shift=True, eps=1e-6, eps_gamma=1e-4, seen=torch.zeros(B, dtype=torch.long, device="cuda"))
    ins = [t.detach().contiguous().requires_grad_(True) for t in (q, ci.xw, ci.vw, ci.eta, ci.g)]

    fused = False if op.endswith("-scans") else None  # falcon-3A-scans: the W scans; else FALCON_TRITON_3A's path

    def fn():
        return core(*ins, None, delta=delta, window=W, read_after=True, chunk_size=64, fused_window=fused)[0]

    with torch.no_grad():
        fwd = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    do = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    fwdbwd = triton.testing.do_bench(lambda: fn().backward(do), warmup=25, rep=100, grad_to_none=ins,
                                     return_mode="median")
    return fwd, fwdbwd


def time_decode(shape):
    """One Falcon-1 decoding step (T = 1 with a state) through the public op, eager and replayed
    from a CUDA graph."""
    import triton

    from falcon_lab.kernels import chunk_falcon

    B, _, H, K = shape
    q, k, v, beta, lam = make_inputs("falcon-1", B, 2, H, K, K)
    kw = dict(variant="1", window=WINDOW, lam_mode="scaled", backend="triton")
    with torch.no_grad():
        _, st = chunk_falcon(q[:, :1], k[:, :1], v[:, :1], beta[:, :1], lam[:, :1], output_final_state=True, **kw)
        step = [t[:, 1:2].contiguous() for t in (q, k, v, beta, lam)]
        eager = triton.testing.do_bench(lambda: chunk_falcon(*step, initial_state=st, output_final_state=True, **kw),
                                        warmup=25, rep=100, return_mode="median")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            chunk_falcon(*step, initial_state=st, output_final_state=True, **kw)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chunk_falcon(*step, initial_state=st, output_final_state=True, **kw)
        graph = triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median")
    return eager, graph


def result_stem(ops, shapes) -> str:
    """File stem of a run's results: `kernels_h200` only for a full default run (every op, every shape);
    a partial run (--ops, --quick) writes `kernels_h200_partial.*`, so it never replaces the full file."""
    full = set(ops) == set(OPS) and list(shapes) == list(SHAPES)
    return "kernels_h200" if full else "kernels_h200_partial"


def run(out_dir="benchmarks/results", ops=None, shapes=None, profile=False):
    import triton

    ops = ops or OPS
    shapes = shapes or SHAPES
    stem = result_stem(ops, shapes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=_commit(), flags=run_flags())
    rows = []
    t0 = time.time()
    checked = {}
    # fla last (its first-call autotuning takes minutes), target shapes first
    fla = "fla_chunk_delta_rule"
    plan = [(s, o) for s in shapes[:2] for o in ops if o != fla] + [(s, fla) for s in shapes[:1] if fla in ops]
    plan += [(s, o) for s in shapes[2:] for o in ops if o != fla] + [(s, fla) for s in shapes[1:] if fla in ops]
    for shape, op in plan:
        B, T, H, K = shape
        if True:
            key = (op, K)
            row = dict(op=op, B=B, T=T, H=H, K=K, V=K, window=WINDOW if op_variant(op) in ("3", "3A") else 1,
                       dtype="bfloat16", fwd_ms=None, fwdbwd_ms=None, peak_mem_mb=None, **meta)
            if key not in checked:
                try:
                    ok, errs = correctness(op, K, K)
                    checked[key] = (ok, errs, None)
                except Exception as e:
                    checked[key] = (False, None, f"{type(e).__name__}: {e}"[:300])
            ok, errs, err = checked[key]
            row["check_errors"] = errs
            if not ok:
                row["note"] = err or f"failed its float64 correctness check: {errs}; speed not reported"
                rows.append(row)
                print(f"[{time.time() - t0:6.1f}s] {op:22s} {shape} NOT TIMED: {row['note'][:150]}", flush=True)
                continue
            try:
                prof = str(out) if (profile and ((shape == shapes[0] and op in PROFILED)
                                                   or (shape[1] >= 8192 and op in PROFILED_LONG))) else None
                fwd, fwdbwd, peak, host, own, gpu = time_op(op, shape, profile_dir=prof)
                row.update(fwd_ms=round(fwd, 4), fwdbwd_ms=round(fwdbwd, 4), peak_mem_mb=round(peak, 1),
                           peak_mem_op_mb=round(own, 1), host_ms_fwdbwd=round(host, 4),
                           gpu_ms_fwdbwd=round(gpu, 4) if gpu is not None else None)
                lf, lfb = limit_fractions(op, B, T, H, K, K, fwd, True), limit_fractions(op, B, T, H, K, K, fwdbwd, False)
                row.update(bw_floor_frac_fwd=lf["bw"], bw_floor_frac_fwdbwd=lfb["bw"], tc_peak_frac_fwd=lf["tc"],
                           tc_peak_frac_fwdbwd=lfb["tc"], bound_fwdbwd=lfb["bound"],
                           model_gflop_fwd=round(flops_model(op, B, T, H, K, K) / 1e9, 3))
                if op in ("falcon-1", "falcon-1A", "falcon-3A", "falcon-3A-scans"):
                    cf, cfb = time_core(op, shape)
                    row.update(core_fwd_ms=round(cf, 4), core_fwdbwd_ms=round(cfb, 4))
                    row["core_bw_floor_frac_fwdbwd"] = round(bytes_floor(op, B, T, H, K, K, False) / HBM_BPS * 1e3 / cfb, 4)
                if op == "falcon-1" and shape == shapes[0]:
                    de, dg = time_decode(shape)
                    row.update(decode_step_eager_ms=round(de, 4), decode_step_graph_ms=round(dg, 4))
            except Exception as e:
                row["note"] = f"timing failed: {type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(f"[{time.time() - t0:6.1f}s] {op:22s} {shape} fwd {row['fwd_ms']} ms fwd+bwd {row['fwdbwd_ms']} ms "
                  f"peak {row['peak_mem_mb']} MB {row.get('note', '')[:100]}", flush=True)
            torch.cuda.empty_cache()
            (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))  # after every row
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / f"{stem}.png")
    print(summary(rows))
    (out / f"{stem}.md").write_text(summary(rows))
    print(f"wrote {out / stem}.{{json,md,png}}", flush=True)
    return rows


def warm(ops=None, shapes=None):
    """Compile without timing (`bench kernels --warm`): each op's float64 check and one fwd+bwd at each shape, so that
    a full run after it, reading the same TRITON_CACHE_DIR, spends its time timing. On a fresh H200 the full run's
    compiles (fla's above all: 75 s at the first shape) pushed it past 440 s on 2026-12-03; one process per (op,
    shape) in parallel compiles on separate CPU cores (experiments/h200/prove_kernels.sh step `warm`)."""
    t0 = time.time()
    for shape in shapes or SHAPES:
        B, T, H, K = shape
        for op in ops or OPS:
            try:
                correctness(op, K, K)
                ins = [t.requires_grad_(True) for t in make_inputs(op, B, T, H, K, K)]
                make_fn(op)(*ins).float().sum().backward()
                torch.cuda.synchronize()
                status = "compiled"
            except Exception as e:  # the timed run reports it; here only say so
                status = f"failed: {type(e).__name__}: {e}"[:200]
            print(f"[{time.time() - t0:6.1f}s] warm {op:22s} {shape} {status}", flush=True)
            ins = None
            torch.cuda.empty_cache()


def _own(r) -> str:
    return f" ({r['peak_mem_op_mb']})" if r.get("peak_mem_op_mb") is not None else ""


def summary(rows):
    flags = rows[0].get("flags") if rows else None
    head = [f"Environment switches: {', '.join(f'{k}={v}' for k, v in flags.items()) or 'none'}", ""] \
        if flags is not None else []
    lines = head + [
             "| op | B×T×H×K | fwd ms | fwd+bwd ms | host ms to submit fwd+bwd | GPU ms of fwd+bwd (kernels' device "
             "time) | core fwd ms | core fwd+bwd ms | peak MB (op's own) | bandwidth floor frac fwd+bwd (op / core) | "
             "tensor-core peak frac fwd+bwd | bound | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gpu = r.get("gpu_ms_fwdbwd")
        lines.append(f"| {r['op']} | {r['B']}×{r['T']}×{r['H']}×{r['K']} | {r['fwd_ms']} | {r['fwdbwd_ms']} | "
                     f"{r.get('host_ms_fwdbwd', '')} | {gpu if gpu is not None else ''} | "
                     f"{r.get('core_fwd_ms', '')} | {r.get('core_fwdbwd_ms', '')} | {r['peak_mem_mb']}"
                     f"{_own(r)} | "
                     f"{r.get('bw_floor_frac_fwdbwd')} / {r.get('core_bw_floor_frac_fwdbwd', '')} | "
                     f"{r.get('tc_peak_frac_fwdbwd', '')} | {r.get('bound_fwdbwd', '')} | {r.get('note', '')[:80]} |")
        if r.get("decode_step_graph_ms") is not None:
            lines.append(f"| falcon-1 decode step (T=1, state) | {r['B']}×1×{r['H']}×{r['K']} | eager {r['decode_step_eager_ms']} | "
                         f"CUDA graph {r['decode_step_graph_ms']} | | | | | | | | | |")
    return "\n".join(lines) + "\n"


def plot(rows, path):
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = sorted({(r["B"], r["T"], r["H"], r["K"]) for r in rows}, key=lambda s: (s[3], s[1]))
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 4.5), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        vals = {r["op"]: r["fwdbwd_ms"] for r in rows if (r["B"], r["T"], r["H"], r["K"]) == s}
        ys = [vals.get(o) for o in ops]
        ax.barh(range(len(ops)), [y or 0.0 for y in ys], color=["C0" if o.startswith("falcon") else "C1" for o in ops])
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        lo = min([y for y in ys if y] or [1.0])
        for j, y in enumerate(ys):
            ax.text(y or lo, j, f" {y:.2f}" if y else " not measured", va="center", fontsize=7)
        ax.set_yticks(range(len(ops)))
        ax.set_yticklabels(ops, fontsize=7)
        ax.set_title(f"B={s[0]} T={s[1]} H={s[2]} K=V={s[3]}", fontsize=9)
        ax.set_xlabel("fwd+bwd ms (median, bf16, log scale)")
    fig.suptitle(f"{rows[0]['gpu']}  torch {rows[0]['torch']}  triton {rows[0]['triton']}  {rows[0]['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
