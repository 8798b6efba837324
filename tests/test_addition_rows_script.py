"""experiments/addition/run_rows_parallel.sh, the script the GPU sessions use for Table 3: rows in
parallel, each with its own MLflow store; a second call resumes an unfinished row from its checkpoint;
a stopped row is salvaged from its history; everything is packed into one tarball. CPU, tiny model."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "addition" / "run_rows_parallel.sh"
RUNNER = ROOT / "experiments" / "addition" / "run_addition.py"
SMALL = ("model=tiny data.train_widths=[1,3] data.ood_widths=[4,5] data.val_per_width=4 data.seq_len=24 "
         "data.batch_size=8 addition_eval.every_n_steps=10 addition_eval.n_examples=4 trainer.val_check_interval=10 "
         "trainer.limit_val_batches=1 trainer.enable_progress_bar=false trainer.cpu_threads=1")


def _call(work, steps, *rows):
    env = dict(os.environ, PYTHON=sys.executable, WORK=str(work), SCALE="cpu", DEADLINE_S="300",
               EXTRA=f"{SMALL} trainer.max_steps={steps}", PYTHONPATH=str(ROOT))
    r = subprocess.run(["bash", str(SCRIPT), *rows], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
def test_rows_in_parallel_then_resumed_then_packed(tmp_path):
    work = tmp_path / "w"
    out = _call(work, 20, "falcon_1a_3:0", "transformer:1")
    for name in ("falcon_1a_3_seed0", "transformer_seed1"):
        row = json.loads((work / "res" / "cpu" / f"{name}.json").read_text())
        assert row["complete"] and row["steps"] == 20 and [h["step"] for h in row["history"]] == [10, 20]
        assert (work / "ml" / f"cpu_{name}" / "mlflow.db").exists()  # stores keyed <scale>_<row>_seed<S>
    # an unfinished row (its JSON gone, its checkpoint kept) resumes from last.ckpt on the next call;
    # a finished one is left alone
    (work / "res" / "cpu" / "falcon_1a_3_seed0.json").unlink()
    out = _call(work, 40, "falcon_1a_3:0", "transformer:1")
    assert "cpu_falcon_1a_3_seed0 resumes from" in out and "cpu_transformer_seed1 already complete" in out
    row = json.loads((work / "res" / "cpu" / "falcon_1a_3_seed0.json").read_text())
    assert row["complete"] and row["steps"] == 40
    assert [h["step"] for h in row["history"]] == [10, 20, 30, 40]  # the history rode in the checkpoint
    assert set(row["history"][-1]["ood_by_width"]) == {"4", "5"}
    with tarfile.open(work / "results.tgz") as t:
        names = set(t.getnames())
    assert {"res/cpu/falcon_1a_3_seed0.json", "res/cpu/transformer_seed1.json",
            "ml/cpu_transformer_seed1/mlflow.db"} <= names
    assert not [n for n in names if n.endswith(".ckpt")]
    # salvage: a row's JSON from its history alone, marked incomplete (no torch import needed)
    r = subprocess.run([sys.executable, str(RUNNER), "transformer", "--seed", "1", "--scale", "cpu",
                        "--out", str(tmp_path / "salv"), "--salvage", str(work / "runs" / "cpu_transformer_seed1")]
                       + SMALL.split(), capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads((tmp_path / "salv" / "cpu" / "transformer_seed1.json").read_text())
    assert s["complete"] is False and s["last_eval_step"] == 20 and s["best_step"] in (10, 20)
