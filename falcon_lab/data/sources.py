"""Where the LM datamodule's texts come from (`data.source`), per split, without downloading anything.

- `kjv`: the embedded King James Bible (corpus.py).
- `text` / `jsonl`: local files (`data.path`: a file, a directory or a glob), read with `datasets`.
- `hf`: Hugging Face datasets, all local:
  - `data.path=<folder written by save_to_disk>` (`datasets.load_from_disk`): a DatasetDict's
    `train` / `validation` splits (`data.train_split`, `data.val_split`), or one Dataset hash-split;
  - `data.path=<parquet | arrow | jsonl/json | txt | csv file, folder or glob>`: one format per path; a
    folder's files are split by their names as `datasets` does (train-*.parquet, validation-*.parquet, ...);
  - `data.hf_name=<org/name>` (`data.hf_config`): resolved from the local caches only (the `datasets`
    cache, then the hub's file cache); when it is not there the error says what to run where there is
    internet. Nothing is fetched at training time.
  The text is the column `data.text_column` (default `text`). Without a validation split, documents are
  hash-split (`data.val_percent`).
- `fineweb`: streamed from the hub (lm.py; not here).

`Corpus(cfg).split(name)` gives the texts of a split; `Corpus(cfg).fingerprint()` says what they were read
from (paths, sizes and modification times of files; datasets' own fingerprints), for the token cache's key.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np

log = logging.getLogger(__name__)
SOURCES = ("kjv", "text", "jsonl", "hf", "fineweb")
BOUNDARIES = ("bos_eos", "eos", "none")
VAL_NAMES = ("validation", "valid", "val", "dev")
SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what datasets' save_to_disk writes
_FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json", ".txt": "text",
            ".csv": "csv"}
_METADATA = ("dataset_infos.json", "dataset_info.json", "state.json", "dataset_dict.json")
_TEXT_EXTS = ("*.txt", "*.jsonl", "*.json", "*.txt.gz", "*.jsonl.gz")


# ----------------------------------------------------------------------------------------- files
def file_format(path: str) -> str | None:
    """The `datasets` builder for a data file, by its extension (.gz looked through), or None."""
    name = path.lower()
    for comp in (".gz", ".bz2", ".xz", ".zst"):
        if name.endswith(comp):
            name = name[: -len(comp)]
    return _FORMATS.get(os.path.splitext(name)[1])


def is_saved_dataset(path: str) -> bool:
    """A folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in SAVED_MARKERS)


def _to_hf_hint(key: str, path: str, why: str) -> ValueError:
    return ValueError(f"{key}: {path!r} {why}; load it with data=hf data.path={path} "
                      f"(data.text_column=<column> if its text is not in `text`)")


def _glob_or_file(path: str) -> list[str]:
    p = os.path.expanduser(str(path))
    if any(ch in p for ch in "*?["):
        return sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
    return [p] if os.path.isfile(p) else []


def resolve_files(path: str, key: str = "data.path") -> list[str]:
    """Text/jsonl files at a file, directory or glob. A dataset folder (save_to_disk) or parquet/arrow
    files are refused with a pointer to data=hf (read as text they gave 0 tokens or a decode error)."""
    p = os.path.expanduser(str(path))
    if is_saved_dataset(p):
        raise _to_hf_hint(key, path, "is a Hugging Face dataset saved with save_to_disk, not text files")
    if os.path.isdir(p):
        files = sorted(f for ext in _TEXT_EXTS for f in glob.glob(os.path.join(p, "**", ext), recursive=True))
        if any(os.path.basename(f) in SAVED_MARKERS + ("dataset_info.json",) for f in files):
            raise _to_hf_hint(key, path, "holds a Hugging Face dataset saved with save_to_disk")
        if not files and any(file_format(f) in ("parquet", "arrow")
                             for f in glob.glob(os.path.join(p, "**", "*"), recursive=True)):
            raise _to_hf_hint(key, path, "holds parquet/arrow files, not text")
    else:
        files = _glob_or_file(p)
    binary = [f for f in files if file_format(f) in ("parquet", "arrow")]
    if binary:
        raise _to_hf_hint(key, path, f"holds parquet/arrow files ({os.path.basename(binary[0])}), not text")
    if not files:
        raise FileNotFoundError(f"{key}: no data files found at {path!r}")
    return files


def _data_files(path: str, key: str) -> tuple[str, list[str]]:
    """(format, files) of a file, glob or folder of data files of one format (for data=hf)."""
    p = os.path.expanduser(str(path))
    if os.path.isdir(p):  # hidden folders (.cache of `hf download --local-dir`) and metadata files skipped
        files = sorted(f for f in glob.glob(os.path.join(p, "**", "*"), recursive=True)
                       if os.path.isfile(f) and file_format(f) and os.path.basename(f) not in _METADATA)
    else:
        files = _glob_or_file(p)
    if not files:
        raise FileNotFoundError(f"{key}: no data files (parquet, arrow, jsonl, json, txt, csv) at {path!r}")
    fmts = sorted({file_format(f) for f in files} - {None})
    if not fmts:
        raise ValueError(f"{key}: {path!r}: unknown file type {os.path.basename(files[0])!r} (parquet, arrow, "
                         f"jsonl, json, txt or csv)")
    if len(fmts) > 1:
        raise ValueError(f"{key}: {path!r} mixes file types {fmts}; point it at one type (a glob like "
                         f"'{p.rstrip('/')}/*.parquet')")
    return fmts[0], files


def _stat_fingerprint(paths: list[str]) -> list:
    out = []
    for f in sorted(paths):
        st = os.stat(f)
        out.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    return out


def _all_files(path: str) -> list[str]:
    p = os.path.expanduser(str(path))
    if os.path.isdir(p):
        return [f for f in glob.glob(os.path.join(p, "**", "*"), recursive=True) if os.path.isfile(f)]
    return _glob_or_file(p)


# ----------------------------------------------------------------------------------------- offline
@contextlib.contextmanager
def offline():
    """`datasets` and `huggingface_hub` in offline mode for the duration (no request leaves the machine)."""
    import datasets.config as dconf
    from huggingface_hub import constants

    flags = [(m, k) for m, k in ((dconf, "HF_HUB_OFFLINE"), (dconf, "HF_DATASETS_OFFLINE"),
                                 (constants, "HF_HUB_OFFLINE")) if hasattr(m, k)]
    saved = [getattr(m, k) for m, k in flags]
    for m, k in flags:
        setattr(m, k, True)
    try:
        yield
    finally:
        for (m, k), v in zip(flags, saved):
            setattr(m, k, v)


def _hub_cache_paths(name: str) -> tuple[Path, Path]:
    import datasets.config as dconf
    from datasets.naming import camelcase_to_snakecase
    from huggingface_hub import constants

    parts = name.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    return (Path(os.path.expanduser(str(dconf.HF_DATASETS_CACHE))) / "___".join(parts),
            Path(os.path.expanduser(str(constants.HF_HUB_CACHE))) / f"datasets--{name.replace('/', '--')}")


def _not_cached(name: str, config, detail: str = "") -> FileNotFoundError:
    ds_cache, hub_cache = _hub_cache_paths(name)
    which = f"{name!r} (data.hf_config={config})" if config else repr(name)
    args = f"'{name}', {config!r}" if config else f"'{name}'"
    return FileNotFoundError(
        f"data.hf_name: {which} is not in the local Hugging Face caches ({ds_cache.parent}, {hub_cache.parent}), "
        f"and nothing is downloaded at training time. Where there is internet, run `hf download --repo-type "
        f"dataset {name}` (then copy {hub_cache} here), or in Python "
        f"datasets.load_dataset({args}).save_to_disk(DIR) and train with data=hf data.path=DIR."
        + (f" (last error: {detail})" if detail else ""))


def check_hub_cached(name: str, config=None) -> None:
    """Cheap start-up check that a hub dataset has something in a local cache (FileNotFoundError if not)."""
    ds_cache, hub_cache = _hub_cache_paths(name)
    if not (ds_cache.is_dir() or (hub_cache / "snapshots").is_dir()):
        raise _not_cached(name, config)


def _open_hub(name: str, config) -> dict:
    import datasets

    check_hub_cached(name, config)
    detail = ""
    with offline():
        try:
            return dict(datasets.load_dataset(name, config))
        except Exception as e:  # not in datasets' own cache: try the hub's file cache next
            detail = f"{type(e).__name__}: {str(e)[:200]}"
    try:
        from huggingface_hub import snapshot_download

        snap = snapshot_download(name, repo_type="dataset", local_files_only=True)
    except Exception:
        raise _not_cached(name, config, detail) from None
    with offline():
        try:
            return dict(datasets.load_dataset(snap, config))
        except Exception as e:
            raise _not_cached(name, config, f"{type(e).__name__}: {str(e)[:200]}") from None


def _open_path(path: str, key: str, sample_by: str) -> dict:
    """Splits (name -> datasets.Dataset) of a saved dataset folder, or of data files."""
    import datasets

    p = os.path.expanduser(str(path))
    if is_saved_dataset(p):
        obj = datasets.load_from_disk(p)
        return dict(obj) if isinstance(obj, datasets.DatasetDict) else {"train": obj}
    fmt, files = _data_files(path, key)
    kw = {"sample_by": sample_by} if fmt == "text" else {}
    by_split = split_by_name(files, p) if os.path.isdir(p) else {"train": files}
    with offline():
        return dict(datasets.load_dataset(fmt, data_files=by_split, **kw))


_SPLIT_WORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "val", "dev"),
                "test": ("test", "testing", "eval", "evaluation")}


def split_by_name(files: list[str], root: str) -> dict[str, list[str]]:
    """Files of a folder grouped by the split word in their path, as the hub lays datasets out
    (train-00000-of-00002.parquet, data/validation-*.parquet, test/...); all train if none has one."""
    out: dict[str, list[str]] = {}
    unnamed = []
    for f in files:
        words = set(re.split(r"[/\\._-]+", os.path.relpath(f, root).lower()))
        split = next((s for s, names in _SPLIT_WORDS.items() if words & set(names)), None)
        (out.setdefault(split, []) if split else unnamed).append(f)
    if not out:
        return {"train": unnamed}
    if unnamed:
        log.warning("data.path: %d file(s) under %s name no split (train/validation/test) and are not read, "
                    "e.g. %s", len(unnamed), root, unnamed[0])
    return out


# ----------------------------------------------------------------------------------------- splits
def hash_split(n: int, val_percent: float) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, validation) of n documents: document i is held out when crc32(str(i)) % 10000 <
    val_percent * 100 (ours; the same rule as the text/jsonl split)."""
    is_val = np.fromiter((zlib.crc32(str(i).encode()) % 10000 < val_percent * 100 for i in range(n)),
                         dtype=bool, count=n)
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)


def _hash_split_list(docs: list[str], val_percent: float) -> dict[str, list[str]]:
    tr, va = hash_split(len(docs), val_percent)
    return {"train": [docs[i] for i in tr], "validation": [docs[i] for i in va]}


class TextSplit:
    """The texts of one split: a column of a `datasets.Dataset` (memory-mapped), optionally a subset of rows.
    Iterating yields the non-empty texts; `batches(n)` yields them in lists of up to n."""

    def __init__(self, ds, column: str, indices=None, where: str = ""):
        if column not in ds.column_names:
            raise ValueError(f"data.text_column: column {column!r} is not in {ds.column_names} of {where}; "
                             f"pick one with data.text_column=<column>")
        dtype = getattr(ds.features[column], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise ValueError(f"data.text_column: column {column!r} of {where} holds {ds.features[column]}, "
                             f"not text; pick a string column with data.text_column=<column>")
        ds = ds.select_columns([column])
        self.ds = ds if indices is None else ds.select(indices)
        self.column = column
        self.fingerprint = f"{ds._fingerprint}:{'all' if indices is None else _array_hash(indices)}"

    def __len__(self) -> int:
        return len(self.ds)

    def batches(self, size: int = 1024) -> Iterator[list[str]]:
        for i in range(0, len(self.ds), size):
            texts = self.ds[i: i + size][self.column]
            yield [t for t in texts if t and t.strip()]

    def __iter__(self):
        for b in self.batches():
            yield from b


def _array_hash(a) -> str:
    return hashlib.sha1(np.ascontiguousarray(np.asarray(a, dtype=np.int64)).tobytes()).hexdigest()[:16]


def text_column(cfg) -> str:
    return str(cfg.get("text_column") or cfg.get("text_field") or "text")


def _local_documents(files: list[str], source: str, field: str, sample_by: str) -> list[str]:
    import datasets

    with offline():
        if source == "jsonl":
            ds = datasets.load_dataset("json", data_files=files, split="train")
            if field not in ds.column_names:
                raise KeyError(f"data.text_field: field {field!r} not in {ds.column_names} of {files[0]}")
            return [t for t in ds[field] if t]
        ds = datasets.load_dataset("text", data_files=files, split="train", sample_by=sample_by)
    return [t for t in ds["text"] if t and t.strip()]


class Corpus:
    """The texts of an LM `data` config, per split (see the module docstring)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.source = str(cfg.get("source", "kjv"))
        self._hf: dict | None = None
        self._local: dict | None = None

    # -- hf
    def _hf_splits(self) -> dict:
        if self._hf is not None:
            return self._hf
        cfg, col = self.cfg, text_column(self.cfg)
        sample_by = cfg.get("sample_by", "document")
        if cfg.get("path"):
            where = f"data.path={cfg.path}"
            d = _open_path(cfg.path, "data.path", sample_by)
        elif cfg.get("hf_name"):
            where = f"data.hf_name={cfg.hf_name}"
            d = _open_hub(str(cfg.hf_name), cfg.get("hf_config"))
        else:
            raise ValueError("data=hf: set data.path (a save_to_disk folder or data files) or data.hf_name")
        train_name = str(cfg.get("train_split") or "train")
        if train_name not in d:
            raise ValueError(f"data.train_split: {where} has no split {train_name!r} (splits: {sorted(d)})")
        val_name = cfg.get("val_split")
        val_ds = None
        if cfg.get("val_path"):
            v = _open_path(cfg.val_path, "data.val_path", sample_by)
            name = val_name if val_name in v else next((n for n in (*VAL_NAMES, "train") if n in v), None)
            if name is None:
                raise ValueError(f"data.val_path: {cfg.val_path!r} has no split to validate on (splits: {sorted(v)})")
            val_ds = (v[name], f"data.val_path={cfg.val_path} [{name}]")
        elif val_name:
            if val_name not in d:
                raise ValueError(f"data.val_split: {where} has no split {val_name!r} (splits: {sorted(d)})")
            val_ds = (d[val_name], f"{where} [{val_name}]")
        else:
            name = next((n for n in VAL_NAMES if n in d), None)
            if name is not None:
                val_ds = (d[name], f"{where} [{name}]")
        train = d[train_name]
        if val_ds is not None:
            self._hf = {"train": TextSplit(train, col, where=f"{where} [{train_name}]"),
                        "validation": TextSplit(val_ds[0], col, where=val_ds[1])}
        else:
            tr, va = hash_split(len(train), float(cfg.get("val_percent", 2.0)))
            self._hf = {"train": TextSplit(train, col, tr, where=f"{where} [{train_name}]"),
                        "validation": TextSplit(train, col, va, where=f"{where} [{train_name}, held out]")}
        return self._hf

    # -- text / jsonl
    def _local_splits(self) -> dict:
        if self._local is not None:
            return self._local
        cfg, src = self.cfg, self.source
        if not cfg.get("path"):
            raise ValueError(f"data.path is required for data.source={src}")
        files = resolve_files(cfg.path)
        sample_by = cfg.get("sample_by", "document")
        field = str(cfg.get("text_field") or cfg.get("text_column") or "text")
        if cfg.get("val_path"):
            self._local = {"train": _local_documents(files, src, field, sample_by),
                           "validation": _local_documents(resolve_files(cfg.val_path, "data.val_path"), src,
                                                          field, sample_by)}
        else:
            self._local = _hash_split_list(_local_documents(files, src, field, sample_by),
                                           float(cfg.get("val_percent", 2.0)))
        return self._local

    def split(self, name: str):
        """The texts of split `name` (train | validation | test): a list, or a TextSplit for data=hf;
        None for the streamed fineweb."""
        if self.source == "kjv":
            from falcon_lab.data.corpus import load_kjv

            return [d["text"] for d in load_kjv(name)]
        if self.source == "fineweb":
            return None
        name = "validation" if name == "test" else name
        if self.source in ("text", "jsonl"):
            return self._local_splits()[name]
        if self.source == "hf":
            return self._hf_splits()[name]
        raise ValueError(f"data.source: unknown source {self.source!r} ({' | '.join(SOURCES)})")

    def split_names(self) -> tuple[str, ...]:
        return ("train", "validation", "test") if self.source == "kjv" else ("train", "validation")

    def fingerprint(self) -> str:
        """What the texts were read from (changes when a file or a saved dataset changes)."""
        cfg, src = self.cfg, self.source
        if src == "kjv":
            from importlib import resources

            raw = resources.files("falcon_lab.data.corpora").joinpath("kjv.txt.gz").read_bytes()
            parts: list = ["kjv", zlib.crc32(raw)]
        elif src == "fineweb":
            parts = ["fineweb", cfg.get("hf_name"), cfg.get("hf_config")]
        elif src in ("text", "jsonl"):
            parts = [src, _stat_fingerprint(resolve_files(cfg.path))]
            if cfg.get("val_path"):
                parts.append(_stat_fingerprint(resolve_files(cfg.val_path, "data.val_path")))
        else:
            s = self._hf_splits()
            parts = ["hf", cfg.get("path") and os.path.abspath(os.path.expanduser(str(cfg.path))),
                     cfg.get("hf_name"), cfg.get("hf_config"), s["train"].fingerprint, s["validation"].fingerprint]
            for key in ("path", "val_path"):
                if cfg.get(key):
                    parts.append(_stat_fingerprint(_all_files(cfg[key])))
        return hashlib.sha1(json.dumps(parts, default=str).encode()).hexdigest()


# ----------------------------------------------------------------------------------------- start-up check
def check_lm_config(data) -> None:
    """Checks of a `data.name: lm` node that need no data loaded (ValueError / FileNotFoundError naming the
    key); training/validate.py turns them into ConfigError at start-up."""
    from falcon_lab.data.tokenizer import check_tokenizer_name

    src = data.get("source", "kjv")
    if src not in SOURCES:
        raise ValueError(f"data.source: {src!r} is not one of {', '.join(SOURCES)}")
    if src in ("text", "jsonl"):
        if not data.get("path"):
            raise ValueError(f"data.path: required for data.source={src}")
        resolve_files(data.path)
        if data.get("val_path"):
            resolve_files(data.val_path, "data.val_path")
    if src == "hf":
        if data.get("path"):
            for key in ("path", "val_path"):
                if data.get(key) and not is_saved_dataset(os.path.expanduser(str(data[key]))):
                    _data_files(data[key], f"data.{key}")
        elif data.get("hf_name"):
            check_hub_cached(str(data.hf_name), data.get("hf_config"))
        else:
            raise ValueError("data.path: data=hf needs data.path (a folder written by save_to_disk, or parquet/"
                             "arrow/jsonl/txt files) or data.hf_name (a hub dataset already in the local cache)")
    boundary = data.get("doc_boundary") or "bos_eos"
    if boundary not in BOUNDARIES:
        raise ValueError(f"data.doc_boundary: {boundary!r} is not one of {', '.join(BOUNDARIES)}")
    if boundary == "none" and data.get("cu_seqlens"):
        raise ValueError("data.cu_seqlens=true needs document boundaries: data.doc_boundary=bos_eos or eos")
    tok = data.get("tokenizer", "byte")
    if tok == "bpe" and src == "fineweb":
        raise ValueError("data.tokenizer=bpe is not supported with data.source=fineweb (use gpt2)")
    check_tokenizer_name(tok)
