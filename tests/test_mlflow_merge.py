"""falcon_lab.training.mlflow_merge: runs copied between SQLite stores, from a moved folder."""
import shutil

import pytest

mlflow = pytest.importorskip("mlflow")


def _make_store(root):
    from mlflow.tracking import MlflowClient

    from falcon_lab.training.mlflow import resolve_artifact_location
    uri = f"sqlite:///{root / 'mlflow.db'}"
    c = MlflowClient(uri)
    eid = c.create_experiment("exp_a", artifact_location=resolve_artifact_location(uri),
                              tags={"mlflow.experimentKind": "custom_model_development", "view.a": "{}"})
    parent = c.create_run(eid, run_name="sweep", tags={"mixer": "falcon"})
    child = c.create_run(eid, run_name="trial_0", tags={"mlflow.parentRunId": parent.info.run_id})
    c.log_param(child.info.run_id, "lr", "0.001")
    for step in range(5):
        c.log_metric(child.info.run_id, "train/loss", 5.0 - step, step=step * 10)
    f = root / "note.txt"
    f.write_text("hello")
    c.log_artifact(child.info.run_id, str(f))
    c.set_terminated(child.info.run_id, "FAILED")
    c.set_terminated(parent.info.run_id, "FINISHED")
    return parent.info.run_id, child.info.run_id


def test_merge_moved_store_keeps_history_artifacts_parents_and_is_idempotent(tmp_path):
    from mlflow.tracking import MlflowClient

    from falcon_lab.training.mlflow_merge import main
    made = tmp_path / "device" / "store"
    made.mkdir(parents=True)
    pid, cid = _make_store(made)
    moved = tmp_path / "here" / "store"
    shutil.copytree(made, moved)
    shutil.rmtree(tmp_path / "device")  # the recorded artifact paths no longer exist
    dst = tmp_path / "team" / "mlflow.db"
    assert main([str(moved / "mlflow.db"), "--into", str(dst), "--experiment", "merged"]) == 0
    c = MlflowClient(f"sqlite:///{dst}")
    exp = c.get_experiment_by_name("merged")
    runs = {r.info.run_name: r for r in c.search_runs([exp.experiment_id])}
    assert set(runs) == {"sweep", "trial_0"}
    child = runs["trial_0"]
    assert child.info.status == "FAILED" and child.data.params == {"lr": "0.001"}
    hist = c.get_metric_history(child.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)] == [(s * 10, 5.0 - s) for s in range(5)]
    assert child.data.tags["mlflow.parentRunId"] == runs["sweep"].info.run_id
    assert child.data.tags["merge.source_run_id"] == cid
    assert [a.path for a in c.list_artifacts(child.info.run_id)] == ["note.txt"]
    # the experiment's tags came along (the runs-table kind, shared views) ...
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development" and exp.tags["view.a"] == "{}"
    # ... but never over the destination's own: a view changed there stays
    c.set_experiment_tag(exp.experiment_id, "view.a", '{"changed": true}')
    # again: nothing new
    assert main([str(moved / "mlflow.db"), "--into", str(dst), "--experiment", "merged"]) == 0
    assert len(c.search_runs([exp.experiment_id])) == 2
    assert c.get_experiment(exp.experiment_id).tags["view.a"] == '{"changed": true}'


def test_merge_missing_source_is_named(tmp_path):
    from falcon_lab.training.mlflow_merge import main
    with pytest.raises(FileNotFoundError, match="no store at"):
        main([str(tmp_path / "nope.db"), "--into", str(tmp_path / "d.db")])


def test_portable_store_opens_from_its_root_after_a_move(tmp_path, monkeypatch):
    # --portable ROOT: artifact locations under ROOT become relative, so a committed store still finds
    # its artifacts on a clone at another path, read from the clone's root
    from mlflow.tracking import MlflowClient

    from falcon_lab.training.mlflow_merge import main
    src = tmp_path / "device"
    src.mkdir()
    _, cid = _make_store(src)
    repo = tmp_path / "repo"
    dst = repo / "results" / "mlflow" / "mlflow.db"
    assert main([str(src / "mlflow.db"), "--into", str(dst), "--portable", str(repo)]) == 0
    clone = tmp_path / "clone"
    shutil.copytree(repo, clone)
    shutil.rmtree(repo)
    monkeypatch.chdir(clone)
    c = MlflowClient(f"sqlite:///{clone / 'results' / 'mlflow' / 'mlflow.db'}")
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()])
    child = next(r for r in runs if r.info.run_name == "trial_0")
    assert child.info.artifact_uri.startswith("results/mlflow/artifacts/")
    assert [a.path for a in c.list_artifacts(child.info.run_id)] == ["note.txt"]
    assert (clone / c.download_artifacts(child.info.run_id, "note.txt")).read_text() == "hello"
