"""The embedded real-text corpus: the King James Bible (public domain, Debian `bible-kjv`).

Documents are chapters; the split is a deterministic hash of the chapter id (ours):
crc32("<book> <chapter>") % 100 in {0, 1} -> validation, {2, 3} -> test, else train.
"""
from __future__ import annotations

import gzip
import re
import zlib
from functools import lru_cache
from importlib import resources

_REF = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+)\s+(.*)$")
SPLITS = ("train", "validation", "test")


def split_of(book: str, chapter: int) -> str:
    """The split a chapter belongs to (ours: a hash of its id, stable across machines)."""
    h = zlib.crc32(f"{book} {chapter}".encode()) % 100
    if h < 2:
        return "validation"
    if h < 4:
        return "test"
    return "train"


@lru_cache(maxsize=1)
def _chapters() -> tuple[tuple[str, int, str], ...]:
    raw = resources.files("falcon_lab.data.corpora").joinpath("kjv.txt.gz").read_bytes()
    lines = gzip.decompress(raw).decode("ascii").splitlines()
    out: list[tuple[str, int, list[str]]] = []
    for line in lines:
        m = _REF.match(line)
        if m is None:
            raise ValueError(f"kjv.txt.gz: cannot parse verse line {line[:40]!r}")
        book, chap, text = m.group(1), int(m.group(2)), m.group(4).strip()
        if not out or out[-1][0] != book or out[-1][1] != chap:
            out.append((book, chap, []))
        out[-1][2].append(text)
    return tuple((b, c, "\n".join(vs)) for b, c, vs in out)


def load_kjv(split: str = "train") -> list[dict]:
    """Chapters of the requested split as dicts {"text", "book", "chapter"}."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [
        {"text": t, "book": b, "chapter": c}
        for b, c, t in _chapters()
        if split_of(b, c) == split
    ]


def kjv_sentences(split: str = "validation", min_words: int = 8, max_words: int = 24) -> list[str]:
    """Single verses of a split with a moderate word count (used by the shuffled-sentence check)."""
    out = []
    for doc in load_kjv(split):
        for verse in doc["text"].split("\n"):
            n = len(verse.split())
            if min_words <= n <= max_words:
                out.append(verse)
    return out
