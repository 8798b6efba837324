"""MLflow wiring: SQLite store under ./mlruns by default, run tags, params, artifacts.

Tracking URI: $MLFLOW_TRACKING_URI > logger.tracking_uri > sqlite:///<cwd>/mlruns/mlflow.db
(the `file:` store is refused by MLflow >= 3.13). New experiments get the artifact location
<cwd>/mlruns/artifacts (logger.artifact_location overrides) for local stores.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from omegaconf import OmegaConf


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
    """mixer, variant, knobs, model size, git commit + dirty flag, user tags, parent run."""
    mixer = OmegaConf.to_container(cfg.mixer, resolve=True)
    tags = {"mixer": str(mixer.get("name")), "model": str(cfg.model.get("name", "custom"))}
    if mixer.get("name") == "falcon":
        tags["variant"] = f"Falcon-{mixer.get('variant')}"
        tags["preset"] = str(mixer.get("preset"))
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


def build_logger(cfg):
    """Lightning's MLFlowLogger on the resolved store, or None when logger.name == none.
    Resuming from a checkpoint continues the checkpoint's MLflow run (same store)."""
    if cfg.logger.get("name", "mlflow") in (None, "none", False):
        return None
    from lightning.pytorch.loggers import MLFlowLogger

    uri = resolve_tracking_uri(cfg.logger)
    tags = run_tags(cfg)
    return MLFlowLogger(
        experiment_name=str(cfg.logger.experiment_name),
        run_name=cfg.logger.get("run_name") or tags.get("mlflow.runName") or default_run_name(tags),
        tracking_uri=uri,
        tags=tags,
        artifact_location=resolve_artifact_location(uri, cfg.logger),
        run_id=resume_run_id(cfg),
        log_model=False,
    )
