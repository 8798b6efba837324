"""`python -m falcon_lab.bench kernels [--profile] [--out DIR] [--ops a,b] [--quick] [--shapes 0,2] [--warm]`: the kernel
benchmark (falcon_lab/benchmarking/kernels.py; needs a CUDA GPU). `python -m falcon_lab.bench check`
runs the GPU correctness check (falcon_lab/benchmarking/gpu_check.py). `python -m falcon_lab.bench model
[--size tiny|small] [--mixers a,b] [--device cpu|cuda] [--quick] [--cuda-graphs] [--mlflow]`: whole-model
training throughput, MFU, memory, prefill and decode latency (falcon_lab/benchmarking/model.py; runs on CPU too).
`python -m falcon_lab.bench switches`: every FALCON_TRITON_* kernel switch, its value now, default, choices and what it
decides (no GPU needed)."""

from __future__ import annotations

import argparse
import sys


def switches_table() -> str:
    """The kernel switches as read at import (falcon_lab.kernels.triton.host.SWITCHES), one markdown row each; a value
    that differs from its default is in bold."""
    import importlib
    import pkgutil

    import falcon_lab.kernels.triton as kt
    from falcon_lab.kernels.triton.host import SWITCHES

    for m in pkgutil.iter_modules(kt.__path__):  # every module's switches, not only those the package imports
        importlib.import_module(f"{kt.__name__}.{m.name}")
    rows = ["| variable | value | default | choices | what it decides |", "|---|---|---|---|---|"]
    for name in sorted(SWITCHES):
        sw = SWITCHES[name]
        value = repr(sw["value"]) if sw["value"] == sw["default"] else f"**{sw['value']!r}**"
        choices = ", ".join(repr(c) for c in sw["choices"]) if sw["choices"] else "(see what)"
        rows.append(f"| `{name}` | {value} | {sw['default']!r} | {choices} | {sw['what']} |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m falcon_lab.bench", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels", help="time the six Falcon ops, fla, SDPA flash and the torch chunk form")
    k.add_argument("--profile", action="store_true", help="also write torch.profiler traces + tables")
    k.add_argument("--out", default="benchmarks/results")
    k.add_argument("--ops", default=None, help="comma-separated subset of " + ",".join(
        ["falcon-1", "falcon-2", "falcon-3", "falcon-1A", "falcon-2A", "falcon-3A", "fla_chunk_delta_rule",
         "sdpa_flash", "torch_chunk_falcon-1"]))
    k.add_argument("--quick", action="store_true", help="first shape only")
    k.add_argument("--shapes", default=None,
                   help="only these of the four shapes, by index (0-3, comma-separated; 0 is --quick's): a partial run")
    k.add_argument("--warm", action="store_true",
                   help="compile only: run each op's float64 check and one fwd+bwd per shape, time and write nothing "
                        "(parallel processes sharing TRITON_CACHE_DIR fill the cache a full run then reads)")
    c = sub.add_parser("check", help="GPU correctness check of the Triton kernels")
    c.add_argument("--out", default="benchmarks/results")
    c.add_argument("--quick", action="store_true")
    c.add_argument("--final", action="store_true")
    c.add_argument("--variants", default=None, help="comma-separated subset, e.g. 3,2A")
    c.add_argument("--rows", default=None, help="only these rows, by their number in the full list, e.g. 2-10,14")
    c.add_argument("--kinds", default=None, help="only rows of these kinds, e.g. core,varlen-native")
    sub.add_parser("switches", help="list the FALCON_TRITON_* kernel switches: value now, default, choices, what")
    from falcon_lab.benchmarking.model import add_parser as add_model_parser

    add_model_parser(sub)
    a = ap.parse_args(argv)
    if a.cmd == "switches":
        print(switches_table())
        return
    from falcon_lab import logs

    logs.setup()
    import torch

    if a.cmd == "model":
        from falcon_lab.benchmarking.model import main as model_main

        try:
            model_main(a)
        except ValueError as e:  # bad flag values: a clear message naming the flag
            sys.exit(f"python -m falcon_lab.bench model: {e}")
        return

    if not torch.cuda.is_available():
        sys.exit("falcon_lab.bench needs a CUDA GPU (the Triton kernels are checked on CPU by tests/test_triton_*.py)")
    if a.cmd == "kernels":
        from falcon_lab.benchmarking.kernels import EXTRA_OPS, OPS, SHAPES, run

        ops = a.ops.split(",") if a.ops else OPS
        bad = [o for o in ops if o not in OPS + EXTRA_OPS]
        if bad:
            sys.exit(f"--ops: unknown op(s) {bad}; choose from {OPS + EXTRA_OPS}")
        shapes = SHAPES[:1] if a.quick else SHAPES
        if a.shapes:
            idx = a.shapes.split(",")
            if not all(i.isdigit() and int(i) < len(SHAPES) for i in idx):
                sys.exit(f"--shapes: expected indices 0-{len(SHAPES) - 1}, comma-separated, got {a.shapes!r}")
            shapes = [SHAPES[int(i)] for i in idx]
        if a.warm:
            from falcon_lab.benchmarking.kernels import warm

            warm(ops=ops, shapes=shapes)
            return
        run(a.out, ops=ops, shapes=shapes, profile=a.profile)
    else:
        from falcon_lab.benchmarking.gpu_check import main as check

        sys.exit(1 if check(["--out", a.out] + (["--quick"] if a.quick else []) + (["--final"] if a.final else [])
                           + (["--variants", a.variants] if a.variants else [])
                           + (["--rows", a.rows] if a.rows else [])
                           + (["--kinds", a.kinds] if a.kinds else [])) else 0)


if __name__ == "__main__":
    main()
