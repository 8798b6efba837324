"""The LightningModule: next-token loss, AdamW (+ optional width-muP), warm-up + cosine, fp32 NLL metrics."""
from __future__ import annotations

import math
import random

import lightning as L
import torch
import torch.nn.functional as F

from falcon_lab.models import build_model

IGNORE = -100


def mup_width_mult(model_cfg, optim_cfg) -> float:
    mup = optim_cfg.get("mup") or {}
    if not mup.get("enabled", False):
        return 1.0
    return float(model_cfg["d_model"]) / float(mup.get("base_width", 1024))


def lr_lambda(warmup: int, max_steps: int, min_ratio: float):
    """Linear warm-up to 1, then cosine to min_ratio at max_steps."""
    def f(step):
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        prog = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
    return f


def shuffled_words(sentence: str, rng: random.Random) -> str:
    words = sentence.split()
    for _ in range(10):
        perm = words[:]
        rng.shuffle(perm)
        if perm != words:
            return " ".join(perm)
    return " ".join(words[::-1])


def running_best(best: float | None, value: float) -> float | None:
    """The lowest validation loss so far: `value` replaces `best` when lower; a NaN is never the best."""
    return value if value == value and (best is None or value < best) else best


class LitLM(L.LightningModule):
    def __init__(self, cfg: dict, vocab_size: int, tokenizer_name: str | dict = "byte"):
        # tokenizer_name: the tokenizer's state() ({"name": "byte"}, or a BPE with its merges) so that
        # load_checkpoint rebuilds exactly the tokenizer the model was trained with
        super().__init__()
        self.save_hyperparameters(logger=False)  # run() logs the flattened config itself
        self.cfg = cfg
        self.width_mult = mup_width_mult(cfg["model"], cfg["optim"])
        self.model = build_model(cfg["model"], cfg["mixer"], vocab_size, logit_scale=1.0 / self.width_mult)
        self.seq_len = int(cfg["data"]["seq_len"])
        self._val_sum = None
        self._val_cnt = None
        self._val_best = None  # lowest val/loss so far (logged as val/loss_best; kept in checkpoints for resumes)
        self.check_sentences: list[str] | None = None
        self.tokenizer = None

    def on_load_checkpoint(self, checkpoint):
        self._val_best = checkpoint.get("falcon_lab_val_best")

    def on_save_checkpoint(self, checkpoint):
        checkpoint["falcon_lab_val_best"] = self._val_best
        # remember the MLflow run, so that resuming from this checkpoint continues the same run
        from lightning.pytorch.loggers import MLFlowLogger

        for lg in self.loggers:
            if isinstance(lg, MLFlowLogger) and lg.run_id:
                checkpoint["falcon_lab"] = {"mlflow_run_id": lg.run_id, "tracking_uri": lg._tracking_uri}

    def configure_model(self):
        # one parallelize step (falcon_lab.models.parallelize): activation checkpointing, compile (model.compile,
        # resolved to a bool by training.run), then FSDP2 when trainer.strategy=fsdp2 set a device mesh
        from falcon_lab.models.parallelize import parallelize

        m = self.cfg["model"]
        mesh = self.device_mesh["data_parallel"] if self.device_mesh is not None else None
        parallelize(self.model, compile=m.get("compile") is True,
                    activation_checkpointing=bool(m.get("activation_checkpointing", False)), mesh=mesh)

    def forward(self, input_ids, cu_seqlens=None):
        return self.model(input_ids, cu_seqlens=cu_seqlens)

    def _nll(self, batch):
        return self.model(batch["input_ids"], cu_seqlens=batch.get("cu_seqlens"), labels=batch["labels"])

    def training_step(self, batch, batch_idx):
        nll, n = self._nll(batch)
        loss = nll / n.clamp(min=1)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def on_validation_epoch_start(self):
        self._val_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._val_cnt = torch.zeros((), dtype=torch.float64, device=self.device)

    def validation_step(self, batch, batch_idx):
        nll, n = self._nll(batch)
        self._val_sum += nll.double()
        self._val_cnt += n.double()

    def on_validation_epoch_end(self):
        s = self.trainer.strategy.reduce(self._val_sum, reduce_op="sum")
        c = self.trainer.strategy.reduce(self._val_cnt, reduce_op="sum")
        loss = (s / c.clamp(min=1)).float()
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(loss), sync_dist=False)
        if not self.trainer.sanity_checking:  # the best so far: what the MLflow runs view sorts by
            self._val_best = running_best(self._val_best, float(loss))
            if self._val_best is not None:
                self.log("val/loss_best", self._val_best, sync_dist=False)
        if self.check_sentences and self.tokenizer is not None:
            gap, win = self.shuffle_check()
            self.log("val/shuffle_gap", gap, sync_dist=False)
            self.log("val/shuffle_win_rate", win, sync_dist=False)

    @torch.no_grad()
    def sentence_nll(self, texts: list[str]) -> torch.Tensor:
        """Mean NLL per predicted token of each text ([BOS] text [EOS]), one row at a time."""
        out = []
        for t in texts:
            ids = torch.tensor(self.tokenizer.encode(t, add_bos=True, add_eos=True), device=self.device)[None]
            logits = self.model(ids[:, :-1]).float()
            out.append(F.cross_entropy(logits[0], ids[0, 1:]).item())
        return torch.tensor(out)

    @torch.no_grad()
    def shuffle_check(self, seed: int = 0):
        """Real sentences vs the same words shuffled: (mean NLL gap in nats/token, fraction real wins)."""
        was = self.model.training
        self.model.eval()
        rng = random.Random(seed)
        real = self.check_sentences
        shuf = [shuffled_words(s, rng) for s in real]
        a, b = self.sentence_nll(real), self.sentence_nll(shuf)
        self.model.train(was)
        return float((b - a).mean()), float((a < b).float().mean())

    # ---- optimisation ------------------------------------------------------------------------
    def configure_optimizers(self):
        o = self.cfg["optim"]
        lr = float(o["lr"])
        wd = float(o.get("weight_decay", 0.1))
        hidden, embed, vectors = [], [], []
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            if name.startswith("embed."):
                embed.append(p)
            elif p.dim() >= 2:
                hidden.append(p)
            else:
                vectors.append(p)
        # width-muP (ours, Adam form): hidden matrices lr / width_mult; embeddings, gains, biases: base lr.
        groups = [
            {"params": hidden, "lr": lr / self.width_mult, "weight_decay": wd, "name": "hidden"},
            {"params": embed, "lr": lr, "weight_decay": wd, "name": "embed"},
            {"params": vectors, "lr": lr, "weight_decay": 0.0, "name": "vectors"},
        ]
        groups = [g for g in groups if g["params"]]
        betas = tuple(float(b) for b in o.get("betas", (0.9, 0.95)))
        fused = bool(o.get("fused", False)) and (torch.cuda.is_available() or bool(o.get("fused_on_cpu", False)))
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=float(o.get("eps", 1e-8)), fused=fused)
        max_steps = int(self.trainer.max_steps) if self.trainer and self.trainer.max_steps > 0 else int(o.get("total_steps", 1000))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(int(o.get("warmup_steps", 0)), max_steps, float(o.get("min_lr_ratio", 0.1))))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Lightning's mixed-precision plugin refuses to clip for optimizers that unscale gradients
        inside their step (fused AdamW), even under bf16, which has no grad scaler. Without a scaler
        the gradients are already true gradients, so clip their norm directly (found on the H200)."""
        if not gradient_clip_val:
            return
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if getattr(optimizer, "_step_supports_amp_scaling", False) and scaler is None:
            torch.nn.utils.clip_grad_norm_(self.parameters(), float(gradient_clip_val))
        else:
            self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                                gradient_clip_algorithm=gradient_clip_algorithm)

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad.detach().float().norm() for p in self.model.parameters() if p.grad is not None]
        if grads:
            self.log("train/grad_norm", torch.stack(grads).norm(), on_step=True, on_epoch=False)
        self.log("train/lr", optimizer.param_groups[0]["lr"] * (1.0 if self.width_mult == 1 else self.width_mult),
                 on_step=True, on_epoch=False)
