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


def test_the_parent_is_found_or_created_under_the_store_lock(store, monkeypatch):
    """What makes the race above impossible on a SQLite store: the find-or-create runs while the file lock next to the
    store is held (another holder, here a second lock object, cannot take it), and it is free again afterwards."""
    from filelock import FileLock, Timeout

    from falcon_lab.sweeps import tracking

    lock = store[len("sqlite:///"):].rsplit("/", 1)[0] + "/.falcon_lab-sweep-parent.lock"
    seen = []
    inner = tracking._open_parent

    def probe(*a, **k):
        try:
            FileLock(lock, timeout=0).acquire()
            seen.append("free")
        except Timeout:
            seen.append("held")
        return inner(*a, **k)
    monkeypatch.setattr(tracking, "_open_parent", probe)
    run_id = open_parent(store, "sw", "locked", None, {})
    assert seen == ["held"] and _parents(store, "locked") == [run_id]
    with FileLock(lock, timeout=0):  # released
        pass
