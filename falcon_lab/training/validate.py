"""Start-up validation: one clear error naming the key, before any data or model is built."""
from __future__ import annotations

import math
import os
import re
import zipfile

from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    pass


def _need(cfg, key):
    node = OmegaConf.select(cfg, key, default="__missing__")
    if node == "__missing__" or node is None:
        raise ConfigError(f"{key}: required but missing")
    return node


def _pos_int(cfg, key):
    v = _need(cfg, key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{key}: must be a positive integer, got {v!r}")
    return v


def _number(value, key: str, kind=float):
    """value as a float (or int), or a ConfigError naming the key (Hydra passes `optim.lr=abc` as a
    string)."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: must be a number, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: must be a number, got {value!r}") from None


def load_checkpoint_safely(path, key: str, map_location="cpu", mmap: bool = False) -> dict:
    """torch.load with weights_only=True: tensors and plain containers only (what this platform's checkpoints
    hold), so a crafted checkpoint cannot run code when loaded. Anything else is a ConfigError naming `key`."""
    import torch

    is_zip = zipfile.is_zipfile(str(path))  # torch.save's format (mmap needs it)
    try:
        ck = torch.load(str(path), map_location=map_location, weights_only=True, mmap=mmap and is_zip)
    except Exception as e:
        msg = str(e)
        if "Weights only load failed" in msg:
            found = re.search(r"WeightsUnpickler error:\s*([^.\n]+)", msg)
            raise ConfigError(f"{key}: {str(path)!r} holds objects other than tensors and plain containers"
                              f"{f' ({found.group(1).strip()})' if found else ''}; refused, because loading them "
                              "could run code (checkpoints written by python -m falcon_lab.fit hold none)") from None
        why = "not a zip archive as torch.save writes" if not is_zip else \
            f"{type(e).__name__}: {msg.strip().splitlines()[0][:200] if msg.strip() else ''}"
        raise ConfigError(f"{key}: {str(path)!r} is not a PyTorch checkpoint ({why})") from None
    if not isinstance(ck, dict):
        raise ConfigError(f"{key}: {str(path)!r} is not a checkpoint (it holds a {type(ck).__name__}, not a dict)")
    return ck


def load_callable(target, key: str):
    """A config's "module:function" string -> the function it names; anything else is a ConfigError naming the
    key (`key` is the config path, e.g. "callbacks.addition" or "runner"). The one loader of such strings
    (training callbacks, sweep runners)."""
    import importlib

    mod, sep, attr = str(target).partition(":")
    if not sep or not mod or not attr:
        raise ConfigError(f"{key}: {target!r} is not 'module:function'")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}: cannot load {target!r}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"{key}: {target!r} is not callable")
    return fn


def check_experiment_name(name) -> str:
    """logger.experiment_name names the run folder (outputs/<experiment_name>/...): a plain name only, so that
    no run writes outside the outputs folder (`../../elsewhere/x` would)."""
    s = "" if name is None else str(name)
    bad = [c for c in ("/", "\\", os.sep, os.altsep or "/", "\0") if c in s]
    if not s.strip() or bad or s.strip() in (".", "..") or s.startswith("~"):
        raise ConfigError(f"logger.experiment_name: {s!r} is not a plain name (no '/', '\\', '..' or '~'): it "
                          "names the run folder outputs/<experiment_name>/..., which must stay inside outputs/")
    return s


def register_resolvers() -> None:
    """${falcon_dirname:NAME} (Hydra's run/sweep dir in train.yaml): NAME checked by check_experiment_name, so
    that Hydra itself refuses to create a folder outside outputs/ before the run starts. Also registers the
    typed config schemas in Hydra's ConfigStore (`mixer/falcon_schema`: FalconConfig, the schema of
    configs/mixer/falcon.yaml), which every entry point needs before it composes."""
    if not OmegaConf.has_resolver("falcon_dirname"):
        OmegaConf.register_new_resolver("falcon_dirname", check_experiment_name)
    from hydra.core.config_store import ConfigStore

    from falcon_lab.layers.falcon_config import FalconConfig

    ConfigStore.instance().store(group="mixer", name="falcon_schema", node=FalconConfig)


def derive_accumulation(global_batch, batch_size: int, world_size: int, configured=None, num_nodes: int = 1) -> int:
    """Gradient accumulation that makes `global_batch` sequences per optimizer step from `batch_size` per device
    on `world_size` ranks (devices x num_nodes). With no global batch (None) it is `configured` (1 if unset). A
    global batch the per-step rows do not divide, or a `configured` accumulation (other than unset/1) that
    disagrees, is a ConfigError showing the arithmetic."""
    per_step = int(batch_size) * int(world_size)
    if global_batch is None:
        return int(configured or 1)
    gb = int(global_batch)
    nodes = f"{world_size // max(int(num_nodes), 1)} devices x {num_nodes} nodes" if int(num_nodes) > 1 \
        else f"{world_size} devices"
    if gb % per_step:
        lo, hi = max(gb // per_step, 1) * per_step, (gb // per_step + 1) * per_step
        raise ConfigError(
            f"data.global_batch_size={gb}: not a multiple of data.batch_size x world size = {batch_size} x "
            f"{world_size} ({nodes}) = {per_step} sequences per micro-step ({gb} / {per_step} = "
            f"{gb / per_step:.3g}); use a global batch of {' or '.join(str(v) for v in sorted({lo, hi}))}, "
            "or another data.batch_size")
    accum = gb // per_step
    if configured not in (None, 1) and int(configured) != accum:
        raise ConfigError(f"trainer.accumulate_grad_batches={configured} contradicts data.global_batch_size={gb} "
                          f"= {batch_size} per device x {world_size} ({nodes}) x {accum} accumulation; set "
                          "only one of them (trainer.accumulate_grad_batches=null)")
    return accum


def validate_config(cfg: DictConfig) -> None:
    from falcon_lab.data.registry import get_datamodule_cls
    from falcon_lab.layers.registry import get_mixer_cls, mixer_knobs

    OmegaConf.set_struct(cfg, True)
    if cfg.get("logger") is not None:
        check_experiment_name(cfg.logger.get("experiment_name"))
        retry = _number(cfg.logger.get("retry_s", 30) or 0, "logger.retry_s")
        if not (math.isfinite(retry) and retry >= 0):
            raise ConfigError(f"logger.retry_s: must be a finite number of seconds >= 0, got {cfg.logger.retry_s!r}")
    for key in ("model.d_model", "model.n_layers", "model.n_heads", "model.head_dim", "data.seq_len",
                "data.batch_size", "trainer.max_steps"):
        _pos_int(cfg, key)
    gb = cfg.data.get("global_batch_size")
    if gb is not None:
        _pos_int(cfg, "data.global_batch_size")
    comp = cfg.model.get("compile", "auto")
    if comp not in (True, False, "auto"):
        raise ConfigError(f"model.compile: must be auto, true or false, got {comp!r}")
    from falcon_lab.models.loss import LOSS_IMPLS

    if cfg.model.get("loss_impl", "chunked") not in LOSS_IMPLS:
        raise ConfigError(f"model.loss_impl: {cfg.model.get('loss_impl')!r} is not one of {LOSS_IMPLS}")
    lr = _number(_need(cfg, "optim.lr"), "optim.lr")
    if not (math.isfinite(lr) and lr > 0):
        raise ConfigError(f"optim.lr: must be a finite number > 0, got {cfg.optim.lr}")
    for k in ("weight_decay", "warmup_steps", "grad_clip"):  # grad_clip 0: no clipping
        if k in cfg.optim:
            v = _number(cfg.optim[k], f"optim.{k}")
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"optim.{k}: must be a finite number >= 0, got {cfg.optim[k]!r}")
    # ---- mixer
    mixer = OmegaConf.to_container(_need(cfg, "mixer"), resolve=True)
    name = mixer.get("name")
    try:
        get_mixer_cls(name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    knobs = mixer_knobs(name)
    for k in mixer:
        if k != "name" and k not in knobs:
            raise ConfigError(f"mixer.{k}: not a knob of mixer {name!r} (knobs: {sorted(knobs)})")
    if name == "falcon":  # every Falcon knob: its type, value, preset and applicability (falcon_config.py)
        from falcon_lab.layers.falcon_config import FalconConfig

        try:
            FalconConfig.from_knobs(mixer).resolved()
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e)) from None
    # ---- callbacks a config names ("module:function" factories, e.g. experiment=addition's)
    from falcon_lab.training.callbacks import load_callback_factory

    for key, target in (cfg.get("callbacks") or {}).items():
        load_callback_factory(target, key)
    # ---- data
    try:
        get_datamodule_cls(_need(cfg, "data.name"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.data.name == "lm":  # source, paths, document boundary, tokenizer (its files for gpt2)
        from falcon_lab.data.sources import check_lm_config

        try:
            check_lm_config(cfg.data)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from None
    # ---- checkpoints
    top_k = (cfg.get("checkpoint") or {}).get("save_top_k", 1)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise ConfigError(f"checkpoint.save_top_k: must be an integer >= -1 (-1 keeps every checkpoint), "
                          f"got {top_k!r}")
    # ---- resume
    ck = cfg.get("ckpt_path")
    if ck and ck not in ("last",) and not os.path.isfile(str(ck)):
        raise ConfigError(f"ckpt_path: no checkpoint file at {ck!r}")
    if ck and ck not in ("last",):  # verified safely here: some Lightning strategies unpickle it unrestricted
        if "state_dict" not in load_checkpoint_safely(ck, "ckpt_path", mmap=True):
            raise ConfigError(f"ckpt_path: {ck!r} is not a Lightning checkpoint (no state_dict)")
    if cfg.trainer.get("val_check_interval") is not None and \
            _number(cfg.trainer.val_check_interval, "trainer.val_check_interval", int) < 1:
        raise ConfigError("trainer.val_check_interval: must be >= 1 (steps)")
