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
    """Run `cases` through `script` under TRITON_INTERPRET=1 in subprocesses: the cases are dealt round-robin
    to FALCON_INTERP_WORKERS processes (default: 2 where there are 2+ cores; each runs one thread), which run
    at once, so CI's two cores both work on the slowest fixture of the suite."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    workers = max(1, min(len(cases), int(os.environ.get("FALCON_INTERP_WORKERS", min(2, os.cpu_count() or 1)))))
    parts = [cases[i::workers] for i in range(workers)]
    procs = [subprocess.Popen([sys.executable, str(HERE / script), json.dumps(part)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=str(HERE.parent)) for part in parts]
    res, outs = {}, []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((out, err))
        for line in out.splitlines():
            if line.startswith("{"):
                d = json.loads(line)
                res[d["id"]] = d
    if not res:
        pytest.fail("interpreter subprocess produced no results:\n" + "\n".join(
            f"{o[-2000:]}\n{e[-4000:]}" for o, e in outs))
    return res


def case_result(results: dict, case_id: str):
    """The "res" of one case in run_interp_cases' answer; fails the test where the case did not run or raised."""
    r = results.get(case_id)
    assert r is not None, f"case {case_id} did not run"
    assert "error" not in r, r.get("error")
    return r["res"]


_FORK_IMPORTS = r"""
import json, os, sys, traceback
import torch, triton  # noqa: F401  (once, before the forks: what makes each import cheap)
out = []
for module, env in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a fresh import of falcon_lab (the parent never imported it) under env
        os.close(r)
        os.environ.update(env)
        code, msg = 0, ""
        try:
            __import__(module)
        except BaseException:
            code, msg = 1, traceback.format_exc()
        os.write(w, msg.encode())
        os.close(w)
        os._exit(code)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    status = os.waitpid(pid, 0)[1]
    out.append(dict(returncode=os.waitstatus_to_exitcode(status), stderr=b"".join(chunks).decode()))
print(json.dumps(out))
"""


def import_many_with(cases: list) -> list:
    """import_with for many (module, env) pairs in one interpreter that imports torch and Triton once and forks a child
    per pair (ours): each child imports the module fresh with its variables set, as a new interpreter would (the
    switches are read at import, and the parent never imports falcon_lab). Returns one dict(returncode, stderr) per
    pair, stderr the child's traceback. About 0.3 s a pair instead of a 2.3 s interpreter start (2-core machine)."""
    proc = subprocess.run([sys.executable, "-c", _FORK_IMPORTS, json.dumps([[m, dict(e)] for m, e in cases])],
                          env=dict(os.environ), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the forking importer failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def import_with(module: str, **env) -> subprocess.CompletedProcess:
    """Import `module` in a fresh interpreter with the environment variables `env` set (the kernels' switches are read
    once, at import): the completed process, for its exit code and stderr."""
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=300)
