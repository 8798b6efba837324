"""Run Triton-interpreter cases in ONE subprocess (TRITON_INTERPRET must be set before triton is first
imported, and other tests of the pytest process import it earlier). The case script prints one JSON
line {"id": ..., "res" | "error": ...} per case; this returns them by id."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def run_interp_cases(script: str, cases: list, timeout: int = 600, **env_extra) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(HERE / script), json.dumps(cases)], env=env, capture_output=True,
                         text=True, timeout=timeout, cwd=str(HERE.parent))
    res = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            res[d["id"]] = d
    if not res:
        pytest.fail(f"interpreter subprocess produced no results:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return res
