"""A/B of kernel switches inside one process: the same op, shape and inputs timed with each value of a module-level
switch (or each combination of several), interleaved, so that process-to-process spread (which made Falcon-1A's
rowsum-vs-split comparison of 2026-12-03 inconclusive: kernels_2026-12-03e) does not enter the comparison. One GPU,
alone.

    python3 experiments/h200/switch_ab.py --switch chunk.A_DTYPE=input,fp32 --ops falcon-1,falcon-3 \
        --shapes 0,1,2,3 --reps 3 --out $OUT/switch_ab
    python3 experiments/h200/switch_ab.py --switch common.STATE_BV=auto,32,64 --switch common.STATE_WARPS=default,2,8 \
        --ops falcon-1 --shapes 1 --kernels '_fwd_state|_bwd_state' --reps 2 --out $OUT/state_launch

`--switch MODULE.ATTR=v1,v2[,...]`: an attribute of `falcon_lab.kernels.triton.MODULE` read at call time (the kernels'
switches are: chunk.A_DTYPE, common.STATE_BV, window_linear.WL_BWD_BV, percol.INTRA, percol.FWD_GRID, percol.ROWS_BV,
percol_delta.SOLVE, percol_delta.BWD_SOLVE, common.STATE_STAGES, common.STATE_WARPS, and the package's own as
triton._FALCON_3, triton._FALCON_3A); values are strings as the environment variable takes them, `default` the
attribute's value at import. Several `--switch` arguments time every combination of their values (a value is then
labelled `ATTR=v;ATTR2=w`). For each shape and op, `--reps` rounds; each round times every value once, in an order that
alternates between rounds. Per (op, shape, value):
the medians over rounds of `gpu_ms` (the kernels' summed device time per forward+backward, torch.profiler: what a
kernel choice changes), `bench_ms` (do_bench's median, as `bench kernels`), `host_ms`, and the peak; then each value's
gpu_ms against the first value's; with `--kernels REGEX`, `sel_ms`, the device time of the kernels whose names match
(e.g. the state passes alone). Output: OUT/switch_ab.json and .md with GPU, versions and commit.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

SHAPES = [(16, 2048, 12, 64), (1, 32768, 6, 128), (4, 8192, 12, 64), (16, 2048, 6, 128)]  # bench kernels' order


def parse_switch(text: str):
    """'chunk.A_DTYPE=input,fp32' -> ('chunk', 'A_DTYPE', ['input', 'fp32'])."""
    try:
        target, values = text.split("=", 1)
        module, attr = target.rsplit(".", 1)
        vals = values.split(",")
        assert all(vals)
        assert module and attr and len(vals) >= 2 and len(set(vals)) == len(vals)
    except (ValueError, AssertionError):
        raise SystemExit(f"--switch must be MODULE.ATTR=v1,v2[,...] with distinct values, none empty ('default' "
                         f"is the value at import), got {text!r}") from None
    return module, attr, vals


def typed_value(default, text: str, name: str = "switch"):
    """A switch value from the command line as the type of the attribute it replaces (ours): most switches are
    strings (what env_choice returns), but a module attribute read as an int or a bool would take the string '16'
    as a different value and fail inside a kernel launch (2026-12-04: a switch read as an int broke a whole A/B);
    'default' stays as it is (the attribute's own value). A type it cannot set from text fails at start-up."""
    if text == "default" or isinstance(default, str):
        return text
    if isinstance(default, bool):
        if text not in ("0", "1", "True", "False", "true", "false"):
            raise SystemExit(f"{name}: {text!r} is not a boolean (0/1, true/false)")
        return text in ("1", "True", "true")
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise SystemExit(f"{name}: {text!r} is not an integer") from None
    raise SystemExit(f"{name} is a {type(default).__name__}: set it through its environment variable (AB_ENV), not "
                     "--switch")


def module_path(module: str) -> str:
    """'chunk' -> falcon_lab.kernels.triton.chunk; 'triton' -> the package itself (its switches: _FALCON_3, _FALCON_3A,
    _PREP, _VARLEN, read at call time by `core`)."""
    return "falcon_lab.kernels.triton" + ("" if module == "triton" else f".{module}")


def combinations(switches: list) -> list:
    """[(module, attr, values), ...] -> [(label, [(module, attr, value), ...]), ...]: every combination, the first
    switch varying slowest; one switch keeps its plain values as labels."""
    import itertools

    combos = []
    for vals in itertools.product(*(sw[2] for sw in switches)):
        setting = [(m, a, v) for (m, a, _), v in zip(switches, vals)]
        label = vals[0] if len(switches) == 1 else ";".join(f"{a}={v}" for _, a, v in setting)
        combos.append((label, setting))
    return combos


def selected_ms(kernel_ms: dict, pattern: str | None):
    """The summed device time of the kernels whose names match `pattern` (re.search), or None without one."""
    import re

    if not pattern:
        return None
    return round(sum(ms for name, ms in kernel_ms.items() if re.search(pattern, name)), 4)


def round_order(values: list, r: int) -> list:
    """The order of the values in round r: as given in even rounds, reversed in odd ones."""
    return list(values) if r % 2 == 0 else list(reversed(values))


def summarize(rows: list, values: list) -> list:
    """rows: dicts with op, shape, value, gpu_ms, bench_ms, host_ms, peak_mb (one per round) -> one dict per
    (op, shape, value) with the medians over rounds, the round count and gpu_ms / gpu_ms of values[0]."""
    out = []
    keys = []
    for r in rows:
        k = (r["op"], tuple(r["shape"]))
        if k not in keys:
            keys.append(k)
    for op, shape in keys:
        med = {}
        for v in values:
            sel = [r for r in rows if r["op"] == op and tuple(r["shape"]) == shape and r["value"] == v]
            if not sel:
                continue
            med[v] = dict(op=op, shape=list(shape), value=v, rounds=len(sel),
                          **{m: round(statistics.median(r[m] for r in sel), 4)
                             for m in ("gpu_ms", "bench_ms", "host_ms", "peak_mb", "sel_ms")
                             if all(r.get(m) is not None for r in sel)},
                          gpu_ms_spread=[round(min(r["gpu_ms"] for r in sel), 4),
                                         round(max(r["gpu_ms"] for r in sel), 4)])
        base = med.get(values[0])
        for v in values:
            if v in med:
                med[v]["gpu_vs_first"] = round(med[v]["gpu_ms"] / base["gpu_ms"], 3) if base else None
                out.append(med[v])
    return out


def to_markdown(summary: list, meta: dict) -> str:
    sel = meta.get("kernels")
    head = (f"Switch {meta['switch']} — {meta['gpu']}, torch {meta['torch']}, Triton {meta['triton']}, commit "
            f"{meta['commit']}, {meta['reps']} interleaved rounds per value (medians; fwd+bwd, bf16)\n\n"
            "| op | B×T×H×K | value | gpu ms | gpu ms min–max | vs first value | "
            + (f"kernels /{sel}/ ms | " if sel else "") + "bench ms | host ms | peak MB |\n"
            + "|---" * (10 if sel else 9) + "|\n")
    lines = [f"| {s['op']} | {'×'.join(map(str, s['shape']))} | {s['value']} | {s['gpu_ms']} | "
             f"{s['gpu_ms_spread'][0]}–{s['gpu_ms_spread'][1]} | {s['gpu_vs_first']} | "
             + (f"{s.get('sel_ms')} | " if sel else "") + f"{s['bench_ms']} | {s['host_ms']} | {s['peak_mb']} |"
             for s in summary]
    return head + "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--switch", required=True, action="append", help="MODULE.ATTR=v1,v2[,...]; several: combinations")
    ap.add_argument("--ops", default="falcon-1,falcon-1A")
    ap.add_argument("--shapes", default="0,1,2,3", help="indices into bench kernels' four shapes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kernels", default=None, help="a regular expression: also report these kernels' device time")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    switches = [parse_switch(t) for t in a.switch]
    combos = combinations(switches)
    values = [label for label, _ in combos]
    import torch
    import triton

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from host_bound import measure  # noqa: E402 (this folder's scripts are not a package)

    from falcon_lab.benchmarking.kernels import _commit

    mods, defaults = {}, {}
    for module, attr, _ in switches:
        mod = mods.setdefault(module, importlib.import_module(module_path(module)))
        if not hasattr(mod, attr):
            raise SystemExit(f"{module_path(module)} has no attribute {attr!r}")
        defaults[(module, attr)] = getattr(mod, attr)
    # every value as its attribute's type, checked before any timing
    typed = {(m, k, v): typed_value(defaults[(m, k)], v, f"{m}.{k}") for m, k, vals in switches for v in vals}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(switch=" ".join(a.switch), default={f"{m}.{k}": str(v) for (m, k), v in defaults.items()},
                kernels=a.kernels, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, commit=_commit(), reps=a.reps)
    rows = []
    try:
        for si in (int(s) for s in a.shapes.split(",")):
            shape = SHAPES[si]
            for op in a.ops.split(","):
                for r in range(a.reps):
                    for label, setting in round_order(combos, r):
                        for module, attr, v in setting:
                            setattr(mods[module], attr,
                                    defaults[(module, attr)] if v == "default" else typed[(module, attr, v)])
                        m = measure(op, shape)
                        m["sel_ms"] = selected_ms(m.get("kernel_ms", {}), a.kernels)
                        rows.append(dict(op=op, shape=list(shape), value=label, round=r, **m))
                        print(f"{op:12s} {shape} {label:24s} round {r}: gpu {m['gpu_ms']} ms, bench "
                              f"{m['bench_ms']} ms, host {m['host_ms']} ms"
                              + (f", /{a.kernels}/ {m['sel_ms']} ms" if a.kernels else ""), flush=True)
    finally:
        for (module, attr), v in defaults.items():
            setattr(mods[module], attr, v)
        summary = summarize(rows, values)
        (out / "switch_ab.json").write_text(json.dumps(dict(meta=meta, rows=rows, summary=summary), indent=1))
        (out / "switch_ab.md").write_text(to_markdown(summary, meta))
    print(to_markdown(summary, meta))


if __name__ == "__main__":
    main()
