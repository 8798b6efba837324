"""`python -m falcon_lab.generate ckpt=PATH prompt="..." [max_new_tokens=200 temperature=0.8 top_k=50]`.

Recurrent mixers decode with O(1) state per token (the Falcon operator's recurrent step); attention
uses a KV cache."""
from __future__ import annotations

import sys
import time

import hydra
from omegaconf import DictConfig


@hydra.main(config_path="configs", config_name="generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    import torch

    from falcon_lab.training import load_checkpoint
    from falcon_lab.training.validate import ConfigError

    if cfg.cuda_graph and not str(cfg.device).startswith("cuda"):
        raise ValueError(f"cuda_graph=true needs device=cuda (got device={cfg.device})")
    try:
        model, tok, tcfg = load_checkpoint(str(cfg.ckpt), map_location=cfg.device)
    except (ConfigError, FileNotFoundError) as e:  # not a checkpoint, or one that would run code
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
