"""FSDP on CPU (issue 8): `trainer=fsdp_cpu` (torch FSDP2 `fully_shard` through Lightning's
ModelParallelStrategy, gloo) trains the tiny model on 2 real processes with sharded parameters; a checkpoint
saved under FSDP (full state dict, one file) resumes on 2 processes (reproducing the uninterrupted run), on
1 process under FSDP2, and on 1 process without FSDP (`trainer=cpu`).

This file is also the driver that the test launches (`python tests/test_train_fsdp_cpu.py OUT overrides...`):
Lightning relaunches the same command for rank 1, and a callback records on every rank what it saw at
train start (global step, sharding, parameters and optimizer state against the checkpoint)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lightning as L


class _Probe(L.Callback):
    def __init__(self, ckpt_path):
        self.ckpt_path = ckpt_path
        self.rec = {}

    def on_train_start(self, trainer, pl_module):
        import torch
        from torch.distributed.tensor import DTensor

        def full(t):
            return (t.full_tensor() if isinstance(t, DTensor) else t).detach()

        params = dict(pl_module.model.named_parameters())
        r = self.rec
        r.update(start_step=int(trainer.global_step), world_size=int(trainer.world_size),
                 strategy=type(trainer.strategy).__name__, n_params=len(params),
                 dtensor_params=sum(isinstance(p, DTensor) for p in params.values()),
                 shard_placements=sorted({str(p.placements) for p in params.values() if isinstance(p, DTensor)}),
                 local_numel=sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params.values()),
                 full_numel=sum(p.numel() for p in params.values()))
        full_params = {n: full(p) for n, p in params.items()}  # collective: same order on every rank
        if not self.ckpt_path:
            return
        ck = torch.load(self.ckpt_path, map_location="cpu", weights_only=False)
        sd = ck["state_dict"]
        r["param_keys_match"] = {f"model.{n}" for n in params} == set(sd)
        r["param_max_diff"] = max((full_params[n] - sd[f"model.{n}"]).abs().max().item() for n in params)
        # the saved optimizer state is keyed by ids that each saved param group lists in the order of the
        # live group's parameters (Lightning rekeys FSDP2's full state dict by module parameter order)
        opt = trainer.optimizers[0]
        saved = ck["optimizer_states"][0]
        pairs = [(i, p) for sg, g in zip(saved["param_groups"], opt.param_groups, strict=True)
                 for i, p in zip(sg["params"], g["params"], strict=True)]
        live = [p for _, p in pairs]
        r["opt_n_state"] = [len(saved["state"]), len(live)]
        r["opt_max_diff"] = max((full(opt.state[p][k]) - saved["state"][i][k]).abs().max().item()
                                for i, p in pairs for k in ("exp_avg", "exp_avg_sq"))
        r["opt_steps"] = sorted({float(full(opt.state[p]["step"])) for p in live})
        r["sched_last_epoch"] = int(trainer.lr_scheduler_configs[0].scheduler.last_epoch)


def _main(out, overrides):
    from falcon_lab.training import compose, run

    cfg = compose(overrides)
    probe = _Probe(cfg.get("ckpt_path"))
    res = run(cfg, callbacks=[probe])
    rec = {**probe.rec, "rank": res["global_rank"], "steps": res["steps"], "last_ckpt_path": res["last_ckpt_path"],
           "loss": res["history"].get("train/loss", []), "grad_norm": res["history"].get("train/grad_norm", []),
           "final_val_loss": res["final_val_loss"]}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{res['global_rank']}.json").write_text(json.dumps(rec, default=float))


# ---- the test ---------------------------------------------------------------------------------------
BASE = ["debug=smoke", "logger=none", "data.seq_len=32", "trainer.max_steps=8",
        "trainer.val_check_interval=4", "optim.warmup_steps=3"]


def _launch(tmp_path, name, overrides, trainer="fsdp_cpu"):
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    out = tmp_path / f"{name}_out"
    cmd = [sys.executable, str(Path(__file__).resolve()), str(out), f"trainer={trainer}", *BASE, *overrides,
           f"run_dir={tmp_path / name}"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = sorted((json.loads(f.read_text()) for f in out.glob("rank*.json")), key=lambda r: r["rank"])
    return recs, p.stdout + p.stderr


def _losses(rec):
    return {int(s): float(v) for s, v in rec["loss"]}


@pytest.mark.slow
def test_fsdp_two_cpu_processes_checkpoint_resumes_on_two_and_one(tmp_path):
    from falcon_lab.training import load_checkpoint

    # 1. uninterrupted: 2 processes, 8 steps, a checkpoint at step 4 (saved under FSDP)
    full, out = _launch(tmp_path, "full", ["checkpoint.every_n_steps=4"])
    assert "distributed_backend=gloo" in out and "Starting with 2 processes" in out, out[-2000:]
    assert [r["rank"] for r in full] == [0, 1]
    for r in full:
        assert r["strategy"] == "FSDP2Strategy" and r["world_size"] == 2 and r["steps"] == 8
        assert r["dtensor_params"] == r["n_params"] and r["shard_placements"] == ["(Shard(dim=0),)"], r
        assert r["local_numel"] < r["full_numel"]
        assert sorted(_losses(r)) == list(range(8)) and all(math.isfinite(v) for v in _losses(r).values())
        assert r["grad_norm"] and all(math.isfinite(v) and v > 0 for _, v in r["grad_norm"])
    assert full[0]["local_numel"] + full[1]["local_numel"] == full[0]["full_numel"]  # each rank holds its shard
    # the gradient norm is the global one (the same on both ranks), not a rank's shard
    assert [v for _, v in full[0]["grad_norm"]] == pytest.approx([v for _, v in full[1]["grad_norm"]], rel=1e-6)
    ck = tmp_path / "full" / "checkpoints" / "step000004.ckpt"
    assert ck.is_file()  # full state dict, one file (not a sharded checkpoint folder)
    model, _, _ = load_checkpoint(str(ck))
    assert sum(p.numel() for p in model.parameters()) == full[0]["full_numel"]

    # 2. resume on 2 processes: starts at step 4 with the saved parameters and optimizer state, and
    #    reproduces steps 4-7 of the uninterrupted run on each rank
    two, _ = _launch(tmp_path, "resume2", [f"ckpt_path={ck}"])
    # 3. resume on 1 process (same global batch of 8 rows), still under FSDP2
    one, _ = _launch(tmp_path, "resume1", [f"ckpt_path={ck}", "trainer.devices=1", "data.batch_size=8"])
    # 4. and without FSDP: the single-file checkpoint is an ordinary Lightning checkpoint
    plain, _ = _launch(tmp_path, "resume_plain", [f"ckpt_path={ck}", "data.batch_size=8"], trainer="cpu")
    assert [r["world_size"] for r in two] == [2, 2] and [r["world_size"] for r in one + plain] == [1, 1]
    assert plain[0]["strategy"] == "SingleDeviceStrategy" and plain[0]["dtensor_params"] == 0
    for r in two + one + plain:
        assert r["start_step"] == 4 and r["steps"] == 8, r
        assert r["param_keys_match"] and r["param_max_diff"] == 0.0, r
        assert r["opt_n_state"][0] == r["opt_n_state"][1] and r["opt_max_diff"] == 0.0, r
        assert r["opt_steps"] == [4.0] and r["sched_last_epoch"] == 4, r
        assert sorted(_losses(r)) == [4, 5, 6, 7] and all(math.isfinite(v) for v in _losses(r).values()), r
    for a, b in zip(full, two):
        la, lb = _losses(a), _losses(b)
        for s in lb:
            assert abs(la[s] - lb[s]) <= 1e-5 * abs(la[s]), (a["rank"], s, la[s], lb[s])
    assert abs(full[0]["final_val_loss"] - two[0]["final_val_loss"]) <= 1e-5 * full[0]["final_val_loss"]
    # on 1 process with the same global batch, each loss covers both ranks' rows: it is the mean of the two
    # ranks' losses (their rows hold equal token counts here), and the run ends where the 2-process run ends
    for r in one + plain:
        for s in range(4, 8):
            mean2 = (_losses(full[0])[s] + _losses(full[1])[s]) / 2
            assert abs(_losses(r)[s] - mean2) <= 1e-4 * mean2, (r["strategy"], s, _losses(r)[s], mean2)
        assert [v for _, v in r["grad_norm"]] == pytest.approx([v for _, v in full[0]["grad_norm"][4:]], rel=1e-4)
        assert abs(r["final_val_loss"] - full[0]["final_val_loss"]) <= 1e-4 * full[0]["final_val_loss"]

if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2:])
