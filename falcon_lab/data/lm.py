"""The language-modelling datamodule (`data.name: lm`).

Sources (`data.source`, see sources.py): `kjv` (default; the embedded King James Bible), `text` / `jsonl`
(local files), `hf` (a Hugging Face dataset on disk, parquet/arrow/jsonl/txt files, or a hub dataset from
the local cache), `fineweb` (FineWeb-Edu streamed from the hub; not exercised in tests).

Documents are encoded by `data.doc_boundary`: `bos_eos` (default) [BOS] tokens [EOS], `eos` tokens [EOS]
(GPT-2 style: EOS separates documents), `none` plain concatenation; then packed into fixed rows of
`seq_len` (+1 for the shifted labels). With bos_eos the label is -100 where EOS is followed by the next
document's BOS (not a real prediction; ours). `dm.eos_id`, `dm.bos_id` and `dm.doc_starts(split)` (offsets
of the document starts in `dm.token_stream(split)`) expose the boundaries. With `data.cu_seqlens: true`
each batch also carries `cu_seqlens` over the flattened B*T tokens, so recurrent mixers reset their state
at every document start (and at row starts).

With `data.cache_dir` set, the splits are tokenised once, in `prepare_data` (local rank 0; the other ranks
wait), into memory-mapped shards every rank reads (shards.py); a rerun with the same corpus, tokenizer and
settings reuses them, and a learned BPE is saved beside them and reused. `data.cache_dir: auto` (the default
of data=kjv / text / jsonl) is the per-user cache `$FALCON_LAB_TOKEN_CACHE`, else
`$XDG_CACHE_HOME/falcon_lab/tokens`, else `~/.cache/falcon_lab/tokens` (`resolve_cache_dir`), so DDP ranks,
sweep workers and reruns share one tokenisation of a corpus; when that folder cannot be written, the run
tokenises in memory with a warning. `data.cache_dir: null` (or `FALCON_LAB_TOKEN_CACHE=off` for `auto`)
switches the cache off: each process tokenises in memory.

Training order is a pure function of (seed, global batch index): resuming at global step s continues
with exactly the batches an uninterrupted run would have seen, on any number of ranks.
"""
from __future__ import annotations

import logging
import os
import re
import zlib
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from falcon_lab.data import shards
from falcon_lab.data.sources import BOUNDARIES, Corpus
from falcon_lab.data.tokenizer import BPETokenizer, build_tokenizer

IGNORE = -100
log = logging.getLogger(__name__)
CACHE_ENV = "FALCON_LAB_TOKEN_CACHE"
_OFF = ("", "off", "none", "null", "false", "no", "0")


# ----------------------------------------------------------------------------------------- token cache
def default_token_cache() -> Path | None:
    """The per-user token cache `data.cache_dir: auto` stands for: $FALCON_LAB_TOKEN_CACHE (`off`: none), else
    $XDG_CACHE_HOME/falcon_lab/tokens, else ~/.cache/falcon_lab/tokens."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in _OFF else Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    try:
        base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    except RuntimeError:  # no home folder to be found: no default cache
        return None
    return base / "falcon_lab" / "tokens"


def resolve_cache_dir(value) -> Path | None:
    """The folder `data.cache_dir` names: None when off (null, false, `off`), the per-user cache for `auto`
    (default_token_cache), else the path (`~` expanded; relative to the current folder)."""
    if value is None or value is False:
        return None
    s = str(value).strip()
    if s.lower() in _OFF:
        return None
    if s.lower() == "auto":
        return default_token_cache()
    return Path(os.path.expanduser(s))


def _writable_dir(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


# ----------------------------------------------------------------------------------------- packing
def tokenize_documents(docs, tokenizer, boundary: str = "bos_eos") -> np.ndarray:
    """Concatenate the documents as int32, each as `boundary` says ([BOS] doc [EOS] by default)."""
    docs = list(docs)
    if not docs:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate(shards.encode_documents(docs, tokenizer, boundary)).astype(np.int32, copy=False)


class PackedRows(Dataset):
    """Row i = stream[i*T : i*T + T + 1] -> (input_ids, labels).

    No loss (-100) on the step from one document's EOS to the next one's BOS (`boundary="bos_eos"`; without
    `bos_id`, on every step from EOS), nor on predicting PAD where PAD is a token of its own."""

    def __init__(self, stream: np.ndarray, seq_len: int, eos_id: int, pad_id: int, bos_id: int | None = None,
                 boundary: str = "bos_eos"):
        self.stream, self.T, self.eos, self.pad, self.bos = stream, int(seq_len), eos_id, pad_id, bos_id
        self.boundary = boundary
        self.n = max(0, (len(stream) - 1) // self.T)
        if self.n == 0:
            raise ValueError(f"data.seq_len={seq_len}: the corpus split has only {len(stream)} tokens")

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        row = torch.from_numpy(np.asarray(self.stream[i * self.T: i * self.T + self.T + 1], dtype=np.int64))
        x, y = row[:-1].clone(), row[1:].clone()
        mask = torch.zeros_like(x, dtype=torch.bool)
        if self.boundary == "bos_eos":
            mask |= (x == self.eos) if self.bos is None else (x == self.eos) & (y == self.bos)
        if self.pad not in (self.eos, self.bos):
            mask |= y == self.pad
        y[mask] = IGNORE
        return x, y


def make_collate(bos_id: int, with_cu_seqlens: bool, boundary: str = "bos_eos", eos_id: int | None = None):
    def collate(items):
        x = torch.stack([a for a, _ in items])
        y = torch.stack([b for _, b in items])
        batch = {"input_ids": x, "labels": y}
        if with_cu_seqlens:
            batch["cu_seqlens"] = (cu_seqlens_from_eos(x, eos_id) if boundary == "eos"
                                   else cu_seqlens_from_bos(x, bos_id if boundary == "bos_eos" else None))
        return batch

    return collate


def _cu_seqlens(starts: torch.Tensor) -> torch.LongTensor:
    B, T = starts.shape
    starts[:, 0] = True
    idx = torch.nonzero(starts.reshape(-1), as_tuple=False).squeeze(1)
    return torch.cat([idx, idx.new_tensor([B * T])]).long()


def cu_seqlens_from_bos(input_ids: torch.Tensor, bos_id: int | None) -> torch.LongTensor:
    """Boundaries over the flattened [B*T] tokens: every row start and every BOS is a new sequence
    (bos_id None: row starts only)."""
    return _cu_seqlens(input_ids == bos_id if bos_id is not None else torch.zeros_like(input_ids, dtype=torch.bool))


def cu_seqlens_from_eos(input_ids: torch.Tensor, eos_id: int) -> torch.LongTensor:
    """Boundaries over the flattened [B*T] tokens: every row start and every token after an EOS."""
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    return _cu_seqlens(starts)


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


class LMDataModule(L.LightningDataModule):
    """Packed next-token prediction on a text corpus. Batches: {"input_ids", "labels"[, "cu_seqlens"]}."""

    def __init__(self, cfg, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.seed = int(cfg.get("seed", seed) if cfg.get("seed", None) is not None else seed)
        self.source = str(cfg.get("source", "kjv"))
        self.corpus = Corpus(cfg)
        self.doc_boundary = str(cfg.get("doc_boundary") or "bos_eos")
        if self.doc_boundary not in BOUNDARIES:
            raise ValueError(f"data.doc_boundary: {self.doc_boundary!r} is not one of {', '.join(BOUNDARIES)}")
        self.seq_len = int(cfg.seq_len)
        self.batch_size = int(cfg.batch_size)
        self.val_batch_size = int(cfg.get("val_batch_size") or cfg.batch_size)
        self.total_train_batches = None  # set by the training run (max_steps * accumulate)
        self._rows: dict[str, PackedRows] = {}
        self._streams: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._shard_dir: Path | None | bool = False  # False: not computed yet
        self._reported = False  # "token shards reused" logged once
        self.tokenizer = self._build_tokenizer()

    # -- boundaries
    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def bos_id(self) -> int:
        return self.tokenizer.bos_id

    def doc_starts(self, split: str) -> np.ndarray:
        """Offsets of the document starts in `token_stream(split)` (int64; the EOS before each start, the BOS
        at it, or neither, by data.doc_boundary)."""
        self.token_stream(split)
        return self._streams[self._split(split)][1]

    # -- tokenizer
    def _build_tokenizer(self):
        name = str(self.cfg.get("tokenizer", "byte"))
        if name != "bpe":
            return build_tokenizer(name)
        if self.source == "fineweb":
            raise ValueError("data.tokenizer=bpe is not supported with data.source=fineweb (use gpt2)")
        folder = self.shard_dir()
        saved = folder / "tokenizer.json" if folder is not None else None
        if saved is not None and saved.is_file():
            return BPETokenizer(saved.read_text(), source=str(saved))
        tok = BPETokenizer.train(self._iter_texts("train"), int(self.cfg.get("bpe_vocab_size") or 4096))
        if saved is not None:  # the first process to finish wins; every process then uses its file
            tok = BPETokenizer(shards.write_text_once(saved, tok.to_json()), source=str(saved))
            log.info("data: learned a %d-token BPE on the training split, saved to %s", tok.n_tokens, saved)
        return tok

    def _tokenizer_identity(self) -> str:
        if str(self.cfg.get("tokenizer", "byte")) == "bpe":  # learned from the corpus and these settings
            return f"bpe:{int(self.cfg.get('bpe_vocab_size') or 4096)}"
        tok = self.tokenizer
        return tok.identity() if hasattr(tok, "identity") else str(getattr(tok, "name", type(tok).__name__))

    # -- documents per split
    def _split(self, split: str) -> str:
        return "validation" if split == "test" and "test" not in self.corpus.split_names() else split

    def documents(self, split: str) -> list[str] | None:
        """The texts of a split as a list (None for the streamed fineweb)."""
        texts = self.corpus.split(split)
        return None if texts is None else list(texts)

    def _text_batches(self, split: str, size: int = 1024):
        if self.source == "fineweb":
            yield from self._fineweb_batches(split, size)
            return
        texts = self.corpus.split(split)
        if hasattr(texts, "batches"):
            yield from texts.batches(size)
        else:
            for i in range(0, len(texts), size):
                yield texts[i: i + size]

    def _iter_texts(self, split: str):
        for b in self._text_batches(split):
            yield from b

    def _budget(self, split: str) -> int | None:
        mt = self.cfg.get("max_tokens")
        if self.source == "fineweb":
            budget = int(mt or 50_000_000)
            return budget if split == "train" else max(budget // 100, self.seq_len * 64)
        return int(mt) if mt and split == "train" else None

    def _fineweb_batches(self, split: str, size: int):
        import datasets

        name = self.cfg.get("hf_name", "HuggingFaceFW/fineweb-edu")
        try:
            ds = datasets.load_dataset(name, self.cfg.get("hf_config", "sample-10BT"), split="train", streaming=True)
            field = str(self.cfg.get("text_field") or "text")
            batch = []
            for i, ex in enumerate(ds):
                is_val = zlib.crc32(str(i).encode()) % 100 < 1  # ours: 1% of documents held out
                if is_val == (split != "train"):
                    batch.append(ex[field])
                    if len(batch) == size:
                        yield batch
                        batch = []
            if batch:
                yield batch
        except (ConnectionError, OSError) as e:
            raise ConnectionError(
                f"data=fineweb streams {name} from the Hugging Face Hub, which could not be reached "
                f"({type(e).__name__}: {str(e)[:200]}). Offline, use a copy on disk: data=hf data.path=<folder> "
                f"(save_to_disk or parquet files), or data=hf data.hf_name={name} data.hf_config=... once it is "
                f"in the local cache") from None

    # -- token shards
    def shard_dir(self) -> Path | None:
        """The shard folder of these settings under data.cache_dir (None without a cache_dir)."""
        if self._shard_dir is not False:
            return self._shard_dir
        cache = resolve_cache_dir(self.cfg.get("cache_dir"))
        if cache is None:
            self._shard_dir = None
            return None
        c = self.cfg
        inputs = {"format": shards.FORMAT, "source": self.source, "corpus": self.corpus.fingerprint(),
                  "tokenizer": self._tokenizer_identity(), "doc_boundary": self.doc_boundary,
                  "max_tokens": c.get("max_tokens"), "val_percent": c.get("val_percent", 2.0),
                  "sample_by": c.get("sample_by", "document"),
                  "column": c.get("text_column") or c.get("text_field") or "text",
                  "splits": [c.get("train_split"), c.get("val_split")]}
        if self.source == "fineweb":
            inputs["val_budget"] = self._budget("validation")
        what = {"hf": c.get("path") or c.get("hf_name"), "text": c.get("path"), "jsonl": c.get("path")}.get(self.source)
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(str(what)).name)[:40] if what else ""
        name = "-".join(x for x in (self.source, slug, shards.shard_key(inputs)) if x)
        folder = cache.resolve() / name
        auto = str(c.get("cache_dir")).strip().lower() == "auto"
        if auto and shards.read_meta(folder) is None and not _writable_dir(folder.parent):
            # the default cache is a convenience: a read-only or full home must not stop the run
            log.warning("data: the token cache %s cannot be written; tokenising in memory (set data.cache_dir to a "
                        "writable folder, or data.cache_dir=null to silence this)", folder.parent)
            self._shard_dir = None
            return None
        self._shard_dir = folder
        self._shard_inputs = inputs
        return self._shard_dir

    def prepare_data(self):
        """Tokenise every split into the shards once (Lightning calls this on local rank 0 only)."""
        if self.shard_dir() is not None:
            self._ensure_shards()

    def _ensure_shards(self) -> dict:
        folder = self.shard_dir()
        meta = shards.read_meta(folder)
        if meta is not None and shards.is_complete(folder, meta):
            if not self._reported:
                self._reported = True
                log.info("data: token shards reused from %s", folder)
            return meta
        tok = self.tokenizer
        dtype = shards.token_dtype(tok.vocab_size)
        info = {}
        for split in self.corpus.split_names():
            info[split] = shards.write_split(folder, split, self._text_batches(split), tok, self.doc_boundary,
                                             dtype, self._budget(split))
        if hasattr(tok, "to_json") and not (folder / "tokenizer.json").is_file():
            shards.write_text_atomic(folder / "tokenizer.json", tok.to_json())
        meta = {"format": shards.FORMAT, "dtype": np.dtype(dtype).name, "splits": info,
                "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id, "vocab_size": tok.vocab_size,
                "tokenizer": getattr(tok, "name", None), "doc_boundary": self.doc_boundary,
                "inputs": self._shard_inputs}
        shards.write_meta(folder, meta)
        log.info("data: tokenised into %s (%s)", folder,
                 ", ".join(f"{s} {v['tokens']:,} tokens / {v['documents']:,} docs" for s, v in info.items()))
        return meta

    def token_stream(self, split: str) -> np.ndarray:
        split = self._split(split)
        if split not in self._streams:
            folder = self.shard_dir()
            if folder is not None:
                self._streams[split] = shards.read_split(folder, split, self._ensure_shards())
            else:
                self._streams[split] = shards.tokenize_in_memory(self._text_batches(split), self.tokenizer,
                                                                 self.doc_boundary, self._budget(split))
        return self._streams[split][0]

    def rows(self, split: str) -> PackedRows:
        if split not in self._rows:
            stream = self.token_stream(split)
            try:
                self._rows[split] = PackedRows(stream, self.seq_len, self.tokenizer.eos_id, self.tokenizer.pad_id,
                                               self.tokenizer.bos_id, self.doc_boundary)
            except ValueError:
                where = {"kjv": "the embedded corpus", "fineweb": "fineweb"}.get(
                    self.source, f"data.path={self.cfg.get('path')}" if self.cfg.get("path")
                    else f"data.hf_name={self.cfg.get('hf_name')}")
                raise ValueError(f"data.seq_len={self.seq_len}: the {split} split of {where} has only {len(stream)} "
                                 f"tokens; a row needs seq_len + 1 (more text, a smaller seq_len, or another "
                                 f"data.val_percent / validation split)") from None
        return self._rows[split]

    def setup(self, stage=None):
        self.rows("train")
        self.rows("validation")

    def _collate(self):
        return make_collate(self.tokenizer.bos_id, bool(self.cfg.get("cu_seqlens", False)), self.doc_boundary,
                            self.tokenizer.eos_id)

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
        return DataLoader(self.rows("test") if self.source == "kjv" else self.rows("validation"),
                          batch_size=self.val_batch_size, shuffle=False, collate_fn=self._collate())
