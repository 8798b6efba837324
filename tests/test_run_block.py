"""experiments/ablation/run_block.sh's scheduler, with a stand-in for python: a run that dies of a CUDA
out-of-memory error is queued again once and then finishes; an arm that keeps failing otherwise is not retried;
the block's status and summary say so; an archive too large for the device tool comes back in parts. Seconds, no training (the stand-in writes what a run would)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAKE = r'''#!/usr/bin/env bash
# stand-in for python3: `-m falcon_lab.fit ... run_dir=D ...` fails once with an OOM for arms named oom_*,
# always with another error for arms named bad_*, and otherwise writes one validation row; anything else
# (summarize.py) runs on the real interpreter; `-c 'import mlflow'` fails, so the block uses logger=none.
if [ "$1" = "-c" ]; then exit 1; fi
if [ "$1" = "-m" ] && [ "$2" = "falcon_lab.fit" ]; then
  for a in "$@"; do case "$a" in run_dir=*) rd=${a#run_dir=} ;; esac; done
  name=$(basename "$rd")
  case "$name" in
    oom_*) if [ ! -f "$rd/.oomed" ]; then touch "$rd/.oomed"; echo "torch.OutOfMemoryError: CUDA out of memory."; exit 1; fi ;;
    bad_*) echo "ValueError: something else"; exit 1 ;;
  esac
  echo '{"step": 4, "val/loss": 1.5, "train/tokens_per_s": 10.0}' > "$rd/metrics.jsonl"; exit 0
fi
exec REAL "$@"
'''


def test_oom_run_is_retried_once_and_other_failures_are_not(tmp_path):
    fake = tmp_path / "py"
    fake.write_text(FAKE.replace("REAL", sys.executable))
    fake.chmod(0o755)
    arms = tmp_path / "arms.txt"
    arms.write_text("# comment\nok_a arm=a seed=0 x=1\noom_b arm=b seed=0 x=2\nbad_c arm=c seed=0 x=3\n")
    work, out = tmp_path / "work", tmp_path / "out"
    env = dict(os.environ, SMOKE="1", PYTHON=str(fake), WORK=str(work), OUT=str(out), PAR="1", STAGGER_S="0",
               POLL_S="0.2", DEADLINE_S="60", HARD_S="90", BLOCK="t", RESULTS_MAX_BYTES="600")
    r = subprocess.run(["bash", str(ROOT / "experiments/ablation/run_block.sh"), str(arms)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    status = dict(line.split("\t")[:2] for line in (work / "status.tsv").read_text().splitlines()[1:])
    assert status == {"ok_a": "done", "oom_b": "done", "bad_c": "stopped"}
    log = (work / "block.log").read_text()
    assert "oom_b ran out of GPU memory: queued again (attempt 1 of 2)" in log
    assert "bad_c ran out" not in log and log.count("started bad_c") == 1
    # an archive over RESULTS_MAX_BYTES comes back in parts (the device tool returns files of <= 16 MiB)
    parts = sorted(out.glob("ablation_t.tgz.part*"))
    assert len(parts) >= 2 and not (out / "ablation_t.tgz").exists()
    assert all(p.stat().st_size <= 600 for p in parts)
    joined = tmp_path / "joined.tgz"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    names = subprocess.run(["tar", "tzf", str(joined)], capture_output=True, text=True, check=True).stdout.split()
    assert "status.tsv" in names and "block.log" in names
