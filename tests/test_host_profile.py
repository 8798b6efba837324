"""experiments/h200/host_profile.py's CPU-side logic (the profile itself runs on the GPU machine)."""
import cProfile
import pstats

from script_helpers import load_script


def _tool():
    return load_script("experiments/h200/host_profile.py")


def _busy(n):
    return sum(i * i for i in range(n))


def test_top_functions_by_own_time():
    t = _tool()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        _busy(20000)
    prof.disable()
    top = t.top_functions(pstats.Stats(prof), n=10)
    assert len(top) <= 10 and [r["own_s"] for r in top] == sorted((r["own_s"] for r in top), reverse=True)
    busy = [r for r in top if "(_busy)" in r["function"]]
    assert busy and busy[0]["calls"] == 3 and busy[0]["cum_s"] >= busy[0]["own_s"]
