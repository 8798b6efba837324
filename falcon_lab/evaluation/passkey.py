"""Passkey retrieval scoring: exact match of the key (teacher-forced: every digit is the argmax
given the gold prefix, which is the same as greedy decoding producing it) by context length and
depth, and a heatmap. Context lengths beyond the training length test the long-context claim."""
from __future__ import annotations

from dataclasses import dataclass, field

from falcon_lab.data.tasks.passkey import passkey_grid
from falcon_lab.evaluation.common import as_tokenizer, score_continuations


@dataclass
class PasskeyResult:
    cells: list[dict] = field(default_factory=list)  # {context_len, depth, n, acc}
    train_len: int | None = None

    def metrics(self, prefix: str = "passkey/") -> dict[str, float]:
        m = {}
        for L in sorted({c["context_len"] for c in self.cells}):
            cs = [c for c in self.cells if c["context_len"] == L]
            m[f"{prefix}acc_L{L}"] = sum(c["acc"] for c in cs) / len(cs)
        if self.cells:
            m[prefix + "acc_mean"] = sum(c["acc"] for c in self.cells) / len(self.cells)
        return m

    def to_dict(self):
        return {"cells": self.cells, "train_len": self.train_len, "metrics": self.metrics()}

    def table(self) -> str:
        depths = sorted({c["depth"] for c in self.cells})
        lines = ["context \\ depth " + " ".join(f"{d:6.2f}" for d in depths)]
        for L in sorted({c["context_len"] for c in self.cells}):
            row = {c["depth"]: c["acc"] for c in self.cells if c["context_len"] == L}
            lines.append(f"{L:15d} " + " ".join(f"{100 * row[d]:6.1f}" for d in depths))
        return "\n".join(lines)


def evaluate_passkey(model, tokenizer, *, context_lens, depths, per_cell: int = 5, seed: int = 0,
                     batch_size: int = 4, train_len: int | None = None) -> PasskeyResult:
    tok = as_tokenizer(tokenizer)
    if hasattr(model, "eval"):
        model.eval()
    exs = passkey_grid(context_lens, depths, per_cell, seed, length_fn=lambda s: len(tok.encode(s)) + 1)
    pairs = [([tok.bos_id] + tok.encode(e.prompt), tok.encode(e.answer)) for e in exs]
    scores = score_continuations(model, pairs, batch_size=batch_size, pad_id=tok.pad_id)
    res = PasskeyResult(train_len=train_len)
    cells: dict[tuple, list[bool]] = {}
    for e, s in zip(exs, scores):
        cells.setdefault((e.context_len, e.depth), []).append(s.is_greedy)
    for (L, d), hits in cells.items():
        res.cells.append({"context_len": L, "depth": d, "n": len(hits), "acc": sum(hits) / len(hits)})
    return res


def plot_passkey(result: PasskeyResult, path: str, title: str = "Passkey retrieval accuracy") -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    Ls = sorted({c["context_len"] for c in result.cells})
    ds = sorted({c["depth"] for c in result.cells})
    grid = np.full((len(ds), len(Ls)), np.nan)
    for c in result.cells:
        grid[ds.index(c["depth"]), Ls.index(c["context_len"])] = 100 * c["acc"]
    fig, ax = plt.subplots(figsize=(1.2 + 0.8 * len(Ls), 1.2 + 0.45 * len(ds)))
    im = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto", origin="lower")
    ax.set_xticks(range(len(Ls)), [str(L) for L in Ls])
    ax.set_yticks(range(len(ds)), [f"{d:.2f}" for d in ds])
    ax.set_xlabel("context length (tokens)" + (f"; trained at {result.train_len}" if result.train_len else ""))
    ax.set_ylabel("depth")
    for i in range(len(ds)):
        for j in range(len(Ls)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=7, color="w")
    fig.colorbar(im, ax=ax, label="accuracy (%)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
