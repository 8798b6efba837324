"""MLflow wiring: SQLite store under ./mlruns by default, run tags, params, artifacts.

Tracking URI: $MLFLOW_TRACKING_URI > logger.tracking_uri > sqlite:///<cwd>/mlruns/mlflow.db
(the `file:` store is refused by MLflow >= 3.13). New experiments get the artifact location
<cwd>/mlruns/artifacts (logger.artifact_location overrides) for local stores.
"""
from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

from omegaconf import OmegaConf

log = logging.getLogger(__name__)


def resolve_tracking_uri(logger_cfg=None) -> str:
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    uri = (logger_cfg or {}).get("tracking_uri") if logger_cfg is not None else None
    if uri:
        return str(uri)
    db = Path.cwd() / "mlruns" / "mlflow.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db.resolve()}"


def resolve_artifact_location(uri: str, logger_cfg=None) -> str | None:
    loc = (logger_cfg or {}).get("artifact_location") if logger_cfg is not None else None
    if loc:
        return str(loc)
    if uri.startswith("sqlite:///"):
        root = Path(uri[len("sqlite:///"):]).parent / "artifacts"
        root.mkdir(parents=True, exist_ok=True)
        return root.resolve().as_uri()
    return None  # a server decides


def ui_command(uri: str) -> str:
    if uri.startswith("sqlite:"):
        return f"mlflow ui --backend-store-uri {uri}"
    return f"open {uri} in a browser"


def git_info() -> dict:
    """{"git_commit", "git_dirty"}. FALCON_COMMIT, when set, wins (ours): a tree shipped to another
    machine (e.g. a GPU box) may carry no .git, or a stale one that reports the wrong commit."""
    env = os.environ.get("FALCON_COMMIT", "").strip()
    if env:
        return {"git_commit": env, "git_dirty": "false"}
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
    except Exception:  # no git, or not a checkout (installed wheel)
        sha, dirty = "", False
    if not sha:
        return {"git_commit": "unknown", "git_dirty": "unknown"}
    return {"git_commit": sha, "git_dirty": str(dirty).lower()}


def flatten(d, prefix="") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def run_tags(cfg, extra: dict | None = None) -> dict:
    """mixer, variant, knobs, model size, git commit + dirty flag, user tags, parent run. Falcon knobs are the
    effective ones (the preset applied: knob.qk_norm=l2, not None); `preset` is the preset those knobs match
    (the ctx_eta arm of a `.1` config is `.2`), `preset.configured` the one written in the config, `label`
    the name compare shows (Falcon-1A.2)."""
    from falcon_lab.training.arms import effective_mixer, effective_preset, falcon_label

    mixer = effective_mixer(OmegaConf.to_container(cfg.mixer, resolve=True))
    tags = {"mixer": str(mixer.get("name")), "model": str(cfg.model.get("name", "custom"))}
    if mixer.get("name") == "falcon":
        tags["variant"] = f"Falcon-{mixer.get('variant')}"
        tags["preset"] = str(effective_preset(mixer) or "custom")
        tags["preset.configured"] = str(mixer.get("preset"))
        tags["label"] = falcon_label(mixer)
    else:
        tags["label"] = str(mixer.get("name"))
    for k, v in mixer.items():
        if k != "name":
            tags[f"knob.{k}"] = str(v)
    tags["data"] = f"{cfg.data.get('name')}:{cfg.data.get('source', '')}"
    tags.update(git_info())
    user = cfg.logger.get("tags") or {}
    tags.update({str(k): str(v) for k, v in OmegaConf.to_container(user, resolve=True).items()} if user else {})
    if cfg.logger.get("parent_run_id"):
        tags["mlflow.parentRunId"] = str(cfg.logger.parent_run_id)
    if extra:
        tags.update({k: str(v) for k, v in extra.items()})
    return tags


def resume_run_id(cfg) -> str | None:
    """The MLflow run to continue: logger.run_id, else the run recorded in ckpt_path (same store only)."""
    if cfg.logger.get("run_id"):
        return str(cfg.logger.run_id)
    ck = cfg.get("ckpt_path")
    if not ck or not Path(str(ck)).is_file():
        return None
    from falcon_lab.training.validate import load_checkpoint_safely

    meta = load_checkpoint_safely(ck, "ckpt_path", mmap=True).get("falcon_lab") or {}
    rid, uri = meta.get("mlflow_run_id"), meta.get("tracking_uri")
    if not rid or uri != resolve_tracking_uri(cfg.logger):
        return None
    try:
        import mlflow

        mlflow.MlflowClient(uri).get_run(rid)
    except Exception:  # deleted run, or another store: start a new run
        return None
    return rid


def default_run_name(tags: dict) -> str:
    """<mixer>[-<variant>]-<time>-<4 hex>: MLflow's own random name comes from Python's `random`, which the
    run has just seeded, so every run with the same seed got the same name. uuid4 reads os.urandom."""
    import time
    import uuid

    what = tags.get("variant", "").removeprefix("Falcon-") if tags.get("mixer") == "falcon" else ""
    parts = [tags.get("mixer", "run"), what, time.strftime("%Y%m%d-%H%M%S"), uuid.uuid4().hex[:4]]
    return "-".join(p for p in parts if p)


def _is_transient(exc: BaseException) -> bool:
    """A store that is locked (SQLite `database is locked`) or momentarily unavailable: worth retrying."""
    import sqlite3

    seen = set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        msg = str(e).lower()
        if "database is locked" in msg or "database table is locked" in msg or "temporarily_unavailable" in msg:
            return True
        if isinstance(e, sqlite3.OperationalError) and "locked" in msg:
            return True
        try:
            from sqlalchemy.exc import OperationalError as SAOperationalError

            if isinstance(e, SAOperationalError) and "locked" in msg:
                return True
        except ImportError:  # pragma: no cover
            pass
        try:
            from mlflow.exceptions import MlflowException

            if isinstance(e, MlflowException) and getattr(e, "error_code", "") == "TEMPORARILY_UNAVAILABLE":
                return True
        except ImportError:  # pragma: no cover
            pass
        e = e.__cause__ or e.__context__
    return False


def _retry(fn, budget_s: float, what: str = ""):
    """fn() until it succeeds, retrying transient store errors with exponential backoff (0.25 s, 0.5 s, ... at
    most 5 s) for at most `budget_s` seconds in all (an attempt that is under way when the budget runs out
    finishes; SQLite itself waits up to its busy timeout inside each attempt). The last transient error is raised."""
    import time

    t0, delay = time.monotonic(), 0.25
    while True:
        try:
            return fn()
        except Exception as e:
            if not _is_transient(e):
                raise
            left = budget_s - (time.monotonic() - t0)
            if left <= 0:
                raise
            time.sleep(min(delay, left))
            delay = min(2 * delay, 5.0)


def _retrying_logger_cls():
    from lightning.pytorch.loggers import MLFlowLogger
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    class RetryingMLFlowLogger(MLFlowLogger):
        """MLFlowLogger whose metric logging survives a store that is locked or unreachable for a while.

        log_metrics retries for `retry_s` seconds (backoff); if the store still does not answer, the metrics
        stay in memory, one warning is issued, and training goes on. Buffered metrics (with their original
        steps and timestamps) are written at the next call once the store answers (a new attempt at most every
        `retry_s` seconds, so a dead store does not stall every step), and at the latest by finalize, which
        also retries ending the run. `killed` (set on Ctrl-C) makes finalize end the run KILLED."""

        def __init__(self, *args, retry_s: float = 30.0, **kwargs):
            super().__init__(*args, **kwargs)
            self.retry_s = float(retry_s)
            self.killed = False
            self._pending: list = []
            self._next_try = 0.0  # monotonic time of the next attempt while the store is unavailable
            self._warned = False

        @property
        def pending_metrics(self) -> int:
            return len(self._pending)

        @rank_zero_only
        def log_metrics(self, metrics, step=None) -> None:
            import re
            import time

            from lightning.fabric.utilities.logger import _add_prefix
            from mlflow.entities import Metric

            metrics = _add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR)
            ts = int(time.time() * 1000)
            for k, v in metrics.items():
                if isinstance(v, str):
                    continue
                k = re.sub("[^a-zA-Z0-9_/. -]+", "", k)
                self._pending.append(Metric(key=k, value=float(v), timestamp=ts, step=step or 0))
            if self._next_try and time.monotonic() < self._next_try:
                return  # the store was unavailable moments ago: keep buffering, try again later
            self._flush(self.retry_s if not self._next_try else 0.0)

        def _flush(self, budget_s: float) -> bool:
            """Write the buffered metrics; False (and keep them) when the store stays unavailable."""
            import time
            import warnings

            if not self._pending:
                return True
            client, run_id = self.experiment, self.run_id
            try:
                while self._pending:
                    chunk = self._pending[:1000]  # MLflow's per-call limit

                    def write(chunk=chunk):
                        client.log_batch(run_id=run_id, metrics=chunk, **self._log_batch_kwargs)

                    _retry(write, budget_s)
                    del self._pending[:len(chunk)]
            except Exception as e:
                if not _is_transient(e):
                    raise
                self._next_try = time.monotonic() + max(self.retry_s, 1.0)
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"MLflow store unavailable ({str(e).splitlines()[0][:160]}); metrics are kept in "
                                  f"memory and written when it answers again (run {run_id}); training goes on",
                                  UserWarning, stacklevel=2)
                return False
            if self._next_try:
                log.info("MLflow store answers again: buffered metrics written to run %s", run_id)
            self._next_try = 0.0
            return True

        @rank_zero_only
        def finalize(self, status: str = "success") -> None:
            if not self._initialized:
                return
            names = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
            status = names.get(status, status)
            if self.killed:
                status = "KILLED"
            if not self._flush(self.retry_s):
                log.warning("MLflow store still unavailable after %.0f s; %d metric values of run %s "
                            "could not be written", self.retry_s, len(self._pending), self.run_id)
                self._pending.clear()
            if self._checkpoint_callback:
                self._scan_and_log_checkpoints(self._checkpoint_callback)
            try:
                _retry(lambda: self.experiment.set_terminated(self.run_id, status), self.retry_s)
            except Exception as e:
                if not _is_transient(e):
                    raise
                log.warning("could not mark MLflow run %s %s: %s", self.run_id, status,
                            str(e).splitlines()[0][:160])

    return RetryingMLFlowLogger


def build_logger(cfg):
    """A RetryingMLFlowLogger (Lightning's MLFlowLogger that survives a locked store for logger.retry_s seconds,
    then buffers metrics) on the resolved store, or None when logger.name == none. Resuming from a checkpoint
    continues the checkpoint's MLflow run (same store)."""
    if cfg.logger.get("name", "mlflow") in (None, "none", False):
        return None
    uri = resolve_tracking_uri(cfg.logger)
    tags = run_tags(cfg)
    return _retrying_logger_cls()(
        experiment_name=str(cfg.logger.experiment_name),
        run_name=cfg.logger.get("run_name") or tags.get("mlflow.runName") or default_run_name(tags),
        tracking_uri=uri,
        tags=tags,
        artifact_location=resolve_artifact_location(uri, cfg.logger),
        run_id=resume_run_id(cfg),
        log_model=False,
        retry_s=float(cfg.logger.get("retry_s", 30) or 0),
    )
