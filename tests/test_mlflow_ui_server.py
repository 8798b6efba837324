"""Issue 17, point 5, checked against a real `mlflow server` (SQLite store in a temporary folder, a free port): a
training run's experiment carries the kind and the shared default view the platform writes, the view names columns
the run has, and the UI bundle the server serves switches to "Model training" by the URL parameter the platform's
address carries. With a headless Chromium on PATH (Debian: `apt-get install chromium-headless-shell`; CI has none,
so that test is skipped there), the platform's address is opened for real and must render the runs table with the
view's columns, sorted by val/loss_best (the best validation loss of each run).

Found with that browser (MLflow 3.17.2): the experiment's own address, #/experiments/<id>, opens on the GenAI
overview whatever the experiment's `mlflow.experimentKind` tag says, because the UI's workflow switch (kept per browser,
default GenAI) decides; `?workflowType=machine_learning` opens the runs table (see docs/mlflow.md)."""
import html
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest

from falcon_lab.training import run
from falcon_lab.training.config import compose
from mlflow_server_helpers import MlflowServer, post_json
from falcon_lab.training.mlflow import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    SHARED_VIEW_PREFIX,
    UI_WORKFLOW,
    UI_WORKFLOW_PARAM,
    VIEW_KEY,
    view_url,
)

pytestmark = pytest.mark.slow  # a server start, a training run and a browser: ~15 s idle, more on a busy machine

BROWSERS = ("chromium-headless-shell", "chrome-headless-shell", "chromium", "chromium-browser", "google-chrome",
            "google-chrome-stable")


def _get(url, raw=False):
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read().decode(errors="replace")
    return body if raw else json.loads(body)


@pytest.fixture(scope="module")
def served(tmp_path_factory, _migrated_store):
    """`mlflow server` on a fresh SQLite store, and a tiny training run logged into that store meanwhile (the store is
    migrated beforehand, so the two never migrate it at once): (url, experiment id, run result)."""
    tmp = tmp_path_factory.mktemp("ui")
    db = tmp / "mlruns" / "mlflow.db"
    db.parent.mkdir()
    shutil.copy(_migrated_store, db)
    uri = f"sqlite:///{db}"
    server = MlflowServer(tmp, uri)
    url = server.url
    try:
        with pytest.MonkeyPatch.context() as mp:  # while the server starts
            mp.setenv("MLFLOW_TRACKING_URI", uri)
            mp.chdir(tmp)
            res = run(compose(["debug=smoke", "data.seq_len=16", "data.batch_size=2", "trainer.max_steps=2",
                               "trainer.limit_val_batches=1", "checks.shuffle=false", "data.cache_dir=null",
                               "logger.experiment_name=ui_check", "logger.run_name='gate=ctx_eta'",
                               "+logger.tags.arm='gate=ctx_eta'", f"run_dir={tmp / 'r'}"]))
        utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
        if utils is not None:  # Lightning's logger set the process-wide URI: not for the other tests
            utils._tracking_uri = None
        server.wait(120)
        yield url, res["experiment_id"], res
    finally:
        server.stop()


def test_the_server_gives_the_ui_the_kind_and_default_view_the_platform_wrote(served):
    url, eid, res = served
    exp = _get(f"{url}/api/2.0/mlflow/experiments/get?experiment_id={eid}")["experiment"]
    tags = {t["key"]: t["value"] for t in exp.get("tags", [])}
    assert tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    view = json.loads(tags[SHARED_VIEW_PREFIX + VIEW_KEY])
    assert view["orderByKey"] == "metrics.`val/loss_best`" and view["orderByAsc"] is True
    assert view["selectedColumns"] == view["columnOrder"] and view["runsHiddenMode"] == "SHOW_ALL"
    (r,) = post_json(f"{url}/api/2.0/mlflow/runs/search", {"experiment_ids": [eid]})["runs"]
    assert r["info"]["run_id"] == res["run_id"] and r["info"]["status"] == "FINISHED"
    have = {kind: {x["key"] for x in r["data"].get(kind, [])} for kind in ("params", "metrics", "tags")}
    for col in view["selectedColumns"]:  # every column of the view is one the run has, in the UI's id form
        kind, key = re.fullmatch(r"(params|metrics|tags)\.`(.+)`", col).groups()
        assert key in have[kind], col
    assert r["info"]["run_name"] == "gate=ctx_eta"


def test_the_served_ui_opens_model_training_by_the_url_parameter_the_platform_gives(served):
    """The parameter and its value are the UI's, read from the bundle this server serves: an MLflow that renames them
    fails here (then view_url must follow)."""
    url, eid, _ = served
    index = _get(url + "/", raw=True)
    main = re.search(r'src="([^"]*static/js/main\.[0-9a-f]+\.js)"', index)
    assert main, index[:500]
    js = _get(urllib.parse.urljoin(url + "/", main.group(1)), raw=True)
    assert f'.get("{UI_WORKFLOW_PARAM}")' in js
    assert f'MACHINE_LEARNING="{UI_WORKFLOW}"' in js and 'GENAI="genai"' in js
    assert '"viewStateShareKey"' in js
    link = view_url(url, eid, workflow=UI_WORKFLOW)
    assert link == f"{url}/#/experiments/{eid}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"


def _browser():
    return next((b for b in map(shutil.which, BROWSERS) if b), None)


def _rendered_text(browser, address, width=3600):
    args = [browser, "--disable-gpu", "--no-sandbox", f"--window-size={width},900", "--virtual-time-budget=20000",
            "--dump-dom", address]
    if "headless-shell" not in os.path.basename(browser):
        args.insert(1, "--headless=new")
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    text = re.sub(r"<script.*?</script>|<style.*?</style>", " ", p.stdout, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", text)))


@pytest.mark.skipif(_browser() is None, reason="no headless Chromium on PATH (apt-get install chromium-headless-shell)")
def test_headless_chromium_opens_the_platform_address_on_the_runs_table(served):
    url, eid, res = served
    text = _rendered_text(_browser(), view_url(url, eid, workflow=UI_WORKFLOW))
    assert text.strip().startswith("Runs - "), text[:300]  # the page title: the runs table, not "Overview"
    assert "Model training" in text and "Sort: val/loss_best" in text and "viewing a shared view" in text
    for col in ("label", "arm", "steps", "params_total", "val/loss", "val/ppl", "train/loss", "seed", "model.name",
                "data.source", "optim.lr"):
        assert col in text, col
    assert "gate=ctx_eta" in text and "Falcon-1A.3" in text
