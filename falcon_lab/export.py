"""`python -m falcon_lab.export ckpt=PATH out=FOLDER [dtype=bfloat16 overwrite=true]` (Hydra app; config:
falcon_lab/configs/export.yaml): a training checkpoint as a Hugging Face model folder (config.json,
model.safetensors, tokenizer.json) that `AutoModelForCausalLM` / `AutoTokenizer` and lm-eval's `hf` model
load (docs/hf.md)."""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig


@hydra.main(config_path="configs", config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from falcon_lab.hf.export import ExportError, export_checkpoint
    from falcon_lab.training.validate import ConfigError

    try:
        out = export_checkpoint(str(cfg.ckpt), str(cfg.out), dtype=cfg.get("dtype"), overwrite=bool(cfg.overwrite),
                                verify=bool(cfg.verify), remote_code=bool(cfg.remote_code))
    except (ExportError, ConfigError, FileNotFoundError, ValueError) as e:  # bad input: named, exit 2
        print(f"[falcon_lab] export: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"[falcon_lab] export: wrote {out} (load with AutoModelForCausalLM.from_pretrained after import falcon_lab, "
          f"or with trust_remote_code=True)", flush=True)


if __name__ == "__main__":
    main()
