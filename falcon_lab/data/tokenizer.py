"""Tokenizers. Built in: a byte-level tokenizer (256 bytes + BOS/EOS/PAD, vocab padded to 64).

Optional (when the package is installed): GPT-2 BPE through `tiktoken` (name "gpt2"), plus a BOS id.
"""
from __future__ import annotations

from typing import Iterable


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class ByteTokenizer:
    """UTF-8 bytes 0..255, then BOS=256, EOS=257, PAD=258; vocab_size padded to a multiple of 64."""

    name = "byte"

    def __init__(self, pad_to: int = 64):
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.n_tokens = 259
        self.vocab_size = _round_up(self.n_tokens, pad_to)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_array(self, text: str, add_bos: bool = False, add_eos: bool = False):
        import numpy as np

        body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
        pre = [self.bos_id] if add_bos else []
        post = [self.eos_id] if add_eos else []
        return np.concatenate([np.asarray(pre, np.int32), body, np.asarray(post, np.int32)])

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def state(self) -> dict:
        return {"name": self.name}


class TiktokenTokenizer:
    """GPT-2's BPE via tiktoken (if installed); BOS = EOS = <|endoftext|> (ours: one special for both)."""

    name = "gpt2"

    def __init__(self, encoding: str = "gpt2", pad_to: int = 64):
        try:
            import tiktoken
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("data.tokenizer=gpt2 needs `pip install tiktoken`") from e
        self._enc = tiktoken.get_encoding(encoding)
        self.eos_id = self._enc.eot_token
        self.bos_id = self.eos_id
        self.pad_id = self.eos_id
        self.n_tokens = self._enc.n_vocab
        self.vocab_size = _round_up(self.n_tokens, pad_to)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._enc.encode_ordinary(text)
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids if int(i) < self.n_tokens and int(i) != self.eos_id])

    def state(self) -> dict:
        return {"name": self.name}


def build_tokenizer(name: str = "byte"):
    """`data.tokenizer`: "byte" (built in) or "gpt2" (tiktoken)."""
    if name == "byte":
        return ByteTokenizer()
    if name in ("gpt2", "tiktoken"):
        return TiktokenTokenizer()
    raise ValueError(f"data.tokenizer: unknown tokenizer {name!r} (choose 'byte' or 'gpt2')")
