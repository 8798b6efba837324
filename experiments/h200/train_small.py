"""Train the paper's `small` model (12 x 768, 6 heads x 128) for a few hundred steps on one GPU and
record loss, tokens/s and MFU: the H200 check of issue 4 (run through the device tool).

    python experiments/h200/train_small.py --out DIR [--steps 300] [--models 1a_3,1_3]

Data: the embedded KJV corpus (byte tokens, 1024-token rows, batch 16 = 16,384 tokens per step),
bf16-mixed, AdamW with the paper preset (optim=paper, warm-up shortened to 30 steps), no MLflow (logger=none: the GPU image has no
MLflow); the numbers go to DIR/train_small_h200.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

MODELS = {
    "1a_3": ["mixer=falcon", "mixer.variant=1A", "mixer.preset='.3'"],
    "1_3": ["mixer=falcon", "mixer.variant=1", "mixer.preset='.3'"],
    "transformer": ["mixer=attention"],
    # the fast-layers issue's correctness run: the same model eager, with the torch modules (the path
    # before the fusion) against the default (compiled, Triton modules)
    "1a_3_unfused": ["mixer=falcon", "mixer.variant=1A", "mixer.preset='.3'", "model.compile=false",
                     "mixer.module_backend=torch", "model.loss_impl=materialized"],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--models", default="1a_3,1_3")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--override", action="append", default=[], help="extra fit config overrides")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks this script, not the GPU")
    a = ap.parse_args()
    from falcon_lab.training import run
    from falcon_lab.training.config import compose

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = os.environ.get("FALCON_COMMIT")  # set it when running from a git archive (no .git)
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
        except Exception:
            commit = "unknown"
    import triton
    rows = []
    for name in a.models.split(","):
        ov = ["model=tiny" if a.smoke else "model=small", "optim=paper", "optim.warmup_steps=30",
              "trainer=cpu" if a.smoke else "trainer=gpu", "logger=none", "data=kjv",
              f"data.seq_len={a.seq_len}", f"data.batch_size={a.batch}", f"trainer.max_steps={a.steps}",
              f"trainer.val_check_interval={max(1, a.steps // 3)}", "trainer.limit_val_batches=8",
              "trainer.enable_progress_bar=false", "checks.shuffle=false", "trainer.log_every_n_steps=10",
              f"run_dir={out / name}"] + MODELS[name] + a.override
        cfg = compose(ov)
        t0 = time.time()
        res = run(cfg)
        wall = time.time() - t0
        h = res["history"]
        loss = [v for _, v in h.get("train/loss", [])]
        tps = [v for _, v in h.get("train/tokens_per_s", [])]
        mfu = [v for _, v in h.get("train/mfu", [])]
        late = tps[len(tps) // 2:]  # after warm-up / compilation
        row = dict(model=name, overrides=ov, steps=res.get("steps"), wall_s=wall,
                   train_loss_first=loss[0] if loss else None, train_loss_last=loss[-1] if loss else None,
                   val_loss=h.get("val/loss", []), tokens_per_s_median=statistics.median(late) if late else None,
                   mfu_median=statistics.median(mfu[len(mfu) // 2:]) if mfu else None,
                   peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
                   backend_used=res.get("backend_used"))
        rows.append(row)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        print(json.dumps({k: v for k, v in row.items() if k != "overrides"}), flush=True)
    meta = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__, triton=triton.__version__,
                commit=commit, date=time.strftime("%Y-%m-%d"), seq_len=a.seq_len, batch=a.batch,
                tokens_per_step=a.seq_len * a.batch)
    (out / "train_small_h200.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
