"""Atomic checkpoint writes (issue 16).

Lightning's TorchCheckpointIO writes through an fsspec transaction whose temp file is made by
`tempfile.mkstemp()`, i.e. in $TMPDIR, then `shutil.move`s it onto the checkpoint. With $TMPDIR on another
filesystem that move is a copy over the existing file: a SIGKILL or a full disk during it leaves a 0-byte or
truncated last.ckpt (and an orphan temp file), and nothing is fsynced.

`AtomicCheckpointIO` writes the new checkpoint to a temp file in the checkpoint's OWN folder, flushes and
fsyncs it, then `os.replace`s it onto the final name (atomic on POSIX: readers see the old file or the new
one, never a partial one) and fsyncs the folder. Until the rename the previous checkpoint is untouched; a
failed write removes its temp file and re-raises. Remote (fsspec) paths keep Lightning's behaviour.

Used by `run` for every strategy it builds: single device and DDP save through `strategy.checkpoint_io`
on rank 0; FSDP1 (`state_dict_type="full"`) and FSDP2 (`FSDP2Strategy`, a ModelParallelStrategy with
`save_distributed_checkpoint=False`) gather the full state dict and hand it to the same CheckpointIO on
rank 0. (A ModelParallelStrategy with `save_distributed_checkpoint=True` writes a torch.distributed.checkpoint
folder itself, without the CheckpointIO; the platform does not configure that.)
"""
from __future__ import annotations

import contextlib
import os
import secrets
from typing import Any, Optional

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO


def _is_local(path) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(get_filesystem(path), LocalFileSystem)


def _local_path(path) -> str:
    p = os.fspath(path)
    return p[len("file://"):] if p.startswith("file://") else p


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems do not support fsync on a directory
        pass
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path) -> None:
    """torch.save `obj` to `path` atomically: temp file in the same folder, flush + fsync, os.replace, fsync
    the folder. On any error (full disk, interrupt) the temp file is removed and `path` is left as it was."""
    path = os.path.abspath(_local_path(path))
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    # hidden and not ending in .ckpt, so ModelCheckpoint never takes it for a checkpoint
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0o666 & ~umask, like a plain open()
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)
    remove_orphans(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but not ours (EPERM): alive
        return True
    return True


def remove_orphans(path) -> list[str]:
    """Delete the temp files of earlier writes of `path` whose writer process is gone (a SIGKILL during a
    save leaves `.<name>.<pid>.<hex>.tmp`; the checkpoint itself is intact). Returns what was removed."""
    folder, base = os.path.split(os.path.abspath(_local_path(path)))
    removed = []
    prefix = f".{base}."
    for name in os.listdir(folder):
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        parts = name[len(prefix):-len(".tmp")].split(".")
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        pid = int(parts[0])
        if pid == os.getpid() or _alive(pid):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, name))
            removed.append(name)
    return removed


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose local saves are atomic (see the module docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        atomic_torch_save(checkpoint, path)
