"""Issue 16: a checkpoint cannot run code (fit, evaluate, generate load with weights_only=True); a file that
is not a checkpoint is refused naming the key; every MLflow run gets its own name, whatever the seed."""
import pickle
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch

from falcon_lab.evaluation.runner import EvalConfigError, compose_eval, evaluate
from falcon_lab.training import load_checkpoint, run
from falcon_lab.training.config import compose
from falcon_lab.training.validate import ConfigError

SMALL = ["debug=smoke", "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
         "data.seq_len=16", "data.batch_size=2", "checks.shuffle=false"]


class _Payload:
    """Unpickling this writes `marker` (what an `os.system(...)` payload would do, made harmless)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def _evil(tmp_path, kind: str) -> tuple[Path, Path]:
    marker = tmp_path / f"pwned_{kind}"
    path = tmp_path / f"evil_{kind}.ckpt"
    obj = {"state_dict": {}, "hyper_parameters": _Payload(marker), "falcon_lab": _Payload(marker)}
    if kind == "torch":  # torch.save's zip format, as Lightning writes
        torch.save(obj, path)
    else:  # a bare pickle (torch.load's legacy path unpickles it too)
        path.write_bytes(pickle.dumps(obj))
    assert not marker.exists()
    return path, marker


def _text(tmp_path) -> Path:
    p = tmp_path / "notes.ckpt"
    p.write_text("these are my notes, not a checkpoint\n\u00e9\u00e8\n")
    return p




@pytest.mark.parametrize("kind", ["torch", "pickle"])
def test_fit_refuses_a_malicious_checkpoint(kind, tmp_path, store):
    evil, marker = _evil(tmp_path, kind)
    with pytest.raises(ConfigError, match=r"ckpt_path"):
        run(compose(SMALL + [f"ckpt_path={evil}", f"run_dir={tmp_path / 'run'}"]))
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["torch", "pickle"])
def test_evaluate_refuses_a_malicious_checkpoint(kind, tmp_path, store):
    evil, marker = _evil(tmp_path, kind)
    with pytest.raises(EvalConfigError, match=r"ckpt"):
        evaluate(compose_eval([f"ckpt={evil}", "suites=[ppl]", "device=cpu", f"out_dir={tmp_path / 'ev'}"]))
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["torch", "pickle"])
def test_generate_refuses_a_malicious_checkpoint(kind, tmp_path):
    evil, marker = _evil(tmp_path, kind)
    with pytest.raises(ValueError, match=r"ckpt"):
        load_checkpoint(str(evil))  # what generate, evaluate and the lm-eval adapter call
    assert not marker.exists()
    p = subprocess.run([sys.executable, "-m", "falcon_lab.generate", f"ckpt={evil}", "prompt=x", "device=cpu"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "ckpt:" in p.stderr + p.stdout
    assert not marker.exists()


def test_a_text_file_as_checkpoint_is_refused_naming_the_key(tmp_path, store):
    notes = _text(tmp_path)
    with pytest.raises(ConfigError, match=r"^ckpt_path: .*notes\.ckpt"):
        run(compose(SMALL + [f"ckpt_path={notes}", f"run_dir={tmp_path / 'run'}"]))
    with pytest.raises(EvalConfigError, match=r"^ckpt: .*notes\.ckpt"):
        evaluate(compose_eval([f"ckpt={notes}", "suites=[ppl]", "device=cpu", f"out_dir={tmp_path / 'ev'}"]))
    with pytest.raises(ValueError, match=r"^ckpt: .*notes\.ckpt"):
        load_checkpoint(str(notes))


def test_real_checkpoints_load_safely_and_runs_get_distinct_names(tmp_path, store):
    """Two runs with the same seed get different MLflow run names; the platform's own checkpoint loads with
    weights_only=True (load_checkpoint, evaluate's metadata) and resumes into the same MLflow run."""
    from falcon_lab.evaluation.runner import _ckpt_meta

    a = run(compose(SMALL + ["seed=7", f"run_dir={tmp_path / 'a'}"]))
    b = run(compose(SMALL + ["seed=7", f"run_dir={tmp_path / 'b'}"]))
    client = mlflow.MlflowClient(store)
    ra, rb = client.get_run(a["run_id"]), client.get_run(b["run_id"])
    assert ra.info.run_name and rb.info.run_name and ra.info.run_name != rb.info.run_name
    assert ra.info.run_name.startswith("falcon-1A-")
    ck = torch.load(a["last_ckpt_path"], map_location="cpu", weights_only=True)
    assert ck["hyper_parameters"]["cfg"]["seed"] == 7
    model, tok, cfg = load_checkpoint(a["last_ckpt_path"])
    assert cfg.seed == 7
    assert _ckpt_meta(a["last_ckpt_path"])["mlflow_run_id"] == a["run_id"]
    c = run(compose(SMALL + ["seed=7", "trainer.max_steps=4", f"ckpt_path={a['last_ckpt_path']}",
                             f"run_dir={tmp_path / 'a'}"]))
    assert c["run_id"] == a["run_id"] and c["steps"] == 4
    assert client.get_run(a["run_id"]).info.run_name == ra.info.run_name  # resuming keeps the name
    named = run(compose(SMALL + ["logger.run_name=mine", f"run_dir={tmp_path / 'n'}"]))
    assert client.get_run(named["run_id"]).info.run_name == "mine"
