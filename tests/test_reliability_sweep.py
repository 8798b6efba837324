"""Sweeps (issue 16): processes of one study that start together share ONE MLflow parent run; a storage
URL whose database driver is not installed is refused naming `storage`."""
import multiprocessing as mp

import mlflow
import pytest

from falcon_lab.sweeps.storage import open_storage
from falcon_lab.sweeps.tracking import open_parent


def _parents(uri, study):
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("sw")
    runs = client.search_runs([exp.experiment_id], f"tags.`optuna.study` = '{study}'")
    return [r.info.run_id for r in runs if r.info.lifecycle_stage == "active"]


def test_processes_that_missed_each_others_parent_converge_on_one(store):
    """Both saw no parent recorded in the study (the window two workers started together fall into):
    before, each created its own parent run."""
    a = open_parent(store, "sw", "s1", None, {"metric": "val/loss"})
    b = open_parent(store, "sw", "s1", None, {"metric": "val/loss"})
    assert a == b and _parents(store, "s1") == [a]
    assert open_parent(store, "sw", "s2", None, {}) != a  # another study: its own parent


def _open(uri, q, barrier):
    barrier.wait()
    q.put(open_parent(uri, "sw", "race", None, {}))


def test_two_processes_starting_together_share_one_parent(store):
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(2)
    ps = [ctx.Process(target=_open, args=(store, q, barrier)) for _ in range(2)]
    for p in ps:
        p.start()
    ids = [q.get(timeout=120) for _ in ps]
    for p in ps:
        p.join(60)
    assert ids[0] == ids[1] and _parents(store, "race") == [ids[0]]


def test_storage_without_its_driver_is_refused_naming_storage():
    with pytest.raises(ValueError, match=r"^storage: 'postgresql\+nosuchdriver://u:\*\*\*@localhost/db' needs"):
        open_storage("postgresql+nosuchdriver://u:secret@localhost/db")
