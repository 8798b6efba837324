"""`run(cfg)`: build data, model, logger and trainer from a config and fit. Called by fit.py and the
sweep driver. `load_checkpoint(path)`: (model, tokenizer, cfg) for evaluation."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from falcon_lab.training.validate import ConfigError, load_checkpoint_safely, validate_config

log = logging.getLogger(__name__)

TRAINER_KEYS = ("accelerator", "devices", "num_nodes", "strategy", "precision", "max_steps",
                "val_check_interval", "limit_val_batches", "limit_train_batches", "log_every_n_steps",
                "accumulate_grad_batches", "enable_progress_bar", "deterministic", "num_sanity_val_steps",
                "benchmark", "detect_anomaly", "fast_dev_run", "overfit_batches")


def _run_dir(cfg) -> Path:
    if cfg.get("run_dir"):
        return Path(str(cfg.run_dir)).expanduser().resolve()
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    return (Path.cwd() / "outputs" / str(cfg.logger.experiment_name) / f"{stamp}_{os.getpid()}").resolve()


def _trainer_kwargs(cfg) -> dict:
    t = OmegaConf.to_container(cfg.trainer, resolve=True)
    kw = {k: t[k] for k in TRAINER_KEYS if k in t and t[k] is not None}
    if kw.get("strategy") == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from falcon_lab.models.decoder import Block
        kw["strategy"] = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full")
    elif kw.get("strategy") == "fsdp2":  # torch fully_shard per block; also on CPU (trainer=fsdp_cpu)
        from falcon_lab.training.fsdp import FSDP2Strategy

        kw["strategy"] = FSDP2Strategy()
    return kw


def _set_accumulation(cfg, trainer) -> int:
    """trainer.accumulate_grad_batches from data.global_batch_size and the trainer's world size (devices x
    num_nodes, as Lightning resolved them: torchrun / SLURM included); ConfigError with the arithmetic when it
    does not divide. Without a global batch, the configured accumulation."""
    from falcon_lab.training.validate import derive_accumulation

    gb = cfg.data.get("global_batch_size")
    accum = derive_accumulation(gb, int(cfg.data.batch_size), int(trainer.world_size),
                                cfg.trainer.get("accumulate_grad_batches"), int(trainer.num_nodes or 1))
    trainer.accumulate_grad_batches = accum
    if gb is not None and trainer.global_rank == 0:
        log.info("global batch %d sequences = %d per device x %d ranks x %d accumulation", int(gb),
                 int(cfg.data.batch_size), int(trainer.world_size), accum)
    return accum


def _check_devices(cfg) -> None:
    """A GPU trainer on a machine without CUDA fails here, naming the key (Lightning's own message,
    "No supported gpu backend found!", names none)."""
    acc = str(cfg.trainer.get("accelerator", "auto"))
    if acc in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(f"trainer.accelerator={acc}: no CUDA device is visible on this machine; use trainer=cpu "
                         "(multi-process on CPU: trainer=ddp trainer.accelerator=cpu, or trainer=fsdp_cpu)")


def _norm_key(k: str) -> str:
    """A state_dict key without the wrappers torch.compile / activation checkpointing / FSDP insert."""
    for w in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        k = k.replace(w, "")
    return k


def check_ckpt_fits(path, module, cfg) -> int:
    """Resuming from `path` must fit the configured model: every tensor present with the same shape. Checked
    before the MLflow run is touched, so that a resume that cannot work leaves the run it came from (often a
    FINISHED one) exactly as it was. ConfigError naming ckpt_path and the model settings that differ; else the
    checkpoint's global_step."""
    ck = load_checkpoint_safely(path, "ckpt_path", mmap=True)
    got = {_norm_key(k): tuple(v.shape) for k, v in (ck.get("state_dict") or {}).items() if hasattr(v, "shape")}
    want = {_norm_key(k): tuple(v.shape) for k, v in module.state_dict().items()}
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    shape = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    if not (missing or extra or shape):
        return int(ck.get("global_step") or 0)
    what = []
    if shape:
        k = shape[0]
        what.append(f"{len(shape)} tensors differ in shape "
                    f"(e.g. {k}: checkpoint {list(got[k])}, model {list(want[k])})")
    if missing:
        what.append(f"{len(missing)} tensors of the model are not in it (e.g. {missing[0]})")
    if extra:
        what.append(f"{len(extra)} tensors in it are not in the model (e.g. {extra[0]})")
    hint = ""
    old = ((ck.get("hyper_parameters") or {}).get("cfg") or {}) if isinstance(ck.get("hyper_parameters"), dict) else {}
    if isinstance(old, dict):
        now = OmegaConf.to_container(cfg, resolve=True)
        diffs = []
        for group in ("model", "mixer"):
            a, b = old.get(group) or {}, now.get(group) or {}
            for key in sorted(set(a) | set(b)):
                if key not in ("compile", "activation_checkpointing", "loss_impl") and a.get(key) != b.get(key):
                    diffs.append(f"{group}.{key}: checkpoint {a.get(key)!r}, now {b.get(key)!r}")
        if diffs:
            hint = "; settings that differ: " + ", ".join(diffs[:8])
    raise ConfigError(f"ckpt_path: {str(path)!r} does not fit the configured model: {'; '.join(what)}{hint}. "
                      "Resume with the checkpoint's model settings (nothing was changed in its MLflow run)")


def _save_on_interrupt(path, logger):
    """A callback: Ctrl-C (KeyboardInterrupt) during fit writes <run_dir>/checkpoints/last.ckpt at the current
    step (resume from it with ckpt_path=) and has the MLflow run end KILLED rather than FAILED. SIGTERM (scancel,
    preemption, SLURM ending a job it requeues; Lightning raises SIGTERMException) also ends the run KILLED, and
    saves last.ckpt in a single-process run (with several ranks a save is collective and the ranks may not all
    have stopped at the same step: the requeue checkpoint hpc_ckpt_<n>.ckpt and checkpoint.every_n_steps cover
    them)."""
    import lightning as L
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    class SaveOnInterrupt(L.Callback):
        def __init__(self, path, logger):
            self.path, self.logger = Path(path), logger
            self.started = self.interrupted = self.terminated = False

        def on_train_start(self, trainer, pl_module):
            self.started = True  # after a resume has restored its state: saving now cannot lose progress

        def on_exception(self, trainer, pl_module, exception):
            term = isinstance(exception, SIGTERMException)
            if not (isinstance(exception, KeyboardInterrupt) or term):
                return
            if term:
                self.terminated = True
            else:
                self.interrupted = True
            if self.logger is not None:
                self.logger.killed = True
            if not self.started or (term and trainer.world_size > 1):
                return
            try:
                trainer.save_checkpoint(str(self.path))
                log.info("interrupted at step %d: saved %s (resume with ckpt_path=%s)",
                         trainer.global_step, self.path, self.path)
            except Exception as e:  # the interrupt must still end the run
                log.warning("interrupted, but could not save %s: %s", self.path, e)

    return SaveOnInterrupt(path, logger)


def _keep_run_open_on_requeue(trainer, logger) -> None:
    """SLURM requeue (SIGUSR1 from `#SBATCH --signal`, Lightning's SLURMEnvironment auto-requeue): Lightning's
    handler calls `logger.finalize("finished")`, saves <run_dir>/hpc_ckpt_<n>.ckpt and runs `scontrol requeue`;
    SLURM then SIGTERMs the job and starts it again, and the requeued job resumes the checkpoint and continues the
    same MLflow run. So the run must not be closed there: the logger is told (requeue_pending) that this finalize
    is a requeue, writes its buffered metrics and leaves the run RUNNING; the run gets the tags
    `slurm.requeues` (how many) and `slurm.requeue_step`. The SIGTERM that follows ends it KILLED (not FAILED)
    until the requeued job sets it RUNNING again. Wraps Lightning's handler (a private attribute of the trainer's
    signal connector; tests/test_mlflow_requeue.py fails if Lightning renames it)."""
    sc = getattr(trainer, "_signal_connector", None)
    orig = getattr(sc, "_slurm_sigusr_handler_fn", None)
    if logger is None or orig is None:
        return

    def requeue_handler(signum, frame):
        logger.requeue_pending = True
        try:
            orig(signum, frame)
        finally:
            logger.requeue_pending = False
        if trainer.is_global_zero:
            try:
                client, rid = logger.experiment, logger.run_id
                n = int(client.get_run(rid).data.tags.get("slurm.requeues", "0")) + 1
                client.set_tag(rid, "slurm.requeues", str(n))
                client.set_tag(rid, "slurm.requeue_step", str(int(trainer.global_step)))
                log.info("SLURM requeue at step %d: MLflow run %s stays open for the requeued job", trainer.global_step,
                         rid)
            except Exception as e:  # the requeue itself must go on
                log.warning("could not tag the MLflow run for the requeue: %s", str(e)[:200])

    sc._slurm_sigusr_handler_fn = requeue_handler


def _slurm_resume_path(run_dir: Path) -> str | None:
    """Under SLURM, Lightning resumes a run without ckpt_path from the newest <run_dir>/hpc_ckpt_<n>.ckpt (its
    requeue checkpoint) on its own; the newest of that and checkpoints/last.ckpt, so that the MLflow run is continued
    too (resume_run_id reads it from ckpt_path). None outside SLURM or without such a checkpoint."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return None
    found = list(run_dir.glob("hpc_ckpt_*.ckpt"))
    if not found:
        return None
    last = run_dir / "checkpoints" / "last.ckpt"
    if last.is_file():
        found.append(last)
    return str(max(found, key=lambda p: p.stat().st_mtime))


def resolve_compile(value, accelerator: str) -> bool:
    """model.compile=auto (the default): torch.compile the blocks when training on CUDA, the same for
    every mixer; eager on CPU, where compiling costs more than it saves on the tiny models run there."""
    if value == "auto":
        return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return bool(value)


def run(cfg: DictConfig, callbacks=None) -> dict:
    """Train one configuration. Returns {"val_loss" (best), "final_val_loss", "run_id", "ckpt_path",
    "last_ckpt_path", "run_dir", "tracking_uri", "experiment_id", "steps", "metrics", "history"}."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from falcon_lab.data import build_datamodule
    from falcon_lab.data.corpus import kjv_sentences
    from falcon_lab.training.callbacks import (
        MetricHistory,
        TextProgress,
        ThroughputMFU,
        ValidateAtEnd,
        device_peak_flops,
        plot_curves,
        progress_bar_wanted,
    )
    from falcon_lab.training.checkpoint_io import AtomicCheckpointIO
    from falcon_lab.training.mlflow import build_logger, prepare_experiment, resolve_tracking_uri
    from falcon_lab.training.module import LitLM

    validate_config(cfg)
    _check_devices(cfg)
    run_dir = _run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.trainer.get("cpu_threads"):
        torch.set_num_threads(int(cfg.trainer.cpu_threads))
    torch.set_float32_matmul_precision(str(cfg.get("matmul_precision", "high")))
    L.seed_everything(int(cfg.seed), workers=True, verbose=False)

    dm = build_datamodule(cfg.data, seed=int(cfg.seed))
    tokenizer = dm.tokenizer
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    cfg_dict["model"]["compile"] = resolve_compile(cfg_dict["model"].get("compile", "auto"),
                                                   str(cfg.trainer.get("accelerator", "auto")))
    tok_state = tokenizer.state() if hasattr(tokenizer, "state") else {"name": getattr(tokenizer, "name", "byte")}
    module = LitLM(cfg_dict, vocab_size=tokenizer.vocab_size, tokenizer_name=tok_state)
    module.tokenizer = tokenizer
    checks = cfg.get("checks") or {}
    if checks.get("shuffle", True) and cfg.data.name == "lm" and cfg.data.get("source", "kjv") == "kjv":
        module.check_sentences = kjv_sentences("validation")[: int(checks.get("n_sentences", 64))]

    ckpt_path = cfg.get("ckpt_path") or None
    if ckpt_path is None and (found := _slurm_resume_path(run_dir)) is not None:  # a requeued SLURM job
        log.info("SLURM: resuming from %s (the newest requeue checkpoint of %s)", found, run_dir)
        ckpt_path = found
        with open_dict(cfg):
            cfg.ckpt_path = found  # so that the MLflow run of the checkpoint is continued
    ckpt_step = None
    if ckpt_path and ckpt_path != "last":  # before the MLflow run is touched (issue 16)
        ckpt_step = check_ckpt_fits(ckpt_path, module, cfg)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    logger = build_logger(cfg)
    # a resume continues an existing run: remember how it stood, so that a resume that fails before training a
    # single step (the checkpoint's state could not be restored) leaves it as it was
    before = _run_snapshot(logger) if logger is not None and logger._run_id is not None else None
    tkw = _trainer_kwargs(cfg)
    history = MetricHistory()
    ck = cfg.get("checkpoint") or {}
    ckpt_dir = run_dir / "checkpoints"
    best_cb = ModelCheckpoint(dirpath=ckpt_dir, filename="best-step{step:06d}", monitor="val/loss", mode="min",
                              save_top_k=int(ck.get("save_top_k", 1)), save_last=bool(ck.get("save_last", True)),
                              auto_insert_metric_name=False)
    interrupt_cb = _save_on_interrupt(ckpt_dir / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}.ckpt", logger)
    cbs = [best_cb, history, interrupt_cb, ValidateAtEnd()]  # validation always runs at the last step
    if tkw.get("enable_progress_bar", True) and not progress_bar_wanted(True):
        tkw["enable_progress_bar"] = False  # off a terminal: a log line every tenth of the run, no bar redraws
        cbs.append(TextProgress())
    if ck.get("every_n_steps"):
        cbs.append(ModelCheckpoint(dirpath=ckpt_dir, filename="step{step:06d}", monitor=None, save_top_k=-1,
                                   every_n_train_steps=int(ck.every_n_steps), auto_insert_metric_name=False))
    for key, target in (cfg.get("callbacks") or {}).items():  # named by the config (experiment=addition's
        from falcon_lab.training.callbacks import load_callback_factory

        cb = load_callback_factory(target, key)(cfg, tokenizer, dirpath=str(run_dir))  # accuracy callback)
        if cb is not None and not any(type(c) is type(cb) for c in (callbacks or [])):
            cbs.append(cb)
    cbs += list(callbacks or [])
    trainer = L.Trainer(
        logger=logger if logger is not None else False,
        callbacks=cbs,
        default_root_dir=str(run_dir),
        gradient_clip_val=float(cfg.optim.get("grad_clip", 1.0)) or None,
        plugins=[AtomicCheckpointIO()],  # same-folder temp file + fsync + os.replace (issue 16)
        use_distributed_sampler=False,
        check_val_every_n_epoch=None,
        max_epochs=-1,
        **tkw,
    )
    _keep_run_open_on_requeue(trainer, logger)
    accum = _set_accumulation(cfg, trainer)  # from data.global_batch_size and the world size, before any MLflow run
    tokens_per_step = int(cfg.data.batch_size) * int(cfg.data.seq_len) * accum * trainer.world_size
    peak = device_peak_flops((cfg.get("metrics") or {}).get("peak_flops"))
    trainer.callbacks.append(ThroughputMFU(tokens_per_step, module.model.flops_per_token(int(cfg.data.seq_len)),
                                           peak, log_every=int(cfg.trainer.get("log_every_n_steps") or 1)))
    status = "failed"
    run_id = None
    try:
        run_id = logger.run_id if logger is not None else None
        if logger is not None and trainer.global_rank == 0:
            try:
                logger.log_hyperparams(_flat_params(cfg, accum, trainer.world_size))
            except Exception as e:  # resuming a run with changed settings: MLflow params are immutable
                log.warning("params not re-logged to run %s: %s", run_id, str(e)[:200])
                logger.experiment.set_tag(run_id, "resumed_with_changed_params", "true")
            try:  # opens on the runs table (not MLflow 3's GenAI overview), with a shared default column set
                prepare_experiment(logger.experiment, logger.experiment_id)
            except Exception as e:  # a read-only or restricted store: the run itself goes on
                log.warning("could not tag MLflow experiment %s: %s", logger.experiment_id, str(e)[:200])
            if before is not None and before.get("status") != "RUNNING":
                # continued (a requeued SLURM job, a resume after Ctrl-C or a crash): RUNNING again until it ends; a
                # resume that fails before training a step puts the old status back (_restore_run)
                logger.experiment.update_run(run_id, "RUNNING")
            logger.experiment.set_tag(run_id, "run_dir", str(run_dir))
            logger.experiment.set_tag(run_id, "params_total", str(module.model.num_params()))
            logger.experiment.set_tag(run_id, "state_numel_per_seq", str(module.model.state_numel(1, int(cfg.data.seq_len))))
        import signal
        import threading

        sigint = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
        try:
            trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, weights_only=True)  # a checkpoint runs no code
        except SystemExit:
            if interrupt_cb.terminated:  # SIGTERM: stopped from outside (scancel, preemption, a SLURM requeue)
                status = "killed"
                raise SystemExit(128 + signal.SIGTERM) from None  # Lightning's SIGTERMException would exit 0
            if not interrupt_cb.interrupted:
                raise
            # Lightning turns Ctrl-C into sys.exit(1) and leaves SIGINT ignored: give the caller the interrupt back
            if sigint is not None:
                signal.signal(signal.SIGINT, sigint)
            status = "killed"
            raise KeyboardInterrupt from None
        status = "success"
    finally:
        if logger is not None and trainer.global_rank == 0:
            if status == "success":
                try:
                    logger.experiment.set_tag(run_id, "backend_used", ",".join(module.model.backends_used()))
                    logger.experiment.set_tag(run_id, "steps", str(int(trainer.global_step)))  # compare min_steps=
                    logger.experiment.log_artifact(run_id, str(run_dir / "config.yaml"))
                    png = plot_curves(history.history, str(run_dir / "loss_curve.png"))
                    if png:
                        logger.experiment.log_artifact(run_id, png)
                except Exception as e:  # artifacts must not turn a finished run into a failure
                    log.warning("could not log artifacts: %s", e)
            logger.finalize(status)
            if status == "success":
                from falcon_lab.training.mlflow import view_url

                log.info("MLflow runs table (shared view, once `mlflow ui` serves the store): %s",
                         view_url(resolve_tracking_uri(cfg.logger), logger.experiment_id))
            if status in ("failed", "killed") and before is not None and ckpt_step is not None and \
                    int(trainer.global_step) <= ckpt_step:
                _restore_run(logger, before)
    best = best_cb.best_model_score
    vals = history.history.get("val/loss", [])
    result = {
        "val_loss": float(best) if best is not None else (min(v for _, v in vals) if vals else float("nan")),
        "final_val_loss": vals[-1][1] if vals else float("nan"),
        "run_id": run_id,
        "ckpt_path": best_cb.best_model_path or best_cb.last_model_path or None,
        "last_ckpt_path": best_cb.last_model_path or None,
        "run_dir": str(run_dir),
        "tracking_uri": resolve_tracking_uri(cfg.logger) if logger is not None else None,
        "experiment_id": logger.experiment_id if logger is not None else None,
        "steps": int(trainer.global_step),
        "global_rank": int(trainer.global_rank),
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "history": history.history,
    }
    return result


def _run_snapshot(logger):
    try:
        r = logger.experiment.get_run(logger._run_id)
        return {"status": r.info.status, "end_time": r.info.end_time, "tags": dict(r.data.tags)}
    except Exception:  # unreadable store: nothing to restore later
        return None


def _restore_run(logger, before) -> None:
    """Put a resumed run back as it was (status, end time, tags) after a resume that trained nothing."""
    client, rid = logger.experiment, logger.run_id
    try:
        now = dict(client.get_run(rid).data.tags)
        for k in now:
            if k not in before["tags"]:
                client.delete_tag(rid, k)
        for k, v in before["tags"].items():
            if now.get(k) != v:
                client.set_tag(rid, k, v)
        if before["status"] in ("FINISHED", "FAILED", "KILLED"):
            client.set_terminated(rid, before["status"], end_time=before["end_time"])
        log.info("the resume failed before training a step: MLflow run %s left as it was (%s)",
                 rid, before["status"])
    except Exception as e:
        log.warning("could not restore MLflow run %s after the failed resume: %s", rid, e)


def _flat_params(cfg, accumulate: int | None = None, world_size: int | None = None) -> dict:
    """The run's MLflow params (falcon_lab.training.mlflow.run_params): the settings that decide its result."""
    from falcon_lab.training.mlflow import run_params

    return run_params(cfg, accumulate, world_size)


def load_checkpoint(path: str, map_location="cpu"):
    """(model (eval mode), tokenizer, cfg) from a checkpoint written by `run`."""
    from falcon_lab.data.tokenizer import tokenizer_from_state
    from falcon_lab.models import build_model
    from falcon_lab.training.module import mup_width_mult

    if not os.path.isfile(str(path)):
        raise FileNotFoundError(f"ckpt: no checkpoint file at {path!r}")
    ckpt = load_checkpoint_safely(path, "ckpt", map_location=map_location)  # weights_only: runs no code
    hp = ckpt.get("hyper_parameters") or {}
    if not isinstance(hp, dict) or "cfg" not in hp:
        raise ConfigError(f"ckpt: {path} was not written by falcon_lab.training (no cfg in hyper_parameters)")
    cfg = OmegaConf.create(hp["cfg"])
    tokenizer = tokenizer_from_state(hp.get("tokenizer_name", "byte"))
    width_mult = mup_width_mult(hp["cfg"]["model"], hp["cfg"]["optim"])
    # training-time knobs do not follow the weights: evaluation and generation run the plain model
    # (compile it yourself with falcon_lab.models.parallelize.parallelize(model, compile=True) if wanted)
    mcfg = {**hp["cfg"]["model"], "compile": False, "activation_checkpointing": False}
    model = build_model(mcfg, hp["cfg"]["mixer"], int(hp["vocab_size"]), logit_scale=1.0 / width_mult)
    sd = {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    model.load_state_dict(sd)
    model.eval()
    return model, tokenizer, cfg
