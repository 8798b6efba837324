"""MQAR scoring: accuracy by (number of key-value pairs, sequence length), the model's recurrent
state size, and the accuracy-vs-state-size plot that compares mixers at equal memory (Zoology's
view). Accuracy = fraction of queried keys whose value is the argmax prediction."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from falcon_lab.data.tasks.mqar import MQARSpec, make_mqar
from falcon_lab.evaluation.common import model_device, save_accuracy_plot


def state_numel(model, batch: int = 1, seq_len: int = 1024) -> int | None:
    """Recurrent state elements per sequence: ``model.state_numel(batch)`` if the model has it, else
    the sum over the outermost submodules that declare ``state_numel`` (one per mixer). None when
    nothing declares it. A KV cache grows with length: it is counted at ``seq_len`` tokens."""
    fn = getattr(model, "state_numel", None)
    if callable(fn):
        return _call_numel(fn, batch, seq_len)
    total, found = 0, False
    if isinstance(model, nn.Module):
        seen: set[str] = set()
        for name, mod in model.named_modules():
            if mod is model or any(name.startswith(p + ".") for p in seen):
                continue
            f = getattr(mod, "state_numel", None)
            if callable(f):
                total += _call_numel(f, batch, seq_len)
                seen.add(name)
                found = True
    return total if found else None


def _call_numel(fn, batch, seq_len):
    try:
        return int(fn(batch, seq_len))
    except TypeError:
        return int(fn(batch))


@dataclass
class MQARResult:
    cells: list[dict] = field(default_factory=list)  # {num_kv_pairs, seq_len, n_queries, acc}
    state_numel: int | None = None

    def metrics(self, prefix: str = "mqar/") -> dict[str, float]:
        m = {f"{prefix}acc_kv{c['num_kv_pairs']}_T{c['seq_len']}": c["acc"] for c in self.cells}
        if self.cells:
            m[prefix + "acc_mean"] = sum(c["acc"] for c in self.cells) / len(self.cells)
        if self.state_numel is not None:
            m[prefix + "state_numel"] = float(self.state_numel)
        return m

    def to_dict(self):
        return {"cells": self.cells, "state_numel": self.state_numel, "metrics": self.metrics()}

    def table(self) -> str:
        lines = ["kv_pairs  seq_len  queries   acc%"]
        for c in self.cells:
            lines.append(f"{c['num_kv_pairs']:8d}  {c['seq_len']:7d}  {c['n_queries']:7d}  {100 * c['acc']:5.1f}")
        lines.append(f"state_numel per sequence = {self.state_numel}")
        return "\n".join(lines)


@torch.no_grad()
def evaluate_mqar(model, grid, *, n_examples: int = 64, batch_size: int = 16, seed: int = 1234,
                  key_ids=(1, 128), value_ids=(128, 256), filler_id: int = 0) -> MQARResult:
    """``grid``: iterable of (num_kv_pairs, seq_len). Fresh examples from ``seed`` (training data
    uses other seeds)."""
    grid = [(int(a), int(b)) for a, b in grid]
    if not grid:
        raise ValueError("mqar grid is empty: give (num_kv_pairs, seq_len) pairs")
    device = model_device(model)
    if hasattr(model, "eval"):
        model.eval()
    res = MQARResult(state_numel=state_numel(model, 1, max(int(T) for _, T in grid)))
    for nkv, T in grid:
        spec = MQARSpec(int(nkv), int(T), tuple(key_ids), tuple(value_ids), filler_id)
        data = make_mqar(spec, n_examples, seed=seed + 7919 * int(nkv) + int(T))
        correct = total = 0
        for s in range(0, n_examples, batch_size):
            ids = data["input_ids"][s:s + batch_size].to(device)
            tgt = data["targets"][s:s + batch_size].to(device)
            pred = model(ids).float().argmax(-1)
            mask = tgt != -100
            correct += int((pred[mask] == tgt[mask]).sum())
            total += int(mask.sum())
        res.cells.append({"num_kv_pairs": int(nkv), "seq_len": int(T), "n_queries": total,
                          "acc": correct / max(total, 1)})
    return res


def plot_mqar(result: MQARResult, path: str, title: str | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for T in sorted({c["seq_len"] for c in result.cells}):
        cs = sorted((c for c in result.cells if c["seq_len"] == T), key=lambda c: c["num_kv_pairs"])
        ax.plot([c["num_kv_pairs"] for c in cs], [100 * c["acc"] for c in cs], "o-", label=f"T={T}")
    return save_accuracy_plot(fig, ax, path, "key-value pairs",
                              title or f"MQAR (state = {result.state_numel} elements/sequence)")


def plot_accuracy_vs_state(points: list[dict], path: str, title: str = "MQAR accuracy vs state size") -> str:
    """``points``: {"label", "state_numel", "acc"} per model (e.g. per MLflow run): one marker per
    model, log-x, so mixers are compared at equal memory."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for p in points:
        ax.scatter([p["state_numel"]], [100 * p["acc"]])
        ax.annotate(p["label"], (p["state_numel"], 100 * p["acc"]), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("recurrent state (elements per sequence)")
    ax.set_ylabel("MQAR accuracy (%)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
