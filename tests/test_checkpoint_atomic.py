"""Issue 16 B: a checkpoint write never destroys the last good checkpoint.

The new file is written to a temp file in the checkpoint's own folder, flushed and fsynced, then renamed onto
the final name (os.replace); a failed write removes its temp file. Lightning's default wrote the temp file in
$TMPDIR and, with $TMPDIR on another filesystem, *copied* it over last.ckpt (0-byte / truncated last.ckpt when
killed or out of space mid-copy)."""
import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from falcon_lab.training import run
from falcon_lab.training.config import compose

SMALL = ["debug=smoke", "logger=none", "checks.shuffle=false", "trainer.max_steps=2", "trainer.val_check_interval=2",
         "trainer.limit_val_batches=1", "data.seq_len=16", "data.batch_size=2"]


class _GrabIO(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.io = trainer.strategy.checkpoint_io


@pytest.fixture(scope="module")
def platform_io(tmp_path_factory):
    """The CheckpointIO that `run` gives the Trainer, and a real checkpoint it wrote."""
    root = tmp_path_factory.mktemp("ckio")
    grab = _GrabIO()
    res = run(compose(SMALL + [f"run_dir={root / 'a'}"]), callbacks=[grab])
    return grab.io, Path(res["last_ckpt_path"])


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_saved_checkpoint_is_complete_and_loads(platform_io, tmp_path):
    from falcon_lab.training.checkpoint_io import AtomicCheckpointIO

    io, ck = platform_io
    assert isinstance(io, AtomicCheckpointIO)
    state = torch.load(ck, map_location="cpu", weights_only=False)
    assert state["global_step"] == 2 and state["state_dict"]
    target = tmp_path / "sub" / "last.ckpt"  # the folder is created
    io.save_checkpoint(state, target)
    again = torch.load(target, map_location="cpu", weights_only=False)
    assert again["global_step"] == 2
    assert all(torch.equal(v, again["state_dict"][k]) for k, v in state["state_dict"].items())
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]  # no temp file left
    assert (target.stat().st_mode & 0o777) == (0o666 & ~_umask())  # not mkstemp's 0600


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_failed_write_keeps_the_previous_checkpoint(platform_io, tmp_path, monkeypatch):
    """A full disk mid-write (torch.save writes part of the file, then ENOSPC): the previous last.ckpt is
    byte-identical and loads, the error reaches the caller, and no temp file is left."""
    io, ck = platform_io
    state = torch.load(ck, map_location="cpu", weights_only=False)
    target = tmp_path / "last.ckpt"
    io.save_checkpoint(state, target)
    before = _digest(target)
    real_save = torch.save

    def full_disk(obj, f, *a, **kw):
        real_save({"partial": torch.zeros(1000)}, f)  # some bytes reach the file ...
        if hasattr(f, "flush"):
            f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")  # ... then the disk is full

    monkeypatch.setattr(torch, "save", full_disk)
    state["global_step"] = 3
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint(state, target)
    monkeypatch.setattr(torch, "save", real_save)
    assert _digest(target) == before
    assert torch.load(target, map_location="cpu", weights_only=False)["global_step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import lightning as L, torch
    from falcon_lab.training import run
    from falcon_lab.training.config import compose

    root = Path(sys.argv[1])

    class Big(L.Callback):  # a checkpoint large enough that writing it takes a while
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            checkpoint["pad"] = torch.ones(48 * 2**20, dtype=torch.float32)

        def on_train_end(self, trainer, pl_module):
            last = root / "a" / "checkpoints" / "last.ckpt"
            print("READY", flush=True)
            while not (root / "go").exists():
                time.sleep(0.01)
            trainer.save_checkpoint(str(last))  # overwrite last.ckpt: the parent kills us during this
            print("SAVED", flush=True)
            time.sleep(60)

    run(compose(sys.argv[2:] + [f"run_dir={root / 'a'}"]), callbacks=[Big()])
""")


def test_sigkill_during_save_with_tmpdir_on_another_filesystem(tmp_path):
    """The reported case: TMPDIR on another filesystem, SIGKILL while last.ckpt is being overwritten.
    Whatever the moment of the kill, last.ckpt is a complete checkpoint (the old one or the new one)."""
    other = Path("/dev/shm")
    if not other.is_dir() or os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's tmp dir")
    tmpdir = other / f"falcon_ckpt_test_{os.getpid()}"
    tmpdir.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmpdir), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), *SMALL], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = []
        for line in p.stdout:
            out.append(line)
            if line.startswith("READY"):
                break
        else:
            pytest.fail("child ended early:\n" + "".join(out[-40:]))
        ckdir = tmp_path / "a" / "checkpoints"
        last = ckdir / "last.ckpt"
        st0 = last.stat()
        names0 = set(os.listdir(ckdir))
        (tmp_path / "go").touch()
        # kill at the first sign of the write reaching the checkpoint folder
        deadline = time.time() + 60
        while time.time() < deadline:
            st = last.stat()
            if (st.st_size, st.st_mtime_ns, st.st_ino) != (st0.st_size, st0.st_mtime_ns, st0.st_ino) \
                    or set(os.listdir(ckdir)) != names0:
                break
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
        for f in tmpdir.iterdir():
            f.unlink()
        tmpdir.rmdir()
    assert last.stat().st_size > 0, "last.ckpt is empty after the kill"
    state = torch.load(last, map_location="cpu", weights_only=False)  # complete: the old or the new one
    assert state["global_step"] == 2 and state["pad"].numel() == 48 * 2**20


def test_orphan_temp_files_of_dead_writers_are_removed(tmp_path):
    """A writer killed mid-save leaves `.<name>.<pid>.<hex>.tmp` beside the intact checkpoint; the next
    save of that checkpoint removes the temp files of writers that are gone, and only those."""
    from falcon_lab.training.checkpoint_io import atomic_torch_save

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid that has exited
    path = tmp_path / "last.ckpt"
    orphan = tmp_path / f".last.ckpt.{dead}.0badc0de.tmp"
    live = tmp_path / f".last.ckpt.{os.getppid()}.00000001.tmp"  # a writer still running: kept
    other = tmp_path / f".best.ckpt.{dead}.0badc0de.tmp"  # another checkpoint's temp file: not ours to remove
    for f in (orphan, live, other):
        f.write_bytes(b"partial")
    atomic_torch_save({"x": torch.ones(2)}, path)
    assert not orphan.exists() and live.exists() and other.exists()
    assert torch.load(path, weights_only=True)["x"].sum() == 2
