"""`python -m falcon_lab.fit [overrides]`: train one model (Hydra app; `-m` for multirun, `--cfg job`,
`experiment=NAME`, `hydra.searchpath=[file://DIR]` for your own experiment folders).

With no arguments: a tiny Falcon-1A.3 on the embedded King James Bible, on CPU, in under 3 minutes."""
from __future__ import annotations

import hydra
from omegaconf import DictConfig, open_dict

from falcon_lab.training.arms import register_resolvers as register_arm_resolvers
from falcon_lab.training.validate import register_resolvers

register_resolvers()  # before Hydra resolves its run dir: outputs/${falcon_dirname:${logger.experiment_name}}/...
register_arm_resolvers()  # multirun folders named by their arm: ${falcon_arm:}


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    from falcon_lab.training import run
    from falcon_lab.training.mlflow import ui_command

    hc = HydraConfig.get()
    with open_dict(cfg):
        if not cfg.get("run_dir"):
            cfg.run_dir = hc.runtime.output_dir
        if str(hc.mode) == "RunMode.MULTIRUN":  # one MLflow run per arm, named by what differs between arms
            from falcon_lab.training.arms import arm_of_job, multirun_id

            arm, name = arm_of_job(hc)
            if not cfg.logger.get("run_name"):
                cfg.logger.run_name = name or hc.job.override_dirname or f"arm{hc.job.num}"
            tags = dict(cfg.logger.get("tags") or {})
            tags.setdefault("arm", arm or cfg.logger.run_name)
            tags.setdefault("multirun", multirun_id(hc.sweep.dir))
            cfg.logger.tags = tags
    res = run(cfg)
    if res.get("global_rank", 0) != 0:  # DDP: only rank 0 reports
        return float(res["val_loss"])
    if res["history"].get("val/loss"):
        print(f"\n[falcon_lab] done: {res['steps']} steps, best val/loss {res['val_loss']:.4f} "
              f"(ppl {2.718281828 ** res['val_loss']:.2f})", flush=True)
    else:  # not a divergence: validation runs at the end of training unless it was switched off
        print(f"\n[falcon_lab] done: {res['steps']} steps, no validation ran (trainer.limit_val_batches="
              f"{cfg.trainer.get('limit_val_batches')}, trainer.val_check_interval="
              f"{cfg.trainer.get('val_check_interval')}): no val/loss to report", flush=True)
    if "val/shuffle_gap" in res["metrics"]:
        print(f"[falcon_lab] real vs shuffled verse: {res['metrics']['val/shuffle_gap']:+.3f} nats/token for "
              f"shuffled, real preferred in {100 * res['metrics']['val/shuffle_win_rate']:.0f}% of verses")
    print(f"[falcon_lab] run dir: {res['run_dir']}\n[falcon_lab] checkpoint: {res['ckpt_path']}")
    if res["run_id"]:
        from falcon_lab.training.mlflow import view_url
        where = (f"\n  then: {view_url(res['tracking_uri'], res['experiment_id'])}"
                 if res.get("experiment_id") is not None else "")
        print(f"[falcon_lab] MLflow run {res['run_id']} (experiment {cfg.logger.experiment_name}); "
              f"open the UI with:\n    {ui_command(res['tracking_uri'])}{where}", flush=True)
    return float(res["val_loss"])


if __name__ == "__main__":
    main()
