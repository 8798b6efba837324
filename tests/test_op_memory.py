"""experiments/h200/op_memory.py: the peak of an op's forward+backward from its allocations (kernels stubbed), as
torch.cuda.max_memory_allocated measures it on the GPU. The CPU-side logic; its agreement with the H200's measured
peaks is in benchmarks/results/h200_logs/kernels_2026-12-03f/README.md."""
import os
import subprocess
import sys

from script_helpers import ROOT, load_script

TOOL = ROOT / "experiments" / "h200" / "op_memory.py"


def _tool():
    return load_script("experiments/h200/op_memory.py")


def _ev(ts, nbytes, total):
    return dict(name="[memory]", ts=ts, args={"Bytes": nbytes, "Total Allocated": total})


def test_peak_is_taken_above_the_total_at_the_first_event():
    t = _tool()
    # a profile that starts with 100 bytes already counted (an earlier profile in the process): +50, +30, -50, +10
    ev = [_ev(1, 50, 150), dict(name="aten::empty", ts=1), _ev(2, 30, 180), _ev(3, -50, 130), _ev(4, 10, 140)]
    assert t.peak_from_trace(ev) == 80
    assert t.peak_from_trace(list(reversed(ev))) == 80  # ordered by time, not by position
    assert t.peak_from_trace([dict(name="x", ts=0)]) == 0


def test_an_op_peak_on_cpu_is_reproducible_and_above_its_inputs():
    """Two runs in one process give the same peak (the profiler's running total carries over between profiles, which
    once added the first run's leftovers to the second's peak), above the inputs' bytes."""
    code = (
        "import sys; sys.path.insert(0, %r); sys.path.insert(0, %r)\n"
        "import op_memory as m\n"
        "m.stub_launches()\n"
        "a = m.op_peak_mb('falcon-1', (1, 256, 2, 32)); b = m.op_peak_mb('falcon-1', (1, 256, 2, 32))\n"
        "print(a['peak_mb'], b['peak_mb'], a['inputs_mb'])\n" % (str(TOOL.parent), str(ROOT)))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    a, b, inputs = (float(x) for x in out.stdout.split()[-3:])
    assert a == b and a > inputs
