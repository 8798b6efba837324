"""Summary of one ablation block's work dir (ours): python summarize.py WORK [NAME ...] -> WORK/summary.{csv,json}.
Per run: arm, seed, state (done | stopped | pending), last step, best and final val/loss, mean train tokens/s over the
logged validations, MQAR acc_mean and cells (from eval/mqar.json). Reads only the small files the block packs, so it
runs on the GPU machine and here on an unpacked tarball alike (no MLflow needed)."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path


def one(work: Path, name: str) -> dict:
    rd = work / "runs" / name
    row = {"name": name, "state": "done" if (rd / "done").exists() else "stopped" if (rd / "rc").exists() else "pending"}
    cfg = rd / "config.yaml"
    if cfg.exists():  # the tags we set: arm / seed (plain text scan, no yaml dependency needed)
        txt = cfg.read_text()
        for key in ("arm", "seed", "block"):
            for line in txt.splitlines():
                if line.strip().startswith(f"{key}:") and line.startswith("    "):
                    row[key] = line.split(":", 1)[1].strip().strip("'\"")
    rows = []
    mj = rd / "metrics.jsonl"
    if mj.exists():
        rows = [json.loads(x) for x in mj.read_text().splitlines() if x.strip()]
    vals = [r["val/loss"] for r in rows if "val/loss" in r]
    tps = [r["train/tokens_per_s"] for r in rows if "train/tokens_per_s" in r]
    row.update(steps=max((r["step"] for r in rows), default=0),
               best_val_loss=min(vals) if vals else None, final_val_loss=vals[-1] if vals else None,
               tokens_per_s=round(sum(tps) / len(tps)) if tps else None)
    rc = rd / "rc"
    if rc.exists():
        row["rc"] = " ".join(rc.read_text().split())
    mq = next(iter(sorted(rd.glob("eval/**/mqar.json"))), None)
    if mq is not None:
        d = json.loads(mq.read_text())
        row["mqar_acc_mean"] = d.get("metrics", {}).get("mqar/acc_mean")
        row["mqar_state_numel"] = d.get("state_numel")
        row["mqar_cells"] = {f"kv{c['num_kv_pairs']}_T{c['seq_len']}": round(c["acc"], 4) for c in d.get("cells", [])}
    return row


def main(argv):
    work = Path(argv[0])
    names = argv[1:] or sorted(p.name for p in (work / "runs").iterdir() if p.is_dir())
    out = [one(work, n) for n in names]
    (work / "summary.json").write_text(json.dumps(out, indent=1))
    keys = ["name", "arm", "seed", "state", "steps", "best_val_loss", "final_val_loss", "tokens_per_s", "mqar_acc_mean", "rc"]
    with open(work / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(out)
    for r in out:
        bv = r.get("best_val_loss")
        print(f"{r['name']:<28} {r['state']:<8} step {r['steps']:>5}  best val/loss "
              f"{'-' if bv is None else f'{bv:.4f}'}  tok/s {r.get('tokens_per_s') or '-'}"
              + (f"  mqar acc {r['mqar_acc_mean']:.3f}" if r.get("mqar_acc_mean") is not None else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
