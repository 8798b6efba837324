"""`bench check` (falcon_lab/benchmarking/gpu_check.py) after a row poisons the CUDA context (issue 15).

On the H200 one Falcon-2 row died with an illegal memory access and every later row of the same process
then reported the same CUDA error as its own failure. The check must stop there instead: the poisoning row
keeps its error, every later row says "not run: CUDA context poisoned by row N", the exit is non-zero. Runs
on CPU with the three row checks and the CUDA calls replaced (no kernel runs; ~1 s).
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch


class FakeAcceleratorError(RuntimeError):
    pass


FakeAcceleratorError.__name__ = "AcceleratorError"


@pytest.fixture
def check(monkeypatch):
    importlib.import_module("falcon_lab.kernels.triton")  # its kernel modules read FALCON_TRITON_POISON at import

    monkeypatch.setenv("FALCON_TRITON_POISON", "0")  # gpu_check's setdefault must not leak into other tests
    from falcon_lab.benchmarking import gpu_check

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "fake GPU")
    state = dict(calls=[], poisoned=False)

    def fake(kind, keys, extra=None):
        def f(**kw):
            state["calls"].append((kind, kw))
            if state["poisoned"]:  # what a real poisoned context does to every later call
                raise FakeAcceleratorError("CUDA error: an illegal memory access was encountered\nSearch for ...")
            err = state["raise_at"].get(len(state["calls"]))
            if err is not None:
                if "illegal memory access" in str(err):
                    state["poisoned"] = True
                raise err
            return {**{k: 1e-7 for k in keys}, **(extra or {})}
        return f

    monkeypatch.setattr(gpu_check, "check_core", fake("core", ["o", "S_T", "dq"]))
    monkeypatch.setattr(gpu_check, "check_api", fake("api", ["o", "dq"]))
    monkeypatch.setattr(gpu_check, "check_decode_graph", fake("decode", ["o_graph_decode"]))
    monkeypatch.setattr(gpu_check, "check_varlen", fake("varlen", ["o", "S_T", "dq"], {"native": 1.0, "seen": 0.0}))
    monkeypatch.setattr(gpu_check, "_cuda_usable", lambda: not state["poisoned"])
    tf32 = torch.backends.cuda.matmul.allow_tf32  # main() sets it (a process-wide flag)
    yield gpu_check, state
    torch.backends.cuda.matmul.allow_tf32 = tf32


def _run(check, tmp_path, raise_at):
    gpu_check, state = check
    state["raise_at"] = raise_at
    # variant 1 (proven: every row runs), quick: 10 core rows, 2 public-op rows, 1 decode row, 4 native-varlen rows
    n_fail = gpu_check.main(["--out", str(tmp_path), "--quick", "--variants", "1"])
    rows = json.loads((tmp_path / "triton_check_h200.json").read_text())["rows"]
    md = (tmp_path / "triton_check_h200.md").read_text()
    return n_fail, rows, md, state


def test_poisoning_row_stops_the_check(check, tmp_path):
    crash = RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")
    n_fail, rows, md, state = _run(check, tmp_path, {3: crash})
    assert len(rows) == 17 and [r["kind"] for r in rows].count("core") == 10
    assert [r["status"] for r in rows[:2]] == ["pass", "pass"]
    assert rows[2]["status"].startswith("ERROR RuntimeError: Triton Error [CUDA]: an illegal memory access")
    assert "poisoned the CUDA context" in rows[2]["status"]
    for r in rows[3:]:  # later core rows, the public-op, decode and varlen rows alike
        assert r["status"].startswith("not run: CUDA context poisoned by row 3 "), r
        assert "errors" not in r
    assert len(state["calls"]) == 3  # nothing ran on the dead context
    assert n_fail == 15
    meta = json.loads((tmp_path / "triton_check_h200.json").read_text())["meta"]
    assert meta["context_poisoned_by"].startswith("3 ")
    assert md.count("not run: CUDA context poisoned by row 3") == 14


def test_other_errors_do_not_stop_the_check(check, tmp_path):
    # out of memory and a plain Python error leave the context usable: only their own rows fail
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.\nmore")
    n_fail, rows, md, state = _run(check, tmp_path, {1: oom, 12: ValueError("bad shape")})
    assert rows[0]["status"] == "ERROR OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB."
    assert rows[11]["status"] == "ERROR ValueError: bad shape"
    assert all(r["status"] == "pass" for i, r in enumerate(rows) if i not in (0, 11))
    assert len(state["calls"]) == 17 and n_fail == 2
    assert "\nmore" not in md  # one line per table row


def test_context_poisoned_markers(check):
    gpu_check, state = check
    assert gpu_check.context_poisoned(FakeAcceleratorError("CUDA error: unspecified launch failure"))
    assert gpu_check.context_poisoned(RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"))
    assert not gpu_check.context_poisoned(torch.OutOfMemoryError("CUDA out of memory."))
    state["poisoned"] = True  # no marker in the message, but the device no longer synchronizes
    assert gpu_check.context_poisoned(ValueError("something else"))


def test_rows_runs_the_chosen_rows_with_the_full_runs_numbers_and_seeds(check, tmp_path):
    """--rows reruns rows alone (or under compute-sanitizer) exactly as they ran in the full list."""
    gpu_check, state = check
    state["raise_at"] = {}
    gpu_check.main(["--out", str(tmp_path), "--quick", "--variants", "1", "--rows", "2-3,12"])
    rows = json.loads((tmp_path / "triton_check_h200.json").read_text())["rows"]
    assert [r["row"] for r in rows] == [2, 3, 12] and [r["kind"] for r in rows] == ["core", "core", "api-varlen-continuation"]
    assert [kw["seed"] for kind, kw in state["calls"] if kind == "core"] == [1, 2]  # the full run's seeds
    with pytest.raises(SystemExit, match="--rows"):
        gpu_check.main(["--out", str(tmp_path), "--rows", "2-x"])


def test_kinds_runs_only_those_rows_with_the_full_runs_numbers(check, tmp_path):
    gpu_check, state = check
    state["raise_at"] = {}
    gpu_check.main(["--out", str(tmp_path), "--quick", "--variants", "1", "--kinds", "varlen-native"])
    rows = json.loads((tmp_path / "triton_check_h200.json").read_text())["rows"]
    assert [r["row"] for r in rows] == [14, 15, 16, 17] and {r["kind"] for r in rows} == {"varlen-native"}
    assert all(r["status"] == "pass" for r in rows) and [kind for kind, _ in state["calls"]] == ["varlen"] * 4


def test_a_varlen_row_that_was_padded_fails(check, tmp_path, monkeypatch):
    """The native packed kernels must have run: a row whose call was padded (native = 0) fails even when its
    errors are small."""
    gpu_check, state = check
    state["raise_at"] = {}
    monkeypatch.setattr(gpu_check, "check_varlen", lambda **kw: {"o": 1e-7, "native": 0.0, "seen": 0.0})
    gpu_check.main(["--out", str(tmp_path), "--quick", "--variants", "1", "--kinds", "varlen-native"])
    rows = json.loads((tmp_path / "triton_check_h200.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["status"] == "FAIL" for r in rows)
