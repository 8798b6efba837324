"""`python -m falcon_lab.generate ckpt=PATH prompt="..." [max_new_tokens=200 temperature=0.8 top_k=50]`.

Recurrent mixers decode with O(1) state per token (the Falcon operator's recurrent step); attention
uses a KV cache."""
from __future__ import annotations

import sys
import time

import hydra
from omegaconf import DictConfig


def check_config(cfg) -> None:
    """Refuse bad values before the checkpoint is loaded, naming the key (ConfigError)."""
    import math

    import torch

    from falcon_lab.training.validate import ConfigError, _number

    n = cfg.get("max_new_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"max_new_tokens: must be an integer >= 0, got {n!r}")
    t = _number(cfg.get("temperature"), "temperature")
    if not (math.isfinite(t) and t >= 0):
        raise ConfigError(f"temperature: must be a finite number >= 0 (0 = greedy), got {cfg.get('temperature')!r}")
    k = cfg.get("top_k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ConfigError(f"top_k: must be an integer >= 0 (0 or null: no top-k), got {k!r}")
    s = cfg.get("seed")
    if isinstance(s, bool) or not isinstance(s, int):
        raise ConfigError(f"seed: must be an integer, got {s!r}")
    try:
        dev = torch.device(str(cfg.get("device")))
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"device: {cfg.get('device')!r} is not a device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={cfg.device}: no CUDA device is visible on this machine; use device=cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device={cfg.device}: only {torch.cuda.device_count()} CUDA devices are visible")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device={cfg.device}: MPS is not available on this machine; use device=cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device: {cfg.device!r} is not supported here (cpu, cuda, cuda:N, mps)")
    if cfg.get("cuda_graph") and dev.type != "cuda":
        raise ConfigError(f"cuda_graph=true needs device=cuda (got device={cfg.device})")


@hydra.main(config_path="configs", config_name="generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    import torch

    from falcon_lab.training import load_checkpoint
    from falcon_lab.training.validate import ConfigError

    try:
        check_config(cfg)  # bad values refused before anything is loaded
        model, tok, tcfg = load_checkpoint(str(cfg.ckpt), map_location=cfg.device)
    except (ConfigError, FileNotFoundError) as e:  # a bad value; not a checkpoint, or one that would run code
        print(f"[falcon_lab] generate: {e}", file=sys.stderr)
        sys.exit(2)
    model.to(cfg.device)
    ids = torch.tensor([tok.encode(str(cfg.prompt), add_bos=True)], device=cfg.device)
    gen = torch.Generator(device=cfg.device).manual_seed(int(cfg.seed))
    t0 = time.perf_counter()
    out = model.generate(ids, int(cfg.max_new_tokens), temperature=float(cfg.temperature),
                         top_k=int(cfg.top_k) if cfg.top_k else None,
                         eos_id=tok.eos_id if cfg.stop_at_eos else None, generator=gen, prefill=bool(cfg.prefill),
                         cuda_graph=bool(cfg.cuda_graph))
    dt = time.perf_counter() - t0
    n_new = out.shape[1] - ids.shape[1]
    print(tok.decode(out[0].tolist()))
    print(f"\n[falcon_lab] {tcfg.mixer.name} model, {n_new} new tokens in {dt:.2f}s "
          f"({n_new / max(dt, 1e-9):.1f} tokens/s), decoding state "
          f"{model.state_numel(1, out.shape[1])} elements", flush=True)


if __name__ == "__main__":
    main()
