"""experiments/h200/switch_ab.py's CPU-side logic: the switch argument, the interleaving, the medians and ratios it
reports (the timing itself needs the GPU)."""

import pytest

from script_helpers import load_script


def _tool():
    return load_script("experiments/h200/switch_ab.py")


def test_parse_switch():
    t = _tool()
    assert t.parse_switch("chunk.BWD_MAIN=split,rowsum") == ("chunk", "BWD_MAIN", ["split", "rowsum"])
    for bad in ("chunk.BWD_MAIN=split", "BWD_MAIN=split,rowsum", "chunk.BWD_MAIN", "chunk.BWD_MAIN=a,a"):
        with pytest.raises(SystemExit, match="MODULE.ATTR=v1,v2"):
            t.parse_switch(bad)


def test_values_take_the_type_of_the_attribute_they_replace():
    """switch_ab.py sets module attributes: a value for an int or bool attribute is converted (the string '16' in an
    int switch broke an A/B on the H200, 2026-12-04), strings stay strings, and a bad value fails before any timing."""
    t = _tool()
    assert t.typed_value("16", "32") == "32" and t.typed_value(16, "32") == 32
    assert t.typed_value(True, "0") is False and t.typed_value(False, "true") is True
    assert t.typed_value(16, "default") == "default"
    with pytest.raises(SystemExit, match="not an integer"):
        t.typed_value(16, "wide", "percol_delta.X")
    with pytest.raises(SystemExit, match="environment variable"):
        t.typed_value((4, 0, 2, False), "4,0", "percol_delta.BLK_BWD")


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


def test_several_switches_time_every_combination():
    t = _tool()
    sw = [t.parse_switch("common.STATE_BV=auto,32"), t.parse_switch("common.STATE_WARPS=default,2,8")]
    combos = t.combinations(sw)
    assert [label for label, _ in combos] == [
        "STATE_BV=auto;STATE_WARPS=default", "STATE_BV=auto;STATE_WARPS=2", "STATE_BV=auto;STATE_WARPS=8",
        "STATE_BV=32;STATE_WARPS=default", "STATE_BV=32;STATE_WARPS=2", "STATE_BV=32;STATE_WARPS=8"]
    assert combos[4][1] == [("common", "STATE_BV", "32"), ("common", "STATE_WARPS", "2")]
    assert [label for label, _ in t.combinations(sw[:1])] == ["auto", "32"]  # one switch: its plain values
    with pytest.raises(SystemExit, match="distinct values"):
        t.parse_switch("common.STATE_WARPS=,2")  # an empty value: 'default' names the import-time one


def test_selected_kernels_time():
    t = _tool()
    km = {"_fwd_state": 0.5, "_bwd_state": 0.75, "_bwd_cc": 0.25}
    assert t.selected_ms(km, "_fwd_state|_bwd_state") == 1.25
    assert t.selected_ms(km, "nothing") == 0 and t.selected_ms(km, None) is None
    rows = [dict(op="falcon-1", shape=[1, 32768, 6, 128], value=v, round=r, gpu_ms=g, bench_ms=g, host_ms=1.0,
                 peak_mb=10.0, sel_ms=g / 2) for r in range(2) for v, g in (("a", 2.0), ("b", 1.0))]
    s = t.summarize(rows, ["a", "b"])
    assert [x["sel_ms"] for x in s] == [1.0, 0.5]
    md = t.to_markdown(s, dict(switch="x", gpu="G", torch="T", triton="3.6.0", commit="c", reps=2, kernels="_state"))
    assert "| kernels /_state/ ms |" in md and "| falcon-1 | 1×32768×6×128 | b | 1.0 | 1.0–1.0 | 0.5 | 0.5 |" in md
