"""A real `mlflow server` (SQLite backend) on 127.0.0.1 receives a tiny training run over HTTP."""
import json
import urllib.request

import pytest

from falcon_lab.training import run
from falcon_lab.training.config import compose
from mlflow_server_helpers import MlflowServer, post_json


def _get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read().decode())


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path, f"sqlite:///{tmp_path / 'server.db'}",
                          "--default-artifact-root", (tmp_path / "artifacts").as_uri())
    try:
        yield server.wait(90)
    finally:
        server.stop()


@pytest.mark.slow
def test_training_run_reaches_mlflow_server_over_http(mlflow_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.chdir(tmp_path)
    res = run(compose(["debug=smoke", "data.seq_len=32", "logger.experiment_name=over_http",
                       "checks.shuffle=false"]))
    exp = _get(f"{mlflow_server}/api/2.0/mlflow/experiments/get-by-name?experiment_name=over_http")["experiment"]
    runs = post_json(f"{mlflow_server}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]]})["runs"]
    assert [r["info"]["run_id"] for r in runs] == [res["run_id"]]
    r = runs[0]
    assert r["info"]["status"] == "FINISHED"
    params = {p["key"]: p["value"] for p in r["data"]["params"]}
    assert params["mixer.name"] == "falcon" and params["model.name"] == "tiny"
    hist = _get(f"{mlflow_server}/api/2.0/mlflow/metrics/get-history?run_id={res['run_id']}&metric_key=train/loss")
    assert [m["step"] for m in hist["metrics"]] == [0, 1, 2, 3]
    arts = _get(f"{mlflow_server}/api/2.0/mlflow/artifacts/list?run_id={res['run_id']}")
    assert "config.yaml" in {f["path"] for f in arts.get("files", [])}
