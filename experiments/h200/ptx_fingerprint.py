"""Fingerprint the GPU code of every Triton kernel in falcon_lab, on a machine without a GPU.

Each kernel launch that the launchers make for a grid of configurations is recorded (not run), compiled for the H200
(sm_90) with the H200's Triton up to PTX, and the PTX hashed after removing what names and debug lines change (the
kernel's name, line info). Two trees whose kernels hash the same compile to the same PTX, so to the same GPU code: a
kernel proven on the H200 stays proven through a change of the Python around it (a refactor into shared helpers, a
renamed launcher) exactly when its fingerprints are unchanged. Ours (a check of the carry-over, not a proof of
correctness by itself).

    pip install --no-deps --target /tmp/t36 triton==3.6.0          # the H200's Triton (platform-notes)
    PYTHONPATH=/tmp/t36 .venv/bin/python experiments/h200/ptx_fingerprint.py --out new.json
    git worktree add /tmp/old <commit>
    PYTHONPATH=/tmp/t36 .venv/bin/python experiments/h200/ptx_fingerprint.py --tree /tmp/old --out old.json
    .venv/bin/python experiments/h200/ptx_fingerprint.py --compare old.json new.json

A build is named by kernel, dtype, K = V, chunk C, read order and the family's flags; its fingerprint covers the
specialisation Triton derives from the arguments (pointer alignment, integers divisible by 16) as on the GPU.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_DISABLE_LINE_INFO"] = "1"


class _Ptx(Exception):
    """Raised in place of the stage after the one hashed: compiling stops there (no ptxas run)."""


STAGE = "ttir"
DUMP = None  # --dump DIR


def _normalise(code: str, name: str) -> str:
    """PTX or TTIR without comments, line info and locations, the kernel's name replaced."""
    out = []
    for line in code.splitlines():
        # locations, also the callsite(#locA at #locB) ones on block arguments (their numbers move when lines do)
        s = re.sub(r"\s*loc\((#loc\d*|\"[^\"]*\"(:\d+)*|unknown|callsite\(#loc\d* at #loc\d*\))\)", "",
                   line.strip())
        if not s or s.startswith(("//", ".loc", ".file", "#loc")):
            continue
        out.append(s)
    text = "\n".join(out).replace(name, "KERNEL")
    sig = re.search(r"tt\.func public @KERNEL\((.*)\) attributes", text)
    if sig:
        # TTIR names the arguments after the Python parameters, and a kernel shared by several families carries
        # the arguments of all: drop the ones the body never reads and number the rest in order.
        head, body = text[:sig.start()], text[sig.end():]
        kept = []
        for decl in re.split(r", (?=%\w+: )", sig.group(1)):
            arg = re.match(r"%(\w+): ", decl).group(1)
            if re.search(rf"%{arg}\b", body):
                kept.append((arg, decl))
        for i, (arg, _) in enumerate(kept):
            body = re.sub(rf"%{arg}\b", f"%arg_{i}", body)
        decls = ", ".join(re.sub(r"^%\w+", f"%arg_{i}", d) for i, (_, d) in enumerate(kept))
        text = f"{head}tt.func public @KERNEL({decls}) attributes{body}"
        # Constants are hoisted to the function's entry in the order the inliner met them: name each by its value
        # and list them sorted, so that order (which computes nothing) does not count.
        consts = dict(re.findall(r"^(%\w+) = (arith\.constant .*)$", text, flags=re.M))
        names = {k: "%const_" + hashlib.sha256(v.encode()).hexdigest()[:10] for k, v in consts.items()}
        lines = [ln for ln in text.split("\n") if not re.match(r"^%\w+ = arith\.constant ", ln)]
        text = "\n".join(sorted(f"{names[k]} = {v}" for k, v in consts.items()) + lines)
        text = re.sub(r"%\w+", lambda m: names.get(m.group(0), m.group(0)), text)
        # Block arguments (loop-carried values, reduction operands) are numbered after the function's arguments,
        # unused ones included: number them by first appearance instead.
        blk: dict = {}
        text = re.sub(r"%arg\d+\b", lambda m: blk.setdefault(m.group(0), f"%blk_{len(blk)}"), text)
    return text


def _record(tree: str, quick: bool):
    """Run the public Triton `core` (forward and backward) and the fused preps on CPU tensors with every kernel
    launch recorded instead of run: [(label, JITFunction, args, kwargs)]. `core` picks the families, chunk caps and
    flags exactly as on the GPU (Falcon-3's expansion, Falcon-3A's W scans, ...)."""
    sys.path.insert(0, tree)
    import torch
    from triton.runtime.jit import JITFunction

    records, label = [], [""]

    def fake_run(self, *args, grid, warmup, **kwargs):
        records.append((label[0], self, args, kwargs))

    JITFunction.run = fake_run
    import falcon_lab.kernels.triton as ft

    if not os.path.abspath(ft.__file__).startswith(os.path.abspath(tree) + os.sep):
        raise SystemExit(f"imported {ft.__file__}, not the tree {tree}")

    ft._INTERPRET = True  # lets `core` take CPU tensors; the kernels are JITFunctions (TRITON_INTERPRET unset)
    ft.interpreter_active = lambda: True  # the same for older trees, which read the environment at each call
    ft._UNPROVEN = True   # every kernel that exists, proven or not
    # The dot precision as on the GPU: `_prec` gives CPU tensors "ieee" (the interpreter's), the GPU tf32x3 for fp32
    # (and, since c69b041, "ieee" where K or V <= 16). Until 2026-12-02 (eighth session) the recorder let the CPU
    # answer, so every fp32 build was fingerprinted at "ieee", not as the H200 compiled it.
    for sub in ("common", "chunk", "percol", "percol_delta", "window_linear", "decode", "prep", "prep_window"):
        try:
            importlib.import_module(f"falcon_lab.kernels.triton.{sub}")
        except ImportError:  # an older tree without it
            pass
    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("falcon_lab.kernels.triton") and m]:
        orig = getattr(mod, "_prec", None)
        if orig is not None and not getattr(orig, "_as_gpu", False):
            def as_gpu(dtype, allow_tf32, device, *rest, _orig=orig):
                return _orig(dtype, allow_tf32, torch.device("cuda"), *rest)
            as_gpu._as_gpu = True
            mod._prec = as_gpu
    T, B, H = 100, 1, 2
    dts = {"bf16": torch.bfloat16, "fp32": torch.float32}
    Ks = (16, 128) if quick else (16, 64, 128)
    Cs = (16, 64) if quick else (16, 32, 64)
    # (name, delta, per_column, window, fused_window: None = the default path)
    variants = [("1", 1, 0, 1, None), ("1A", 0, 0, 1, None), ("2", 1, 1, 1, None), ("2A", 0, 1, 1, None),
                ("3", 1, 0, 4, None), ("3A-scans", 0, 0, 4, False), ("3A-banded", 0, 0, 4, True)]
    if hasattr(ft, "_FALCON_3"):  # Falcon-3 with its pseudo-tokens read in place (since 2026-12-02)
        variants.append(("3-gather", 1, 0, 4, True))
    import falcon_lab.kernels.triton.percol as kpercol

    if hasattr(kpercol, "INTRA"):  # Falcon-2A / -2 intra-chunk term by 16-row sub-blocks (since 2026-12-02)
        variants += [("2A-blocked", 0, 1, 1, "blocked"), ("2-blocked", 1, 1, 1, "blocked")]
    if hasattr(kpercol, "BWD_INTRA"):  # ... its backward intra pass in one kernel (since 2026-12-04)
        variants += [("2A-blocked-fused", 0, 1, 1, "blocked-fused"), ("2-blocked-fused", 1, 1, 1, "blocked-fused")]
    try:  # the linear state passes split along the sequence (since 2026-12-04): pieces of one chunk here
        import falcon_lab.kernels.triton.state_split as ksplit_seq
        variants += [("1A-split", 0, 0, 1, "split"), ("3A-delayed-split", 0, 0, 4, "split"), ("2A-split", 0, 1, 1, "split")]
    except ImportError:
        ksplit_seq = None
    try:  # the delta rule's passes split along the sequence (since 2026-12-05): pieces of one chunk, T = 128
        import falcon_lab.kernels.triton.delta_split as kdsplit
        variants += [("1-dsplit", 1, 0, 1, "dsplit"), ("3-gather-dsplit", 1, 0, 4, "dsplit")]
    except ImportError:
        kdsplit = None
    if "cu_seqlens" in inspect.signature(ft.core).parameters:  # packed sequences in the kernels (since 2026-12-02)
        variants += [(f"{v}-varlen", d, pc, w, "varlen") for v, d, pc, w in (("1", 1, 0, 1), ("1A", 0, 0, 1),
                                                                             ("2", 1, 1, 1), ("2A", 0, 1, 1),
                                                                             ("3A", 0, 0, 4), ("3", 1, 0, 4))]
    skipped = set()
    for dn, dt in dts.items():
        for K in Ks:
            V = K
            for name, delta, pc, W, fused in variants:
                for ra in (True, False):
                    def inputs(T):
                        q = torch.randn(B, T, H, K, dtype=dt, requires_grad=True)
                        XR = T + (W - 1) * (2 if fused == "varlen" and T > 1 else 1)  # packed: 2 sequences' tails
                        xw = torch.randn(B, XR, H, K, dtype=dt, requires_grad=True)
                        vw = torch.randn(B, XR, H, V, dtype=dt, requires_grad=True)
                        shape = (B, T, H, V) if pc else (B, T, H)
                        eta = torch.rand(shape, requires_grad=True)
                        g = (-torch.rand(shape)).requires_grad_()
                        S0 = torch.randn(2 if fused == "varlen" else B, H, K, V, requires_grad=True)
                        return q, xw, vw, eta, g, S0
                    kw = dict(delta=bool(delta), window=W, read_after=ra)
                    if hasattr(kpercol, "INTRA"):
                        kpercol.INTRA = "blocked" if fused in ("blocked", "blocked-fused", "split") else "exact"
                    if hasattr(kpercol, "BWD_INTRA"):
                        kpercol.BWD_INTRA = "fused" if fused == "blocked-fused" else "split"
                    if ksplit_seq is not None:
                        ksplit_seq.LINEAR_SPLIT, ksplit_seq.SPLIT_LEN = ("on", 1) if fused == "split" else ("off", 32)
                    if kdsplit is not None:
                        kdsplit.DELTA_SPLIT, kdsplit.DELTA_SPLIT_LEN = ("on", 1) if fused == "dsplit" else ("off", 32)
                    if fused in ("blocked", "blocked-fused", "split", "dsplit"):
                        pass
                    elif fused == "varlen":  # two packed sequences of 37 and 63 tokens (B = 1)
                        kw["cu_seqlens"] = torch.tensor([0, 37, T])
                    elif fused and "fused_window" not in inspect.signature(ft.core).parameters:
                        continue  # an older tree: no banded kernel (its Falcon-3A is the W scans)
                    elif fused is not None and "fused_window" in inspect.signature(ft.core).parameters:
                        kw["fused_window"] = fused
                    try:
                        for C in Cs:
                            label[0] = f"{name} {dn} K={K} C={C} read_after={int(ra)}"
                            ins = inputs(128 if fused == "dsplit" else T)  # whole pieces of whole chunks
                            o, s = ft.core(*ins, chunk_size=C, **kw)
                            torch.autograd.grad(o.float().sum() + s.sum(), ins)
                        if "cu_seqlens" in kw:
                            continue
                        label[0] = f"{name} decode {dn} K={K} read_after={int(ra)}"
                        with torch.no_grad():
                            ft.core(*inputs(1), chunk_size=64, **kw)
                    except (NotImplementedError, TypeError) as e:  # an older tree without this kernel
                        if name not in skipped:
                            print(f"skipped Falcon-{name}: {e}")
                        skipped.add(name)
    _record_prep(records, label, dts, quick)
    try:  # Falcon-3's μ_t squarings in one kernel (since 2026-12-03)
        from falcon_lab.kernels.triton import eig
    except ImportError:
        eig = None
    if eig is not None:
        for W in (2, 4, 8, 16):
            label[0] = f"eig W={W}"
            eig.top_eigvec(torch.randn(50, W, W))
    return records


def _prep_apply(module, *args):
    """A fused prep's forward on `module`'s autograd.Function (prep._FusedPrep: k, beta, lam, last_k, seen, valid, cfg[,
    seq, cu]; prep_window._FusedWindowPrep: k, beta, lam, last_k, tail_x, seen, valid, cfg) or, in a tree since
    2026-12-05, the same arguments through prep_ops.prep_core (cfg padded to its seven fields)."""
    for name in ("_FusedPrep", "_FusedWindowPrep"):
        if hasattr(module, name):
            return getattr(module, name).apply(*args)
    from falcon_lab.kernels.triton.prep_ops import prep_core

    if module.__name__.endswith("prep_window"):
        k, beta, lam, lk, tx, seen, valid, cfg = args
        return prep_core(k, beta, lam, lk, tx, seen, valid, None, None, cfg)
    k, beta, lam, lk, seen, valid, cfg, *packed = args
    seq, cu = packed if packed else (None, None)
    return prep_core(k, beta, lam, lk, None, seen, valid, seq, cu, tuple(cfg) + (1, False))


def _record_prep(records, label, dts, quick):
    import torch

    try:
        from falcon_lab.kernels.triton import prep
    except ImportError:  # an older tree without the fused prep
        print("skipped the fused preps")
        return
    B, T, H, K = 1, 100, 2, 64
    packed = "cu_seqlens" in inspect.signature(prep.fused_prepare).parameters
    has_window = True
    try:
        from falcon_lab.kernels.triton import prep_window
    except ImportError:
        has_window = False
    for dn, dt in dts.items():
        for per_col in (0, 1):
            for shift, nlms, scaled, last, valid in ((1, 1, 1, 1, 1), (1, 1, 0, 0, 0), (0, 0, 1, 0, 0)):
                V = K
                k = torch.randn(B, T, H, K, dtype=dt, requires_grad=True)
                beta = torch.rand(B, T, H, V if per_col else 1, dtype=dt).squeeze(-1).requires_grad_()
                lam = torch.rand(B, T, H, dtype=dt, requires_grad=True)
                lk = torch.randn(B, H, K, dtype=dt, requires_grad=True) if last else None
                seen = torch.ones(B, dtype=torch.int64)
                vmask = torch.ones(B, T, dtype=torch.int8) if valid else None
                cfg = (bool(shift), bool(nlms), bool(scaled), 1e-6, 1e-4)
                base = f"prep[per_col={per_col},shift={shift},nlms={nlms},scaled={scaled},last={last}," \
                       f"valid={valid}] {dn}"
                label[0] = base
                x, eta, g, stat = _prep_apply(prep, k, beta, lam, lk, seen, vmask, cfg)
                torch.autograd.grad((x.float().sum() + eta.float().sum() + g.float().sum()),
                                    [t for t in (k, beta, lam, lk) if t is not None], allow_unused=True)
                if packed:  # two packed sequences of 37 and 63 tokens (since 2026-12-02)
                    lk2 = torch.randn(2, H, K, dtype=dt, requires_grad=True) if last else None
                    seq = torch.tensor([0] * 37 + [1] * (T - 37), dtype=torch.int32)
                    cu = torch.tensor([0, 37, T], dtype=torch.int32)
                    label[0] = base.replace("prep[", "prep-packed[")
                    x, eta, g, stat = _prep_apply(prep, k, beta, lam, lk2, torch.ones(2, dtype=torch.int64), None,
                                                  cfg, seq, cu)
                    torch.autograd.grad((x.float().sum() + eta.float().sum() + g.float().sum()),
                                        [t for t in (k, beta, lam, lk2) if t is not None], allow_unused=True)
                if has_window and not per_col:
                    W = 4
                    tx = torch.randn(B, W - 1, H, K, dtype=dt, requires_grad=True) if last else None
                    # cfg ends (W,) before 2026-12-03, (W, eig) since: Falcon-3A, then Falcon-3's fused prep
                    eig_flag = "eig" in inspect.signature(prep_window.fused_window_prepare).parameters
                    for eig in ((False, True) if eig_flag else (None,)):
                        label[0] = base.replace("prep[", "prep_window[W=4," + ("eig," if eig else ""))
                        wcfg = cfg + ((W,) if eig is None else (W, eig))
                        xw, eta, g, stat = _prep_apply(prep_window, k, beta, lam, lk, tx, seen, vmask, wcfg)
                        torch.autograd.grad((xw.float().sum() + eta.float().sum() + g.float().sum()),
                                            [t for t in (k, beta, lam, lk, tx) if t is not None], allow_unused=True)
                        if eig and hasattr(prep_window, "GATES"):  # the gates from the statistic (since 2026-12-05)
                            gates_default = prep_window.GATES
                            prep_window.GATES = "recompute" if gates_default == "stat" else "stat"
                            label[0] += f" gates={prep_window.GATES}"
                            xw, eta, g, stat = _prep_apply(prep_window, k, beta, lam, lk, tx, seen, vmask, wcfg)
                            torch.autograd.grad((xw.float().sum() + eta.float().sum() + g.float().sum()),
                                                [t for t in (k, beta, lam, lk, tx) if t is not None],
                                                allow_unused=True)
                            prep_window.GATES = gates_default


def _compile_all(records):
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    def stop_at_ptx(*args):
        if not args:  # Triton >= 3.7 also asks the hook for a cache key
            return f"falcon_lab-fingerprint-{STAGE}", f"falcon_lab-fingerprint-{STAGE}"
        stages = args[1]

        def stop(src, metadata):
            raise _Ptx(str(src))
        stages["cubin" if STAGE == "ptx" else "ttgir"] = stop

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binders, done, out = {}, {}, {}
    t0 = time.time()
    for i, (label, fn, args, kwargs) in enumerate(records):
        kw = dict(kwargs)
        kw["debug"] = False
        kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        if fn not in binders:
            binders[fn] = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, opts = binders[fn](*args, **kw)
        key = (fn.fn.__name__, str(spec), str(opts))
        if key not in done and STAGE == "cubin":  # the whole compile, then ptxas' resource use
            options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, opts)
            knobs.runtime.add_stages_inspection_hook = None
            k = compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
            done[key] = _resources(k)
        elif key not in done:
            options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, opts)
            knobs.runtime.add_stages_inspection_hook = stop_at_ptx
            try:
                compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
                raise RuntimeError("the cubin stage did not run")
            except _Ptx as e:
                text = _normalise(e.args[0], fn.fn.__name__)
                done[key] = hashlib.sha256(text.encode()).hexdigest()[:16]
                if DUMP:  # the normalised text, to diff two trees' builds of one kernel
                    os.makedirs(DUMP, exist_ok=True)
                    Path(DUMP, f"{fn.fn.__name__}-{done[key]}.{STAGE}").write_text(text)
        out[f"{fn.fn.__name__} {label}"] = done[key]
        if (i + 1) % 50 == 0:
            print(f"  {i + 1}/{len(records)} launches, {len(done)} builds, {time.time() - t0:.0f} s", flush=True)
    return out, len(done)


def _resources(k) -> str:
    """What ptxas made of a compiled kernel (--stage cubin): registers and stack bytes per thread (a stack means
    spills), shared memory per program, warps, and how many of its dots became Hopper wgmma."""
    import tempfile

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        use = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    line = next((ln for ln in use.splitlines() if "REG:" in ln), "")
    reg = re.search(r"REG:(\d+)", line)
    stack = re.search(r"STACK:(\d+)", line)
    return (f"regs {reg.group(1) if reg else '?'} stack {stack.group(1) if stack else '?'} B shared "
            f"{k.metadata.shared} B warps {k.metadata.num_warps} wgmma {k.asm['ptx'].count('wgmma.mma_async')}")


def _compare(a_path, b_path):
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    fa, fb = a["fingerprints"], b["fingerprints"]
    print(f"A: {a['tree_commit']} (triton {a['triton']})\nB: {b['tree_commit']} (triton {b['triton']})")
    kernels = sorted({k.split(" ", 1)[0] for k in list(fa) + list(fb)})
    rc = 0
    for kern in kernels:
        ka = {k: v for k, v in fa.items() if k.split(" ", 1)[0] == kern}
        kb = {k: v for k, v in fb.items() if k.split(" ", 1)[0] == kern}
        common = set(ka) & set(kb)
        diff = sorted(k for k in common if ka[k] != kb[k])
        only = len(set(ka) ^ set(kb))
        state = "same" if not diff else f"DIFFERENT in {len(diff)} of {len(common)} builds"
        if diff or only:
            rc = 1
        print(f"{kern:24s} {state}" + (f"; {only} builds in one tree only" if only else ""))
        for k in diff[:3]:
            print(f"    e.g. {k.split(' ', 1)[1]}")
    return rc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    help="the falcon_lab checkout whose kernels to fingerprint (default: this one)")
    ap.add_argument("--out", help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help="K in (16, 128), C in (16, 64) only")
    ap.add_argument("--only", help="a regular expression: fingerprint the kernels whose names match it")
    ap.add_argument("--stage", choices=("ttir", "ptx", "cubin"), default="ttir",
                    help="hash the Triton IR after its inlining and canonicalisation (fast; the later stages are a "
                         "function of it, the options and the target) or the PTX (slow, ~1.5 s a build on 2 cores); "
                         "cubin: compile each build whole and record ptxas' registers, stack (spills), shared "
                         "memory and wgmma count instead of a hash (slower still)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two fingerprint files")
    ap.add_argument("--dump", metavar="DIR", help="also write each build's normalised text to DIR (to diff two trees)")
    a = ap.parse_args()
    if a.compare:
        sys.exit(_compare(*a.compare))
    import triton

    global STAGE, DUMP
    STAGE, DUMP = a.stage, a.dump
    if STAGE == "cubin":  # whole compiles go to a cache of their own: Triton 3.6 would serve them to a later
        # --stage ttir / ptx run, whose stop-early hook is not in its cache key, and that run would see no stage at all
        import tempfile
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="falcon_cubin_cache_")
    tree = os.path.abspath(a.tree)
    commit = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "falcon_lab"], capture_output=True,
                           text=True).stdout.strip()
    t0 = time.time()
    records = _record(tree, a.quick)
    if a.only:
        records = [r for r in records if re.search(a.only, r[1].fn.__name__)]
    print(f"triton {triton.__version__}, tree {commit}{' (modified)' if dirty else ''}: {len(records)} launches")
    fps, n = _compile_all(records)
    res = {"triton": triton.__version__, "target": "cuda sm_90", "stage": STAGE, "tree_commit": commit + ("+" if dirty else ""),
           "quick": a.quick, "builds": n, "seconds": round(time.time() - t0), "fingerprints": fps}
    print(f"{n} distinct builds in {res['seconds']} s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
