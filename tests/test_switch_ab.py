"""experiments/h200/switch_ab.py's CPU-side logic: the switch argument, the interleaving, the medians and ratios it
reports (the timing itself needs the GPU)."""
import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "experiments" / "h200" / "switch_ab.py"


def _tool():
    spec = importlib.util.spec_from_file_location("switch_ab", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parse_switch():
    t = _tool()
    assert t.parse_switch("chunk.BWD_MAIN=split,rowsum") == ("chunk", "BWD_MAIN", ["split", "rowsum"])
    for bad in ("chunk.BWD_MAIN=split", "BWD_MAIN=split,rowsum", "chunk.BWD_MAIN", "chunk.BWD_MAIN=a,a"):
        with pytest.raises(SystemExit, match="MODULE.ATTR=v1,v2"):
            t.parse_switch(bad)


def test_rounds_alternate_the_order():
    t = _tool()
    assert [t.round_order(["a", "b", "c"], r) for r in range(3)] == [["a", "b", "c"], ["c", "b", "a"],
                                                                     ["a", "b", "c"]]


def test_summary_medians_and_ratio():
    t = _tool()
    rows = []
    for r, (ga, gb) in enumerate([(1.0, 0.5), (3.0, 0.7), (2.0, 0.6)]):
        for v, gms in (("split", ga), ("rowsum", gb)):
            rows.append(dict(op="falcon-1A", shape=[16, 2048, 6, 128], value=v, round=r, gpu_ms=gms,
                             bench_ms=gms + 1, host_ms=1.5, peak_mb=100.0 + (v == "split")))
    rows.append(dict(op="falcon-1", shape=[1, 32768, 6, 128], value="rowsum", round=0, gpu_ms=2.0, bench_ms=2.5,
                     host_ms=1.0, peak_mb=50.0))
    s = t.summarize(rows, ["split", "rowsum"])
    assert [(x["op"], x["value"]) for x in s] == [("falcon-1A", "split"), ("falcon-1A", "rowsum"),
                                                  ("falcon-1", "rowsum")]
    a, b, c = s
    assert (a["gpu_ms"], a["gpu_ms_spread"], a["rounds"], a["gpu_vs_first"]) == (2.0, [1.0, 3.0], 3, 1.0)
    assert (b["gpu_ms"], b["bench_ms"], b["peak_mb"], b["gpu_vs_first"]) == (0.6, 1.6, 100.0, 0.3)
    assert c["gpu_vs_first"] is None  # no first-value row at that shape: no ratio
    md = t.to_markdown(s, dict(switch="chunk.BWD_MAIN=split,rowsum", gpu="G", torch="T", triton="3.6.0",
                               commit="abc", reps=3))
    assert "| falcon-1A | 16×2048×6×128 | rowsum | 0.6 | 0.5–0.7 | 0.3 | 1.6 | 1.5 | 100.0 |" in md
    assert "commit abc" in md


def test_the_switches_it_names_exist():
    """Every switch the tool's docstring lists is a module attribute it can set (a removed switch, such as chunk.py's
    BWD_MAIN of 2026-12-03, must leave the list with its code); 'triton' names the package itself."""
    import importlib
    import re

    t = _tool()
    mods = "chunk|common|window_linear|percol|percol_delta|triton"
    named = re.findall(rf"(?<![\w.])({mods})\.(_?[A-Z][A-Z0-9_]+)\b", t.__doc__)
    assert ("triton", "_FALCON_3") in named and ("chunk", "A_DTYPE") in named
    for module, attr in named:
        assert hasattr(importlib.import_module(t.module_path(module)), attr), (module, attr)
