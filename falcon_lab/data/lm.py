"""The language-modelling datamodule (`data.name: lm`).

Sources (`data.source`):
- `kjv` (default): the embedded King James Bible, chapters as documents, hash split (corpus.py).
- `text` / `jsonl`: local files (`data.path`: a file, a directory or a glob; `data.text_field` for jsonl;
  `data.val_path` optional, otherwise a deterministic hash split of documents, `data.val_percent`).
- `fineweb`: FineWeb-Edu through `datasets` streaming (needs the hub; not exercised in tests). The first
  `data.max_tokens` tokens are tokenised once into a memory-mapped .npy under `data.cache_dir`.

Documents are encoded as [BOS] + tokens + [EOS] and packed into fixed rows of `seq_len` (+1 for the
shifted labels). Labels are -100 where the input token is EOS (the next document's BOS is not a real
prediction; ours). With `data.cu_seqlens: true` each batch also carries `cu_seqlens` over the flattened
B*T tokens, so recurrent mixers reset their state at every document start (and at row starts).

Training order is a pure function of (seed, global batch index): resuming at global step s continues
with exactly the batches an uninterrupted run would have seen, on any number of ranks.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import zlib
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from falcon_lab.data.corpus import load_kjv
from falcon_lab.data.registry import register_datamodule
from falcon_lab.data.tokenizer import build_tokenizer

IGNORE = -100


# ----------------------------------------------------------------------------------------- documents
def _resolve_files(path: str, key: str = "data.path") -> list[str]:
    p = os.path.expanduser(str(path))
    if os.path.isdir(p):
        files = sorted(
            f for ext in ("*.txt", "*.jsonl", "*.json", "*.txt.gz", "*.jsonl.gz")
            for f in glob.glob(os.path.join(p, "**", ext), recursive=True)
        )
    elif any(ch in p for ch in "*?["):
        files = sorted(glob.glob(p, recursive=True))
    else:
        files = [p] if os.path.isfile(p) else []
    if not files:
        raise FileNotFoundError(f"{key}: no data files found at {path!r}")
    return files


def _local_documents(files: list[str], source: str, text_field: str, sample_by: str) -> list[str]:
    import datasets

    if source == "jsonl":
        ds = datasets.load_dataset("json", data_files=files, split="train")
        if text_field not in ds.column_names:
            raise KeyError(f"data.text_field: field {text_field!r} not in {ds.column_names} of {files[0]}")
        return [t for t in ds[text_field] if t]
    ds = datasets.load_dataset("text", data_files=files, split="train", sample_by=sample_by)
    return [t for t in ds["text"] if t and t.strip()]


def _hash_split(docs: list[str], val_percent: float) -> dict[str, list[str]]:
    out = {"train": [], "validation": []}
    for i, d in enumerate(docs):
        h = zlib.crc32(f"{i}".encode()) % 10000
        out["validation" if h < val_percent * 100 else "train"].append(d)
    return out


# ----------------------------------------------------------------------------------------- packing
def tokenize_documents(docs, tokenizer) -> np.ndarray:
    """Concatenate [BOS] doc [EOS] ... as int32 (the byte tokenizer takes a numpy fast path)."""
    docs = list(docs)
    if not docs:
        return np.zeros(0, dtype=np.int32)
    if hasattr(tokenizer, "encode_array"):
        parts = [tokenizer.encode_array(t, add_bos=True, add_eos=True) for t in docs]
    else:
        parts = [np.asarray(tokenizer.encode(t, add_bos=True, add_eos=True), dtype=np.int32) for t in docs]
    return np.concatenate(parts).astype(np.int32, copy=False)


class PackedRows(Dataset):
    """Row i = stream[i*T : i*T + T + 1] -> (input_ids, labels)."""

    def __init__(self, stream: np.ndarray, seq_len: int, eos_id: int, pad_id: int):
        self.stream, self.T, self.eos, self.pad = stream, int(seq_len), eos_id, pad_id
        self.n = max(0, (len(stream) - 1) // self.T)
        if self.n == 0:
            raise ValueError(f"data.seq_len={seq_len}: the corpus split has only {len(stream)} tokens")

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        row = torch.from_numpy(np.asarray(self.stream[i * self.T: i * self.T + self.T + 1], dtype=np.int64))
        x, y = row[:-1].clone(), row[1:].clone()
        y[(x == self.eos) | (y == self.pad)] = IGNORE
        return x, y


def make_collate(bos_id: int, with_cu_seqlens: bool):
    def collate(items):
        x = torch.stack([a for a, _ in items])
        y = torch.stack([b for _, b in items])
        batch = {"input_ids": x, "labels": y}
        if with_cu_seqlens:
            batch["cu_seqlens"] = cu_seqlens_from_bos(x, bos_id)
        return batch

    return collate


def cu_seqlens_from_bos(input_ids: torch.Tensor, bos_id: int) -> torch.LongTensor:
    """Boundaries over the flattened [B*T] tokens: every row start and every BOS is a new sequence."""
    B, T = input_ids.shape
    starts = input_ids == bos_id
    starts[:, 0] = True
    idx = torch.nonzero(starts.reshape(-1), as_tuple=False).squeeze(1)
    return torch.cat([idx, idx.new_tensor([B * T])]).long()


class StepBatchSampler(Sampler):
    """Global batch g = rows perm_e[(g*GB + j) mod n], epoch e = (g*GB + j) // n, perm_e = randperm(n, seed+e).

    Each rank takes its slice [rank*B : (rank+1)*B] of every global batch. Starting at `start_batch`
    reproduces an uninterrupted run exactly (ours).

    The whole run is ONE Lightning epoch of `total_batches` batches, and `len()` is that, also when resuming:
    Lightning restores its in-epoch batch counter to `start_batch` and counts the batches still to come on top
    of it (epoch end when counter == len, `is_last_batch` when start + fetched >= len). A length of
    `total - start` made it end the epoch early (resuming before the midpoint) or after one batch (past it),
    then iterate this sampler again from `start_batch`: batches trained twice (issue 16)."""

    def __init__(self, n_rows, batch_size, seed, start_batch=0, total_batches=None, rank=0, world_size=1):
        self.n, self.B, self.seed = n_rows, batch_size, seed
        self.start, self.total = start_batch, total_batches
        self.rank, self.world = rank, world_size
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, e):
        if e not in self._perms:
            g = torch.Generator().manual_seed(self.seed + e)
            self._perms = {e: torch.randperm(self.n, generator=g)}
        return self._perms[e]

    def __len__(self):
        # the epoch's length, not what is left of it (see the class docstring)
        if self.total is None:
            return 10**12
        return max(0, self.total)

    def __iter__(self):
        GB = self.B * self.world
        g = self.start
        while self.total is None or g < self.total:
            pos = g * GB + self.rank * self.B
            yield [int(self._perm((pos + j) // self.n)[(pos + j) % self.n]) for j in range(self.B)]
            g += 1


class StepDataLoader(DataLoader):
    """The training DataLoader over a StepBatchSampler. Its position needs no saved state: the sampler starts
    at global_step * accumulate_grad_batches, which the checkpoint restores. state_dict/load_state_dict make
    Lightning treat it as resumable (so it does not warn "your dataloader is not resumable" on every
    mid-run resume, which is exact)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


@register_datamodule("lm")
class LMDataModule(L.LightningDataModule):
    """Packed next-token prediction on a text corpus. Batches: {"input_ids", "labels"[, "cu_seqlens"]}."""

    def __init__(self, cfg, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.seed = int(cfg.get("seed", seed) if cfg.get("seed", None) is not None else seed)
        name = cfg.get("tokenizer", "byte")
        if name == "bpe":
            if cfg.get("source", "kjv") == "fineweb":
                raise ValueError("data.tokenizer=bpe is not supported with data.source=fineweb (use gpt2)")
            self.tokenizer = build_tokenizer("bpe", self.documents("train"), int(cfg.get("bpe_vocab_size") or 4096))
        else:
            self.tokenizer = build_tokenizer(name)
        self.seq_len = int(cfg.seq_len)
        self.batch_size = int(cfg.batch_size)
        self.val_batch_size = int(cfg.get("val_batch_size") or cfg.batch_size)
        self.total_train_batches = None  # set by the training run (max_steps * accumulate)
        self._rows: dict[str, PackedRows] = {}

    # -- documents per split
    def documents(self, split: str) -> list[str]:
        src = self.cfg.get("source", "kjv")
        if src == "kjv":
            return [d["text"] for d in load_kjv(split)]
        if src in ("text", "jsonl"):
            if not self.cfg.get("path"):
                raise ValueError(f"data.path is required for data.source={src}")
            files = _resolve_files(self.cfg.path)
            sample_by = self.cfg.get("sample_by", "document")
            field = self.cfg.get("text_field", "text")
            if self.cfg.get("val_path"):
                if split == "train":
                    return _local_documents(files, src, field, sample_by)
                return _local_documents(_resolve_files(self.cfg.val_path, "data.val_path"), src, field, sample_by)
            docs = _hash_split(_local_documents(files, src, field, sample_by), float(self.cfg.get("val_percent", 2.0)))
            return docs["train" if split == "train" else "validation"]
        if src == "fineweb":
            return None  # handled by _fineweb_stream
        raise ValueError(f"data.source: unknown source {src!r} (kjv | text | jsonl | fineweb)")

    def _cache_path(self, split: str) -> Path | None:
        cache = self.cfg.get("cache_dir")
        if not cache:
            return None
        key = json.dumps({k: str(self.cfg.get(k)) for k in ("source", "path", "val_path", "text_field",
                          "tokenizer", "bpe_vocab_size", "sample_by", "val_percent", "max_tokens", "hf_name", "hf_config")}
                         | {"split": split}, sort_keys=True)
        return Path(cache).expanduser().resolve() / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.npy"

    def _fineweb_stream(self, split: str) -> np.ndarray:
        import datasets

        name = self.cfg.get("hf_name", "HuggingFaceFW/fineweb-edu")
        ds = datasets.load_dataset(name, self.cfg.get("hf_config", "sample-10BT"), split="train", streaming=True)
        budget = int(self.cfg.get("max_tokens") or 50_000_000)
        if split != "train":
            budget = max(budget // 100, self.seq_len * 64)
        field = self.cfg.get("text_field", "text")
        chunks, n = [], 0
        for i, ex in enumerate(ds):
            is_val = zlib.crc32(str(i).encode()) % 100 < 1  # ours: 1% of documents held out
            if is_val != (split != "train"):
                continue
            ids = np.asarray(self.tokenizer.encode(ex[field], add_bos=True, add_eos=True), dtype=np.int32)
            chunks.append(ids)
            n += len(ids)
            if n >= budget:
                break
        return np.concatenate(chunks)

    def token_stream(self, split: str) -> np.ndarray:
        path = self._cache_path(split)
        if path is not None and path.exists():
            return np.load(path, mmap_mode="r")
        if self.cfg.get("source", "kjv") == "fineweb":
            stream = self._fineweb_stream(split)
        else:
            stream = tokenize_documents(self.documents(split), self.tokenizer)
            mt = self.cfg.get("max_tokens")
            if mt and split == "train":
                stream = stream[: int(mt)]
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
            np.save(tmp, stream)
            os.replace(tmp, path)
            return np.load(path, mmap_mode="r")
        return stream

    def rows(self, split: str) -> PackedRows:
        if split not in self._rows:
            self._rows[split] = PackedRows(self.token_stream(split), self.seq_len,
                                           self.tokenizer.eos_id, self.tokenizer.pad_id)
        return self._rows[split]

    def setup(self, stage=None):
        self.rows("train")
        self.rows("validation")

    def _collate(self):
        return make_collate(self.tokenizer.bos_id, bool(self.cfg.get("cu_seqlens", False)))

    def train_dataloader(self):
        rows = self.rows("train")
        start, rank, world = 0, 0, 1
        total = self.total_train_batches
        if self.trainer is not None:
            accum = int(self.trainer.accumulate_grad_batches)
            start = int(self.trainer.global_step) * accum
            rank, world = int(self.trainer.global_rank), int(self.trainer.world_size)
            if total is None and self.trainer.max_steps and self.trainer.max_steps > 0:
                total = int(self.trainer.max_steps) * accum
        sampler = StepBatchSampler(len(rows), self.batch_size, self.seed, start, total, rank, world)
        return StepDataLoader(rows, batch_sampler=sampler, collate_fn=self._collate(),
                              num_workers=int(self.cfg.get("num_workers", 0)))

    def val_dataloader(self):
        rows = self.rows("validation")
        if self.trainer is not None and self.trainer.world_size > 1:
            # rank r scores rows r, r+W, ... without padding duplicates, so the summed NLL reduced over
            # ranks is exactly the single-process sum
            rows = Subset(rows, list(range(self.trainer.global_rank, len(rows), self.trainer.world_size)))
        return DataLoader(rows, batch_size=self.val_batch_size, shuffle=False, collate_fn=self._collate(),
                          num_workers=int(self.cfg.get("num_workers", 0)))

    def test_dataloader(self):
        return DataLoader(self.rows("test") if self.cfg.get("source", "kjv") == "kjv" else self.rows("validation"),
                          batch_size=self.val_batch_size, shuffle=False, collate_fn=self._collate())
