"""Where a training step's GPU time goes: one step under torch.profiler, its CUDA kernel time split
into the Falcon op (the Triton chunk kernels), the fused layer modules, matrix products, the loss, and
the rest (elementwise glue: norms, gates, prep, casts, optimizer).

Attribution (ours): a kernel counts for the loss when it runs inside the `lm_loss` range (the chunked
loss forms its gradients there too; the materialized loss's backward kernels fall outside it and count
as matmul / glue); otherwise by kernel name: the names of falcon_lab's own Triton kernels, then matrix
product libraries (cuBLAS / CUTLASS / nvjet names).
"""
from __future__ import annotations

import re

import torch

CATEGORIES = ("falcon_op", "modules", "matmul", "loss", "other")
TOP_KERNELS = 25  # kernels listed per profiled step (by total CUDA time, name cut to 96 characters)
_MATMUL = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm90_|wgmma|splitk", re.I)


def _triton_names(*modules) -> set[str]:
    names = set()
    for mod in modules:
        for k, v in vars(mod).items():
            if type(v).__name__ in ("JITFunction", "Autotuner", "Heuristics"):
                names.add(k)
    return names


def kernel_names() -> dict[str, set[str]]:
    from falcon_lab.kernels.triton import chunk, decode, percol, percol_delta

    out = {"falcon_op": _triton_names(chunk, decode, percol, percol_delta), "modules": set()}
    try:
        from falcon_lab.modules import conv, norm

        out["modules"] = _triton_names(conv, norm)
    except ImportError:  # pragma: no cover
        pass
    return out


def classify(name: str, known: dict[str, set[str]]) -> str:
    base = name.split("(")[0].strip()
    for cat in ("falcon_op", "modules"):
        if base in known[cat]:
            return cat
    if _MATMUL.search(name):
        return "matmul"
    return "other"


def profile_step(step_fn, device) -> dict:
    """Run step_fn() once under the profiler; {"<category>_ms": ..., "total_ms": ..., "<category>_share": ...,
    "top_kernels": [{"name", "category", "ms", "calls"}, ...]}."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        step_fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    known = kernel_names()
    ms = dict.fromkeys(CATEGORIES, 0.0)
    per_kernel: dict[tuple[str, str], list] = {}
    for e in prof.events():  # CPU-side events carry the kernels they launched (with device durations)
        kernels = getattr(e, "kernels", None) or []
        if not kernels or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        node, in_loss = e, False
        while node is not None and not in_loss:
            in_loss = node.name == "lm_loss"
            node = getattr(node, "cpu_parent", None)
        for k in kernels:
            cat = "loss" if in_loss else classify(k.name, known)
            ms[cat] += float(k.duration) / 1e3
            acc = per_kernel.setdefault((k.name[:96], cat), [0.0, 0])
            acc[0] += float(k.duration) / 1e3
            acc[1] += 1
    total = sum(ms.values())
    out = {f"{k}_ms": v for k, v in ms.items()}
    out["total_ms"] = total
    for k, v in ms.items():
        out[f"{k}_share"] = v / total if total > 0 else None
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    out["top_kernels"] = [{"name": n, "category": c, "ms": round(v[0], 4), "calls": v[1]} for (n, c), v in top]
    return out


def top_kernels_lines(prof: dict, n: int = TOP_KERNELS) -> list[str]:
    """The step's most expensive kernels, one line each (what the bench log prints after a profile)."""
    total = prof.get("total_ms") or 0.0
    return [f"    {k['ms']:8.2f} ms {100 * k['ms'] / total if total else 0:5.1f} %  x{k['calls']:<4d} "
            f"[{k['category']}] {k['name']}" for k in prof.get("top_kernels", [])[:n]]
