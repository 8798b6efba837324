"""Training-step throughput (forward + backward + AdamW) of the tiny model for every mixer on CPU.

    python experiments/cpu_throughput/measure.py [--threads 1] [--batch 16] [--seq 128] [--steps 10]

Writes results.json and prints a Markdown table (tokens/s, analytic FLOPs/token, state size)."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from falcon_lab.models import SIZE_PRESETS, build_model

MIXERS = {f"falcon-{v}": dict(name="falcon", variant=v) for v in ("1", "2", "3", "1A", "2A", "3A")}
MIXERS.update({n: dict(name=n) for n in ("attention", "deltanet", "gated_deltanet", "mamba2", "retnet")})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--size", default="tiny")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for name, mix in MIXERS.items():
        torch.manual_seed(0)
        m = build_model(SIZE_PRESETS[a.size], mix, 320)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        x = torch.randint(0, 256, (a.batch, a.seq + 1))
        times = []
        for i in range(a.steps + 2):
            t = time.perf_counter()
            logits = m(x[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, 320), x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i >= 2:  # warm-up steps excluded
                times.append(time.perf_counter() - t)
        med = statistics.median(times)
        rows.append({"mixer": name, "tokens_per_s": a.batch * a.seq / med, "step_s": med,
                     "flops_per_token_fwd": m.flops_per_token(a.seq), "state_numel_per_seq": m.state_numel(1, a.seq),
                     "params": m.num_params()})
    meta = {"size": a.size, "batch": a.batch, "seq": a.seq, "threads": a.threads, "steps": a.steps,
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(__file__).with_name("results.json")
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"{meta}\n\n| mixer | tokens/s | step (s) | fwd FLOPs/token | state (elements/seq) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mixer']} | {r['tokens_per_s']:.0f} | {r['step_s']:.3f} | {r['flops_per_token_fwd']:.3g} | "
              f"{r['state_numel_per_seq']} |")


if __name__ == "__main__":
    main()
