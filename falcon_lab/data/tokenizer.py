"""Tokenizers. Built in: a byte-level tokenizer (256 bytes + BOS/EOS/PAD, vocab padded to 64).

Also: "bpe", a byte-level BPE trained with Hugging Face `tokenizers` on the training split (stored
inside checkpoints, so a checkpoint always decodes with its own merges), and "gpt2" (GPT-2's BPE via
`tiktoken`, which fetches its merge table once: it needs the internet or tiktoken's cache).
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


class BPETokenizer:
    """Byte-level BPE (Hugging Face `tokenizers`): specials <|bos|>=0, <|eos|>=1, <|pad|>=2 (ours)."""

    name = "bpe"
    SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")

    def __init__(self, tokenizer_json: str, pad_to: int = 64):
        from tokenizers import Tokenizer

        self._json = tokenizer_json
        self._tok = Tokenizer.from_str(tokenizer_json)
        self.bos_id, self.eos_id, self.pad_id = (self._tok.token_to_id(t) for t in self.SPECIALS)
        self.n_tokens = self._tok.get_vocab_size()
        self.vocab_size = _round_up(self.n_tokens, pad_to)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 4096) -> "BPETokenizer":
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("data.tokenizer=bpe needs `pip install tokenizers`") from e
        if vocab_size < 300:
            raise ValueError(f"data.bpe_vocab_size: must be >= 300 (256 bytes + specials), got {vocab_size}")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(cls.SPECIALS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok.to_str())

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        special = {self.bos_id, self.eos_id, self.pad_id}
        return self._tok.decode([int(i) for i in ids if int(i) < self.n_tokens and int(i) not in special])

    def state(self) -> dict:
        return {"name": self.name, "json": self._json}


def build_tokenizer(name: str = "byte", train_texts=None, bpe_vocab_size: int = 4096):
    """`data.tokenizer`: "byte" (built in), "bpe" (trained on `train_texts`), "gpt2" (tiktoken)."""
    if name == "byte":
        return ByteTokenizer()
    if name == "bpe":
        if train_texts is None:
            raise ValueError("data.tokenizer=bpe: needs the training texts to learn its merges")
        return BPETokenizer.train(train_texts, int(bpe_vocab_size))
    if name in ("gpt2", "tiktoken"):
        return TiktokenTokenizer()
    raise ValueError(f"data.tokenizer: unknown tokenizer {name!r} (choose 'byte', 'bpe' or 'gpt2')")


def tokenizer_from_state(state) -> object:
    """Rebuild a tokenizer from `tokenizer.state()` (or a bare name, for older checkpoints)."""
    if isinstance(state, str):
        state = {"name": state}
    if state.get("name") == "bpe":
        return BPETokenizer(state["json"])
    return build_tokenizer(state.get("name", "byte"))
