"""Token shards: a split tokenised once into a flat memory-mapped file every rank reads.

A shard folder `<data.cache_dir>/<source>-<key>/` (`data.cache_dir: auto`: the per-user cache,
~/.cache/falcon_lab/tokens by default; see lm.resolve_cache_dir) holds, per split, `<split>.bin` (the packed
token stream, raw uint16 when the vocabulary fits, else int32) and `<split>.docs.npy` (int64 offsets of the document
starts in it), the tokenizer (`tokenizer.json`, for Hugging Face tokenizers: the learned BPE lives here
and is reused), and `meta.json`, written last: a folder without it is unfinished and rebuilt. The key is a
hash of everything the tokens depend on (corpus fingerprint, tokenizer, document boundary, caps), so a
rerun with the same settings reuses the shards and a changed setting or file gets new ones. Every file is
written under a temporary name and renamed into place, so concurrent writers (one per node) are safe.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
from pathlib import Path
from typing import Iterable

import numpy as np

FORMAT = 1


def shard_key(inputs: dict) -> str:
    return hashlib.sha1(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _tmp(path: Path) -> Path:
    # unique per host, process and thread: concurrent writers never share a temporary file
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}")


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def write_text_once(path: Path, text: str) -> str:
    """Put `text` at `path` unless another process got there first; returns what is at `path` then (so
    processes that each computed a file, e.g. every rank learning the BPE, all end up using the same one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(path)
    tmp.write_text(text)
    try:
        os.link(tmp, path)  # atomic, and fails if the file exists
    except FileExistsError:
        pass
    except OSError:  # a file system without hard links
        if not path.exists():
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text()


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2 ** 16 else np.int32


def encode_documents(texts: list[str], tokenizer, boundary: str = "bos_eos") -> list[np.ndarray]:
    """Each text as int32 ids: [BOS] ids [EOS] (bos_eos), ids [EOS] (eos) or ids (none)."""
    bos, eos = boundary == "bos_eos", boundary in ("bos_eos", "eos")
    if hasattr(tokenizer, "encode_array"):  # the byte tokenizer's numpy fast path
        return [tokenizer.encode_array(t, add_bos=bos, add_eos=eos) for t in texts]
    if hasattr(tokenizer, "encode_batch"):
        bodies = tokenizer.encode_batch(list(texts))
    else:
        bodies = [tokenizer.encode(t) for t in texts]
    pre = np.asarray([tokenizer.bos_id] if bos else [], np.int32)
    post = np.asarray([tokenizer.eos_id] if eos else [], np.int32)
    return [np.concatenate([pre, np.asarray(b, np.int32), post]) for b in bodies]


def tokenize_in_memory(batches: Iterable[list[str]], tokenizer, boundary: str,
                       max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(int32 stream, int64 document starts) of the texts, cut at max_tokens."""
    parts, n = [], 0
    for texts in batches:
        new = encode_documents(texts, tokenizer, boundary)
        parts += new
        n += sum(len(p) for p in new)
        if max_tokens and n >= max_tokens:
            break
    lens = np.asarray([len(p) for p in parts], np.int64)
    stream = np.concatenate(parts).astype(np.int32, copy=False) if parts else np.zeros(0, np.int32)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if len(lens) else np.zeros(0, np.int64)
    if max_tokens and len(stream) > max_tokens:
        stream, starts = stream[: int(max_tokens)], starts[starts < int(max_tokens)]
    return stream, starts


def write_split(folder: Path, split: str, batches: Iterable[list[str]], tokenizer, boundary: str, dtype,
                max_tokens: int | None = None) -> dict:
    """Tokenise the texts into folder/<split>.bin (+ .docs.npy), streaming; returns {tokens, documents}."""
    folder.mkdir(parents=True, exist_ok=True)
    path, docs_path = folder / f"{split}.bin", folder / f"{split}.docs.npy"
    tmp = _tmp(path)
    starts: list[int] = []
    n = 0
    with open(tmp, "wb") as f:
        for texts in batches:
            for ids in encode_documents(texts, tokenizer, boundary):
                if max_tokens and n + len(ids) > max_tokens:
                    ids = ids[: int(max_tokens) - n]
                if len(ids) == 0:
                    continue
                starts.append(n)
                f.write(ids.astype(dtype, copy=False).tobytes())
                n += len(ids)
            if max_tokens and n >= max_tokens:
                break
    tmp_docs = _tmp(docs_path)
    with open(tmp_docs, "wb") as f:
        np.save(f, np.asarray(starts, np.int64))
    os.replace(tmp, path)
    os.replace(tmp_docs, docs_path)
    return {"tokens": n, "documents": len(starts)}


def write_meta(folder: Path, meta: dict) -> None:
    write_text_atomic(folder / "meta.json", json.dumps(meta, indent=1, sort_keys=True, default=str))


def read_meta(folder: Path) -> dict | None:
    p = folder / "meta.json"
    if not p.is_file():
        return None
    meta = json.loads(p.read_text())
    return meta if meta.get("format") == FORMAT else None


def is_complete(folder: Path, meta: dict) -> bool:
    """Every split's files are there with the size meta.json gives (a folder someone half-deleted, or a disk
    that filled up, is rebuilt instead of failing in the memory map)."""
    try:
        item = np.dtype(meta["dtype"]).itemsize
        for split, info in meta["splits"].items():
            if os.path.getsize(folder / f"{split}.bin") != int(info["tokens"]) * item or \
                    not (folder / f"{split}.docs.npy").is_file():
                return False
    except (OSError, KeyError, TypeError, ValueError):
        return False
    return True


def read_split(folder: Path, split: str, meta: dict) -> tuple[np.ndarray, np.ndarray]:
    """(memory-mapped token stream, document starts) of a split."""
    n = int(meta["splits"][split]["tokens"])
    dtype = np.dtype(meta["dtype"])
    stream = np.memmap(folder / f"{split}.bin", dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
    return stream, np.load(folder / f"{split}.docs.npy", mmap_mode="r")
