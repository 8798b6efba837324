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


# the data keys that matter for each source of data=lm (name, source, tokenizer, seq_len, batch sizes are logged
# for every source); other data modules (mqar, addition) log all their keys but the loader plumbing
LM_SOURCE_KEYS = {
    "kjv": (),
    "text": ("path", "val_path", "sample_by"),
    "jsonl": ("path", "val_path", "text_field"),
    "hf": ("path", "val_path", "hf_name", "hf_config", "train_split", "val_split", "text_column", "sample_by"),
    "fineweb": ("hf_name", "hf_config", "text_field", "max_tokens"),
}
LM_COMMON_KEYS = ("name", "source", "tokenizer", "seq_len", "batch_size", "global_batch_size", "doc_boundary",
                  "cu_seqlens", "val_percent", "max_tokens")
DATA_PLUMBING = ("num_workers", "val_batch_size", "cache_dir")
MODEL_PLUMBING = ("compile", "activation_checkpointing", "loss_impl")  # speed and memory, not the result
TRAINER_PARAMS = ("max_steps", "precision", "devices", "num_nodes")
OPTIM_PLUMBING = ("fused",)
MIXER_PLUMBING = ("backend", "module_backend", "recompute", "chunk_size")  # kernels and memory, not the model
# Falcon knobs that only act under another knob's value (falcon_config.FalconConfig._check_applicability): a param
# that does nothing in a run is left out of its params (its tag knob.<name> still records it)
FALCON_APPLIES = {
    "lam_value": lambda m: m.get("lam") == "const",
    "lam_scale": lambda m: m.get("lam") == "ctx" and m.get("lam_mode") == "scaled",
    "lam_init_bias": lambda m: m.get("lam") == "ctx",
    "lam_mode": lambda m: m.get("lam") not in ("off", None),
    "beta_max": lambda m: m.get("gate") == "ctx_beta",
    "eta_max": lambda m: m.get("gate") == "ctx_eta",
    "eps": lambda m: m.get("gate") == "ctx_beta",
}


def run_params(cfg, accumulate: int | None = None, world_size: int | None = None) -> dict:
    """The MLflow params of a training run: the settings that decide its result, flattened, and only those (the
    full resolved config is the run's `config.yaml` artifact). Model and mixer knobs (Falcon knobs effective: the
    preset applied), optim, the data keys of the configured source (no `data.hf_name` on a KJV run), seed, and
    trainer max_steps / precision / devices / num_nodes; no kernel or memory switches, no knob that does nothing
    under the others (Falcon's lam_value without lam=const, ...). `accumulate` and `world_size`, when given, are
    the run's effective gradient accumulation and number of ranks (with the global batch they give)."""
    from falcon_lab.training.arms import effective_mixer

    d = OmegaConf.to_container(cfg, resolve=True)
    out = {"seed": d.get("seed")}
    model = {k: v for k, v in (d.get("model") or {}).items() if k not in MODEL_PLUMBING}
    out.update(flatten(model, "model."))
    mixer = effective_mixer(d.get("mixer") or {})
    mixer = {k: v for k, v in mixer.items() if k not in MIXER_PLUMBING and
             (mixer.get("name") != "falcon" or FALCON_APPLIES.get(k, lambda m: True)(mixer))}
    out.update(flatten(mixer, "mixer."))
    out.update(flatten({k: v for k, v in (d.get("optim") or {}).items() if k not in OPTIM_PLUMBING}, "optim."))
    data = d.get("data") or {}
    if data.get("name") == "lm":
        keys = LM_COMMON_KEYS + LM_SOURCE_KEYS.get(str(data.get("source")), tuple(data))
        if data.get("tokenizer") == "bpe":
            keys += ("bpe_vocab_size",)
        data = {k: data[k] for k in keys if k in data and (data[k] is not None or k in LM_COMMON_KEYS)}
    else:
        data = {k: v for k, v in data.items() if k not in DATA_PLUMBING}
    out.update(flatten(data, "data."))
    trainer = d.get("trainer") or {}
    out.update({f"trainer.{k}": trainer.get(k) for k in TRAINER_PARAMS if k in trainer})
    if accumulate is not None:
        out["trainer.accumulate_grad_batches"] = int(accumulate)
    else:
        out["trainer.accumulate_grad_batches"] = trainer.get("accumulate_grad_batches") or 1
    if world_size is not None:
        out["trainer.world_size"] = int(world_size)
        if accumulate is not None:
            out["data.global_batch_size"] = int(data.get("batch_size") or 0) * int(world_size) * int(accumulate)
    return {k: ("null" if v is None else v) for k, v in out.items()}


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
        also retries ending the run. `killed` (set on Ctrl-C and SIGTERM) makes finalize end the run KILLED.
        `requeue_pending` (set around Lightning's SLURM requeue handler, see training.api._keep_run_open_on_requeue)
        makes its finalize("finished") write the buffered metrics and leave the run open (RUNNING): the requeued
        job continues it."""

        def __init__(self, *args, retry_s: float = 30.0, **kwargs):
            super().__init__(*args, **kwargs)
            self.retry_s = float(retry_s)
            self.killed = False
            self.requeue_pending = False
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
            if self.requeue_pending and not self.killed and status == "finished":
                # Lightning's SLURM requeue handler: the job is about to be requeued, the run goes on there
                if not self._flush(self.retry_s):
                    log.warning("MLflow store unavailable at the SLURM requeue; %d metric values of run %s are kept "
                                "in memory", len(self._pending), self.run_id)
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


# ---- how the MLflow UI opens an experiment (issue 17, point 5) ----------------------------------------------
# MLflow 3's UI (before 3.17) reads the experiment tag `mlflow.experimentKind` (mlflow/server/js: ExperimentKind) to
# choose the experiment's first view: `genai_development` opens on the GenAI traces overview,
# `custom_model_development` ("Machine learning") on the runs table. An experiment without the tag is guessed, and a
# fresh one lands on the GenAI overview; training runs belong in the runs table, so the tag is written. Checked in
# headless Chromium (docs/mlflow.md), MLflow 3.17's UI no longer decides the first view by the tag: a global
# "GenAI | Model training" switch does, kept per browser (local storage `mlflow.workflowType`, default GenAI) and
# overridden by the URL parameter `workflowType=machine_learning`. So the address the platform gives (view_url with
# workflow=UI_WORKFLOW) carries that parameter.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
UI_WORKFLOW_PARAM = "workflowType"  # the UI's URL parameter: genai | machine_learning
UI_WORKFLOW = "machine_learning"  # "Model training": the runs table, the training sidebar
# The UI keeps each user's column choice in the browser (local storage); there is no server-side default column
# set. What it does read from the store is a *shared view*: the experiment tag `mlflow.sharedViewState.<key>`
# (a JSON view state), opened by the URL <ui>/#/experiments/<id>/runs?viewStateShareKey=<key>.
SHARED_VIEW_PREFIX = "mlflow.sharedViewState."
VIEW_KEY = "falcon-lab-runs"
VIEW_METRICS = ("val/loss_best", "val/loss", "val/ppl", "train/loss", "train/tokens_per_s")
VIEW_TAGS = ("label", "arm", "steps", "params_total")
VIEW_PARAMS = ("seed", "model.name", "data.source", "data.seq_len", "optim.lr")


def _col(kind: str, key: str) -> str:
    return f"{kind}.`{key}`"  # the UI's column id (makeCanonicalSortKey)


def view_state(metrics=VIEW_METRICS, tags=VIEW_TAGS, params=VIEW_PARAMS, order_by: str = "val/loss_best",
               ascending: bool = True) -> dict:
    """A runs-table view state (the UI's JSON): these tag, metric and param columns, ordered by one metric."""
    cols = ([_col("tags", t) for t in tags] +
            [_col("metrics", m) for m in metrics] + [_col("params", p) for p in params])
    return {"selectedColumns": cols, "columnOrder": cols, "orderByKey": _col("metrics", order_by),
            "orderByAsc": ascending, "runsHiddenMode": "SHOW_ALL"}


def default_view_state() -> dict:
    """The runs-table view the platform shares: run name, label/arm/steps, the metrics and the few params that tell
    runs apart, ordered by val/loss_best (the lowest validation loss of each run; best run first)."""
    return view_state()


def share_view(client, experiment_id: str, key: str, state: dict) -> bool:
    """Add the shared view `key` to an experiment unless it has one by that name (a view changed in the UI stays).
    Opened by view_url(..., view=key). Returns whether it was written."""
    import json

    tags = client.get_experiment(experiment_id).tags or {}
    if SHARED_VIEW_PREFIX + key in tags:
        return False
    client.set_experiment_tag(experiment_id, SHARED_VIEW_PREFIX + key, json.dumps(state))
    return True


def view_url(tracking_uri: str, experiment_id: str, base: str = "http://127.0.0.1:5000",
             workflow: str | None = UI_WORKFLOW, view: str = VIEW_KEY) -> str:
    """The UI address of the shared runs view (`mlflow ui` serves on 127.0.0.1:5000 by default; a server's own
    address when tracking over HTTP). `workflow` (default UI_WORKFLOW) also switches MLflow >= 3.17's UI to
    "Model training", whose default would otherwise be the GenAI workflow; None leaves the parameter out."""
    if tracking_uri.startswith(("http://", "https://")):
        base = tracking_uri.rstrip("/")
    query = f"{UI_WORKFLOW_PARAM}={workflow}&" if workflow else ""
    return f"{base}/#/experiments/{experiment_id}/runs?{query}viewStateShareKey={view}"


def prepare_experiment(client, experiment_id: str) -> None:
    """Tag an experiment the platform logs training runs to: the kind (opens on the runs table) and the shared
    default view. Either is left alone when already set, so a kind or view changed in the UI stays."""
    tags = client.get_experiment(experiment_id).tags or {}
    if EXPERIMENT_KIND_TAG not in tags:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    share_view(client, experiment_id, VIEW_KEY, default_view_state())
