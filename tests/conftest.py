"""Test-wide settings: small thread pools (CI has 2 cores), offline hubs, deterministic seeds."""
import os
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
# data=kjv / text / jsonl cache their tokens under `auto` (~/.cache/falcon_lab/tokens): one throwaway
# folder per test session instead, inherited by subprocesses, so tests never write into the real home
# (removed when the process that made it exits: the machine that runs CI is also where sessions work, and its disk
# filled up once)
if "FALCON_LAB_TOKEN_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile
    os.environ["FALCON_LAB_TOKEN_CACHE"] = _token_cache = tempfile.mkdtemp(prefix="falcon_lab_tokens_")
    atexit.register(shutil.rmtree, _token_cache, ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _mlflow_uri_isolated():
    """mlflow.set_tracking_uri (Lightning's MLFlowLogger calls it) also sets $MLFLOW_TRACKING_URI for the
    rest of the process: restore both after each test, so no test logs into another test's store."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    if utils is not None:
        utils._tracking_uri = None
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def _migrated_store(tmp_path_factory):
    """One migrated SQLite MLflow store (migrations take seconds); the `store` fixture copies it."""
    import mlflow

    d = tmp_path_factory.mktemp("mlstore")
    mlflow.MlflowClient(f"sqlite:///{d / 'mlflow.db'}").search_experiments()
    return d / "mlflow.db"


@pytest.fixture
def store(tmp_path, monkeypatch, _migrated_store):
    """A fresh MLflow store for one test: MLFLOW_TRACKING_URI points at it and the test runs in tmp_path."""
    import shutil

    db = tmp_path / "mlruns" / "mlflow.db"
    db.parent.mkdir()
    shutil.copy(_migrated_store, db)
    uri = f"sqlite:///{db}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    return uri
