"""Optuna storage for sweeps: where studies live, worker heartbeats, and stale-trial recovery.

Storage strings (the ``storage=`` argument of ``python -m falcon_lab.sweep``):

- nothing: ``sqlite:///<cwd>/sweeps/optuna.db`` (one host; every study of the folder in one file)
- ``sqlite:///PATH``, ``postgresql://...``, ``mysql://...``: an Optuna RDB storage (several hosts:
  a server database)
- ``journal:PATH`` or a path ending in ``.log`` / ``.journal``: Optuna's ``JournalFileBackend``
  (several hosts on a shared file system, no database server)

Stale trials (ours). Each worker stamps its trial with its host, pid and a heartbeat (a trial
system attribute refreshed every ``heartbeat`` seconds by a background thread). A RUNNING trial is
stale when its worker's pid is gone on this host, or its heartbeat is older than ``grace`` seconds
(any host). Before asking for a new trial, a worker marks stale trials FAILED (reason in the
trial's user attribute ``fail_reason``) and re-enqueues their parameters once more (up to
``max_retry`` times), so a trial killed mid-run is run again with the same parameters while
finished trials are never redone. The budget counts COMPLETE + PRUNED trials only.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

HEARTBEAT_ATTR = "falcon_lab:heartbeat"
HOST_ATTR = "falcon_lab:host"
PID_ATTR = "falcon_lab:pid"
RETRY_ATTR = "falcon_lab:retry_of"      # number of the original trial a retry repeats
RETRY_FROM_ATTR = "falcon_lab:retry_from"  # number of the failed trial it replaces (resume source)


class StorageError(ValueError):
    pass


def default_storage(workdir: str | Path | None = None) -> str:
    root = Path(workdir or os.getcwd()).resolve() / "sweeps"
    return f"sqlite:///{root / 'optuna.db'}"


def resolve_storage(spec: str | None, workdir: str | Path | None = None) -> str:
    """Normalise a ``storage=`` string; relative paths are taken under the working directory."""
    if spec in (None, "", "default"):
        return default_storage(workdir)
    spec = str(spec)
    base = Path(workdir or os.getcwd()).resolve()
    if spec.startswith("sqlite:///"):
        path = spec[len("sqlite:///"):]
        if path and path != ":memory:" and not os.path.isabs(path):
            path = str(base / path)
        return f"sqlite:///{path}"
    if spec.startswith("journal:") or spec.endswith((".log", ".journal")):
        path = spec[len("journal:"):] if spec.startswith("journal:") else spec
        if not path:
            raise StorageError("storage=journal:PATH: the journal file path is missing")
        return "journal:" + str((base / path).resolve())
    if "://" in spec.split("?")[0] and spec.split("://")[0].split("+")[0] in (
            "postgresql", "postgres", "mysql", "mariadb", "oracle", "mssql"):
        return spec
    raise StorageError(
        f"storage={spec}: not understood; use sqlite:///PATH.db, postgresql://..., mysql://..., "
        f"or journal:PATH (a journal file on a shared file system)")


def open_storage(url: str):
    """An Optuna storage object for a resolved storage string (creates folders and tables)."""
    import optuna

    if url.startswith("journal:"):
        path = Path(url[len("journal:"):])
        path.parent.mkdir(parents=True, exist_ok=True)
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    kwargs: dict = {}
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///"):]
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # several worker processes write one SQLite file: wait for the lock instead of failing
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 120}}
    return _open_rdb(url, kwargs)


def _open_rdb(url: str, kwargs: dict, tries: int = 5):
    """``RDBStorage`` that survives a schema-creation race on a new database.

    Two processes opening one new SQLite file at once (two sweeps started together, or a sweep and
    an observer such as ``optuna-dashboard``) both try to stamp Optuna's schema version; the loser
    gets ``UNIQUE constraint failed: alembic_version...`` or ``table ... already exists``. By then
    the winner has created the schema, so opening again succeeds (ours)."""
    import optuna
    import sqlalchemy.exc

    for attempt in range(tries):
        try:
            return optuna.storages.RDBStorage(url, **kwargs)
        except (ModuleNotFoundError, sqlalchemy.exc.NoSuchModuleError) as e:
            scheme = url.split("://", 1)[0]
            raise ValueError(f"storage: {describe(url)!r} needs a database driver for {scheme!r} that is not "
                             f"installed ({type(e).__name__}: {e}); install it (e.g. psycopg2-binary for "
                             "postgresql, PyMySQL for mysql+pymysql) or use sqlite:///PATH or journal:PATH") from None
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError) as e:
            msg = str(e)
            racing = "already exists" in msg or "UNIQUE constraint failed" in msg
            if not racing or attempt == tries - 1:
                raise
            time.sleep(0.2 * (attempt + 1))


def describe(url: str) -> str:
    """The storage string with any password hidden (for logs and MLflow tags)."""
    if "://" in url and "@" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    return url


# ---- heartbeats ----------------------------------------------------------------------------------
class Heartbeat:
    """Stamp a RUNNING trial with host/pid and refresh its heartbeat in a daemon thread.

    ``storage`` is the Optuna storage object the sweep opened; ``trial_id`` the trial's id in it
    (:meth:`falcon_lab.sweeps.study.SweepStudy.trial_id`)."""

    def __init__(self, storage, trial_id: int, interval: float) -> None:
        self.storage = storage
        self.trial_id = trial_id
        self.interval = max(0.2, float(interval))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sweep-heartbeat", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self.storage.set_trial_system_attr(self.trial_id, HOST_ATTR, socket.gethostname())
        self.storage.set_trial_system_attr(self.trial_id, PID_ATTR, os.getpid())
        self._beat()
        self._thread.start()
        return self

    def _beat(self) -> None:
        self.storage.set_trial_system_attr(self.trial_id, HEARTBEAT_ATTR, time.time())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # the trial finished meanwhile, or a transient lock: try again
                pass

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (killed, not yet reaped) is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def stale_reason(trial, grace: float, now: float | None = None) -> str | None:
    """Why a RUNNING trial is stale, or None if its worker looks alive."""
    now = time.time() if now is None else now
    attrs = trial.system_attrs
    host, pid = attrs.get(HOST_ATTR), attrs.get(PID_ATTR)
    if host == socket.gethostname() and pid is not None and not _pid_alive(int(pid)):
        return f"worker pid {pid} on {host} is gone"
    beat = attrs.get(HEARTBEAT_ATTR)
    if beat is None and trial.datetime_start is not None:
        beat = trial.datetime_start.timestamp()
    if beat is not None and now - float(beat) > grace:
        return f"no heartbeat for {now - float(beat):.0f} s (grace {grace:.0f} s; worker {host}:{pid})"
    return None


def recover_stale(sweep, grace: float, max_retry: int = 2) -> list[int]:
    """Fail stale RUNNING trials and re-enqueue their parameters; returns the failed numbers.

    ``sweep``: a :class:`falcon_lab.sweeps.study.SweepStudy` (the study, and the storage it is in)."""
    import optuna
    from optuna.trial import TrialState

    study, storage = sweep.study, sweep.storage
    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        reason = stale_reason(t, grace)
        if reason is None:
            continue
        try:
            tid = sweep.trial_id(t.number)
            storage.set_trial_user_attr(tid, "fail_reason", f"stale: {reason}")
            if not storage.set_trial_state_values(tid, state=TrialState.FAIL):
                continue
        except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError):
            continue  # another worker (or the owner itself) got there first
        failed.append(t.number)
        origin = t.system_attrs.get(RETRY_ATTR, t.number)
        retries = sum(1 for u in study.get_trials(deepcopy=False)
                      if u.system_attrs.get(RETRY_ATTR) == origin)
        if t.params and retries < max_retry:
            study.add_trial(optuna.trial.create_trial(
                state=TrialState.WAITING, params=t.params, distributions=t.distributions,
                system_attrs={RETRY_ATTR: origin, RETRY_FROM_ATTR: t.number}))
    return failed


def counts(study) -> dict[str, int]:
    out = {"COMPLETE": 0, "PRUNED": 0, "FAIL": 0, "RUNNING": 0, "WAITING": 0}
    for t in study.get_trials(deepcopy=False):
        out[t.state.name] = out.get(t.state.name, 0) + 1
    return out
