"""Perplexity on held-out text: summed NLL in fp32 over every predicted token, reported per token,
per byte (bits per byte) and per word; and the loss-vs-position curve for length extrapolation.

Documents are scored separately (lm-eval's rolling convention): a document's tokens are preceded by
BOS and cut into windows of at most ``max_length`` model inputs; every token is predicted exactly
once; with ``stride < max_length`` each later window keeps ``max_length - stride`` tokens of
context (sliding-window perplexity). Per-word perplexity counts whitespace-separated words of the
original text, per-byte its UTF-8 bytes (the paper's "Wiki." column is word perplexity in lm-eval's
convention; reference §8.3).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import torch

from falcon_lab.evaluation.common import as_tokenizer, model_device, safe_exp, score_continuations


@dataclass
class PerplexityResult:
    name: str
    nll_sum: float
    n_tokens: int
    n_bytes: int
    n_words: int
    n_docs: int
    max_length: int
    stride: int

    @property
    def loss(self) -> float:
        return self.nll_sum / max(self.n_tokens, 1)

    @property
    def ppl(self) -> float:
        return safe_exp(self.loss)

    @property
    def bits_per_byte(self) -> float:
        return self.nll_sum / max(self.n_bytes, 1) / math.log(2)

    @property
    def word_ppl(self) -> float:
        return safe_exp(self.nll_sum / max(self.n_words, 1))

    @property
    def byte_ppl(self) -> float:
        return safe_exp(self.nll_sum / max(self.n_bytes, 1))

    def metrics(self, prefix: str | None = None) -> dict[str, float]:
        p = prefix if prefix is not None else f"ppl/{self.name}/"
        return {p + "loss": self.loss, p + "ppl": self.ppl, p + "bits_per_byte": self.bits_per_byte,
                p + "word_ppl": self.word_ppl, p + "byte_ppl": self.byte_ppl,
                p + "tokens": float(self.n_tokens)}

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(loss=self.loss, ppl=self.ppl, bits_per_byte=self.bits_per_byte,
                 word_ppl=self.word_ppl, byte_ppl=self.byte_ppl)
        return d


def rolling_pairs(tokens: Sequence[int], prefix_id: int, max_length: int,
                  stride: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs that predict every token of ``tokens`` exactly once, each
    model input at most ``max_length`` tokens, the first conditioned on ``prefix_id`` only."""
    if max_length < 1:
        raise ValueError(f"max_length={max_length}: must be >= 1")
    stride = max_length if stride is None else stride
    if not 1 <= stride <= max_length:
        raise ValueError(f"stride={stride}: must be in [1, max_length={max_length}]")
    full = [prefix_id] + list(tokens)
    n = len(tokens)
    out = []
    s, e = 0, min(max_length, n)
    while s < n:
        a = max(0, e - max_length)
        out.append((full[a:s + 1], full[s + 1:e + 1]))
        s, e = e, min(e + stride, n)
    return out


def perplexity(model, tokenizer, texts: Iterable[str], *, name: str = "text", max_length: int = 512,
               stride: int | None = None, batch_size: int = 8, progress: bool = False) -> PerplexityResult:
    tok = as_tokenizer(tokenizer)
    pairs, n_bytes, n_words, n_docs = [], 0, 0, 0
    for doc in texts:
        if not doc:
            continue
        ids = tok.encode(doc)
        pairs.extend(rolling_pairs(ids, tok.bos_id, max_length, stride))
        n_bytes += len(doc.encode("utf-8"))
        n_words += len(doc.split())
        n_docs += 1
    if not pairs:
        raise ValueError(f"perplexity[{name}]: no text to score")
    scores = score_continuations(model, pairs, batch_size=batch_size, max_length=max_length,
                                 pad_id=tok.pad_id, progress=progress, desc=f"ppl {name}")
    nll = -sum(s.logprob for s in scores)
    ntok = sum(s.n_tokens for s in scores)
    return PerplexityResult(name, nll, ntok, n_bytes, n_words, n_docs, max_length,
                            stride or max_length)


# ---------------------------------------------------------------------------------------------
# length extrapolation: loss vs position
# ---------------------------------------------------------------------------------------------
@dataclass
class PositionCurve:
    name: str
    seq_len: int
    train_len: int | None
    n_windows: int
    loss: list[float] = field(repr=False)  # mean NLL at each position 0..seq_len-1

    def buckets(self, n: int = 32) -> list[tuple[int, float]]:
        """(last position of bucket, mean loss in bucket) for ``n`` equal buckets."""
        T = len(self.loss)
        n = max(1, min(n, T))
        out = []
        for i in range(n):
            a, b = i * T // n, (i + 1) * T // n
            if b > a:
                out.append((b, sum(self.loss[a:b]) / (b - a)))
        return out

    def metrics(self) -> dict[str, float]:
        m = {}
        tl = self.train_len
        if tl and tl < self.seq_len:
            inside = self.loss[:tl]
            beyond = self.loss[tl:]
            m[f"extrap/{self.name}/loss_within_train_len"] = sum(inside) / len(inside)
            m[f"extrap/{self.name}/loss_beyond_train_len"] = sum(beyond) / len(beyond)
        m[f"extrap/{self.name}/loss_last_bucket"] = self.buckets()[-1][1]
        return m

    def to_dict(self):
        return {"name": self.name, "seq_len": self.seq_len, "train_len": self.train_len,
                "n_windows": self.n_windows, "buckets": self.buckets(), "loss": self.loss}


@torch.no_grad()
def position_curve(model, tokenizer, texts: Iterable[str], *, seq_len: int, n_windows: int = 8,
                   train_len: int | None = None, batch_size: int = 4, name: str = "text") -> PositionCurve:
    """Mean next-token NLL at each position of ``n_windows`` windows of ``seq_len`` tokens cut from
    the concatenated documents (BOS at each window start; ours), to see whether the loss keeps
    falling, stays flat or blows up past the training length."""
    tok = as_tokenizer(tokenizer)
    stream: list[int] = []
    need = n_windows * seq_len
    for doc in texts:
        stream.extend(tok.encode(doc))
        stream.append(tok.eos_id)
        if len(stream) >= need:
            break
    k = min(n_windows, len(stream) // seq_len)
    if k < 1:
        raise ValueError(f"position_curve[{name}]: text has {len(stream)} tokens, fewer than "
                         f"seq_len={seq_len}")
    device = model_device(model)
    total = torch.zeros(seq_len, dtype=torch.float64)
    for s in range(0, k, batch_size):
        rows = [stream[i * seq_len:(i + 1) * seq_len] for i in range(s, min(k, s + batch_size))]
        tgt = torch.tensor(rows, dtype=torch.long, device=device)
        inp = torch.cat([torch.full_like(tgt[:, :1], tok.bos_id), tgt[:, :-1]], dim=1)
        lp = torch.log_softmax(model(inp).float(), -1)
        nll = -lp.gather(-1, tgt[..., None])[..., 0]
        total += nll.double().sum(0).cpu()
    return PositionCurve(name, seq_len, train_len, k, (total / k).tolist())


# ---------------------------------------------------------------------------------------------
# text sources
# ---------------------------------------------------------------------------------------------
HUB_SOURCES = {
    # name: (dataset path, config, split, text field) -- ours: the document-level WikiText-2 test
    # split lm-eval's `wikitext` task uses, LAMBADA (OpenAI) test, FineWeb-Edu's held-out documents
    "wikitext": ("EleutherAI/wikitext_document_level", "wikitext-2-raw-v1", "test", "page"),
    "lambada": ("EleutherAI/lambada_openai", "default", "test", "text"),
    "fineweb_edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", "text"),
}


class SourceUnavailable(RuntimeError):
    """A text source that cannot be read here (offline hub, missing file)."""


def load_texts(source: str, *, max_docs: int | None = None, max_chars: int | None = None,
               data_cfg=None) -> list[str]:
    """Documents of ``source``:

    - ``corpus``: the validation split of the checkpoint's training text (``data_cfg``; without one,
      the embedded corpus's validation split);
    - ``text:PATH`` / ``*.txt``: a text file, documents separated by blank lines (ours);
    - ``jsonl:PATH`` / ``*.jsonl``: one JSON object per line with a ``text`` field;
    - ``wikitext``, ``lambada``, ``fineweb_edu``: through ``datasets`` when the hub (or its cache)
      is reachable; FineWeb-Edu streams the first ``max_docs`` of the documents the platform's LM
      datamodule holds out of FineWeb training (its 1% hash split of stream indices; the sample has
      no validation split of its own).
    """
    if source == "corpus":
        docs = _corpus_val_texts(data_cfg)
    elif source.startswith("text:") or (source.endswith(".txt") and ":" not in source):
        path = source.split(":", 1)[1] if source.startswith("text:") else source
        docs = _read_text(path)
    elif source.startswith("jsonl:") or (source.endswith(".jsonl") and ":" not in source):
        path = source.split(":", 1)[1] if source.startswith("jsonl:") else source
        docs = _read_jsonl(path)
    elif source in HUB_SOURCES:
        docs = _hub_texts(source, max_docs)
    else:
        raise ValueError(f"ppl source {source!r}: expected 'corpus', 'text:PATH', 'jsonl:PATH' or one "
                         f"of {sorted(HUB_SOURCES)}")
    docs = [d for d in docs if d and d.strip()]
    if max_docs is not None:
        docs = docs[:max_docs]
    if max_chars is not None:
        out, n = [], 0
        for d in docs:
            if n >= max_chars:
                break
            out.append(d[:max_chars - n])
            n += len(out[-1])
        docs = out
    return docs


def _read_text(path):
    if not os.path.isfile(path):
        raise SourceUnavailable(f"ppl text file not found: {path}")
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    return [d.strip() for d in raw.split("\n\n")]


def _read_jsonl(path):
    if not os.path.isfile(path):
        raise SourceUnavailable(f"ppl jsonl file not found: {path}")
    docs = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            obj = json.loads(line)
            if "text" not in obj:
                raise ValueError(f"{path}:{i + 1}: jsonl record has no 'text' field")
            docs.append(obj["text"])
    return docs


def _hub_texts(source, max_docs):
    path, config, split, fieldname = HUB_SOURCES[source]
    try:
        import datasets
        if source == "fineweb_edu":
            import zlib
            ds = datasets.load_dataset(path, config, split=split, streaming=True)
            out = []
            for i, ex in enumerate(ds):
                # the documents the LM datamodule holds out of FineWeb training (its 1% hash split)
                if zlib.crc32(str(i).encode()) % 100 >= 1:
                    continue
                out.append(ex[fieldname])
                if len(out) >= (max_docs or 200):
                    break
            return out
        ds = datasets.load_dataset(path, config, split=split)
        return [ex[fieldname] for ex in ds]
    except Exception as e:  # offline, not cached, or hub error: the suite reports it as unavailable
        raise SourceUnavailable(f"ppl source {source!r} ({path}/{config}) not reachable: "
                                f"{type(e).__name__}: {str(e)[:200]}") from e


def _corpus_val_texts(data_cfg):
    """Validation documents of the training data config (``data.name: lm``: the embedded corpus or
    local text/jsonl, through the LM datamodule's own split)."""
    if data_cfg is None:
        from falcon_lab.data.corpus import load_kjv
        return [d["text"] for d in load_kjv("validation")]
    if data_cfg.get("name") != "lm":
        raise SourceUnavailable(f"ppl source 'corpus': the checkpoint was trained on data.name="
                                f"{data_cfg.get('name')!r}, which has no text corpus")
    from falcon_lab.data import build_datamodule
    docs = build_datamodule(data_cfg).documents("validation")
    if docs is None:
        raise SourceUnavailable("ppl source 'corpus': streamed sources (fineweb) have no document list; "
                                "use ppl.sources=[fineweb_edu]")
    return docs
