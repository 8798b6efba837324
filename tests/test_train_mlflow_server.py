"""A real `mlflow server` (SQLite backend) on 127.0.0.1 receives a tiny training run over HTTP."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from falcon_lab.training import run
from falcon_lab.training.config import compose


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read().decode())


def _post(url, payload):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read().decode())


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    mlflow_bin = shutil.which("mlflow", path=os.path.dirname(sys.executable)) or "mlflow"
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [mlflow_bin, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--default-artifact-root", (tmp_path / "artifacts").as_uri()],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail("mlflow server did not start:\n" + (tmp_path / "server.log").read_text()[-3000:])
                time.sleep(0.5)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.mark.slow
def test_training_run_reaches_mlflow_server_over_http(mlflow_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.chdir(tmp_path)
    res = run(compose(["debug=smoke", "data.seq_len=32", "logger.experiment_name=over_http",
                       "checks.shuffle=false"]))
    exp = _get(f"{mlflow_server}/api/2.0/mlflow/experiments/get-by-name?experiment_name=over_http")["experiment"]
    runs = _post(f"{mlflow_server}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]]})["runs"]
    assert [r["info"]["run_id"] for r in runs] == [res["run_id"]]
    r = runs[0]
    assert r["info"]["status"] == "FINISHED"
    params = {p["key"]: p["value"] for p in r["data"]["params"]}
    assert params["mixer.name"] == "falcon" and params["model.name"] == "tiny"
    hist = _get(f"{mlflow_server}/api/2.0/mlflow/metrics/get-history?run_id={res['run_id']}&metric_key=train/loss")
    assert [m["step"] for m in hist["metrics"]] == [0, 1, 2, 3]
    arts = _get(f"{mlflow_server}/api/2.0/mlflow/artifacts/list?run_id={res['run_id']}")
    assert "config.yaml" in {f["path"] for f in arts.get("files", [])}
