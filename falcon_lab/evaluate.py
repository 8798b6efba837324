"""`python -m falcon_lab.evaluate ckpt=PATH suites=[ppl,lm_eval,addition,mqar,passkey]` (Hydra app;
config: falcon_lab/configs/evaluate.yaml). Metrics, JSON and PNG artifacts go to the checkpoint's
MLflow run (or a new run tagged with the checkpoint); a short table per suite is printed."""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig


@hydra.main(config_path="configs", config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from falcon_lab.evaluation.runner import EvalConfigError, evaluate

    try:
        evaluate(cfg)
    except EvalConfigError as e:
        print(f"[falcon_lab] evaluate: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
