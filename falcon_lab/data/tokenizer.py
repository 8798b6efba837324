"""Tokenizers (`data.tokenizer`). Nothing here downloads: every file is local.

- `byte` (built in): 256 bytes + BOS/EOS/PAD, vocab padded to 64.
- `bpe`: a byte-level BPE learned with Hugging Face `tokenizers` on the training split (ours). The LM
  datamodule saves it as `tokenizer.json` beside its token shards and reuses it (data.cache_dir).
- a path: any Hugging Face `tokenizer.json`, or a folder holding one (its `tokenizer_config.json`, if
  there, names the BOS/EOS/PAD tokens; otherwise the usual names are looked up).
- `gpt2`: GPT-2's BPE through `tokenizers`, from local files (`gpt2_files()` says where it looks, and its
  error says which file to put where).
- a `.tiktoken` file (`cl100k_base.tiktoken`, ...): that tiktoken encoding, if `tiktoken` is installed.

Every tokenizer has `encode(text, add_bos, add_eos)`, `encode_batch(texts)` (no specials), `decode`,
`bos_id`/`eos_id`/`pad_id`, `n_tokens`, `vocab_size` (padded to 64) and `state()`, which the
checkpoint stores; `tokenizer_from_state` rebuilds the same tokenizer from it (the merges travel with
the checkpoint, except for a tiktoken file, which is named by its path).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable

KNOWN = ("byte", "bpe", "gpt2", "tiktoken")


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

    def encode_batch(self, texts: list[str]) -> list:
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def identity(self) -> str:
        return "byte"

    def state(self) -> dict:
        return {"name": self.name}


# ----------------------------------------------------------------------------- Hugging Face tokenizers
_BOS_NAMES = ("<|bos|>", "<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")
_EOS_NAMES = ("<|eos|>", "<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]")


def _special_name(v):
    return v.get("content") if isinstance(v, dict) else v


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (a tokenizer.json). Specials: the given names, else the usual
    ones found in its vocabulary; BOS and PAD fall back to EOS (ours: one token may play all three)."""

    name = "hf"

    def __init__(self, tokenizer_json: str, bos: str | None = None, eos: str | None = None,
                 pad: str | None = None, source: str | None = None, pad_to: int = 64):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise ImportError("data.tokenizer: a tokenizer.json needs `pip install tokenizers`") from e

        self._json = tokenizer_json
        self._tok = Tokenizer.from_str(tokenizer_json)
        self.source = source
        vocab = self._tok.get_vocab(with_added_tokens=True)

        def find(given, names, what):
            if given is not None:
                if given not in vocab:
                    raise ValueError(f"data.tokenizer: {what} token {given!r} is not in the vocabulary of "
                                     f"{source or 'the tokenizer'}")
                return given
            return next((n for n in names if n in vocab), None)

        eos = find(eos, _EOS_NAMES, "EOS")
        if eos is None:
            raise ValueError(f"data.tokenizer: {source or 'the tokenizer'} has no end-of-text token (looked for "
                             f"{', '.join(_EOS_NAMES)}); name it as \"eos_token\" in a tokenizer_config.json "
                             f"beside its tokenizer.json")
        bos = find(bos, _BOS_NAMES, "BOS") or eos
        pad = find(pad, _PAD_NAMES, "PAD") or eos
        self.bos_token, self.eos_token, self.pad_token = bos, eos, pad
        self.bos_id, self.eos_id, self.pad_id = vocab[bos], vocab[eos], vocab[pad]
        self.n_tokens = max(vocab.values()) + 1
        self.vocab_size = _round_up(self.n_tokens, pad_to)

    @classmethod
    def from_path(cls, path: str, key: str = "data.tokenizer") -> "HFTokenizer":
        """A tokenizer.json file, or a folder holding tokenizer.json (and maybe tokenizer_config.json)."""
        p = Path(os.path.expanduser(str(path)))
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"{key}: no tokenizer.json at {str(path)!r}")
        names: dict = {}
        conf = file.parent / "tokenizer_config.json"
        if conf.is_file():
            c = json.loads(conf.read_text())
            names = {k: _special_name(c.get(f"{k}_token")) for k in ("bos", "eos", "pad")}
        return cls(file.read_text(), source=str(file.resolve()), **names)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        special = {self.bos_id, self.eos_id, self.pad_id}
        return self._tok.decode([int(i) for i in ids if int(i) < self.n_tokens and int(i) not in special])

    def to_json(self) -> str:
        return self._json

    def identity(self) -> str:
        blob = json.dumps([self._json, self.bos_token, self.eos_token, self.pad_token])
        return f"{self.name}:{hashlib.sha1(blob.encode()).hexdigest()}"

    def state(self) -> dict:
        return {"name": "hf", "json": self._json, "bos": self.bos_token, "eos": self.eos_token,
                "pad": self.pad_token, "source": self.source, "kind": self.name}


class BPETokenizer(HFTokenizer):
    """Byte-level BPE (Hugging Face `tokenizers`): specials <|bos|>=0, <|eos|>=1, <|pad|>=2 (ours)."""

    name = "bpe"
    SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")

    def __init__(self, tokenizer_json: str, pad_to: int = 64, source: str | None = None):
        super().__init__(tokenizer_json, *self.SPECIALS, source=source, pad_to=pad_to)

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

    def state(self) -> dict:
        return {"name": self.name, "json": self._json}


# ----------------------------------------------------------------------------- GPT-2, offline
GPT2_URLS = {
    "tokenizer.json": "https://huggingface.co/openai-community/gpt2/resolve/main/tokenizer.json",
    "vocab.json": "https://huggingface.co/openai-community/gpt2/resolve/main/vocab.json",
    "merges.txt": "https://huggingface.co/openai-community/gpt2/resolve/main/merges.txt",
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
}
# the names tiktoken has used for the same two files (its cache stores them under sha1(url))
_TIKTOKEN_GPT2 = [("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
                   "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"),
                  ("az://openaipublic/gpt-2/encodings/main/encoder.json",
                   "az://openaipublic/gpt-2/encodings/main/vocab.bpe")]
GPT2_EOT = "<|endoftext|>"


def tokenizer_home() -> Path:
    """Where named tokenizers' files are looked for: $FALCON_LAB_TOKENIZERS, else ~/.cache/falcon_lab/tokenizers."""
    return Path(os.path.expanduser(os.environ.get("FALCON_LAB_TOKENIZERS")
                                   or "~/.cache/falcon_lab/tokenizers"))


def _tiktoken_cache_dirs() -> list[Path]:
    dirs = [os.environ.get("TIKTOKEN_CACHE_DIR"), os.environ.get("DATA_GYM_CACHE_DIR"),
            os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tiktoken"),
            os.path.join(tempfile.gettempdir(), "data-gym-cache")]
    return [Path(d) for d in dirs if d]


def _hub_cache_file(repo: str, filename: str) -> str | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - comes with datasets
        return None
    p = try_to_load_from_cache(repo, filename)
    return p if isinstance(p, str) and os.path.isfile(p) else None


def gpt2_files() -> dict:
    """Local GPT-2 BPE files, first found of: tokenizer_home()/gpt2/{tokenizer.json | vocab.json+merges.txt |
    encoder.json+vocab.bpe}, the Hugging Face hub cache (openai-community/gpt2), tiktoken's cache.
    Returns {"tokenizer.json": path} or {"vocab": path, "merges": path}; raises FileNotFoundError saying
    which file to put where."""
    home = tokenizer_home() / "gpt2"
    if (home / "tokenizer.json").is_file():
        return {"tokenizer.json": str(home / "tokenizer.json")}
    for v, m in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (home / v).is_file() and (home / m).is_file():
            return {"vocab": str(home / v), "merges": str(home / m)}
    for repo in ("openai-community/gpt2", "gpt2"):
        tj = _hub_cache_file(repo, "tokenizer.json")
        if tj:
            return {"tokenizer.json": tj}
        v, m = _hub_cache_file(repo, "vocab.json"), _hub_cache_file(repo, "merges.txt")
        if v and m:
            return {"vocab": v, "merges": m}
    for d in _tiktoken_cache_dirs():
        for enc_url, bpe_url in _TIKTOKEN_GPT2:
            v, m = (d / hashlib.sha1(u.encode()).hexdigest() for u in (enc_url, bpe_url))
            if v.is_file() and m.is_file():
                return {"vocab": str(v), "merges": str(m)}
    try:
        from huggingface_hub import constants
        hub = constants.HF_HUB_CACHE
    except ImportError:  # pragma: no cover
        hub = "~/.cache/huggingface/hub"
    raise FileNotFoundError(
        f"data.tokenizer=gpt2: GPT-2's BPE files are not on this machine, and nothing is downloaded at run "
        f"time. Put tokenizer.json ({GPT2_URLS['tokenizer.json']}) into {home}/ (or vocab.json + merges.txt "
        f"from the same place, or encoder.json + vocab.bpe from "
        f"https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/); set $FALCON_LAB_TOKENIZERS to "
        f"use another folder than {home.parent}. Or pass data.tokenizer=<path to a tokenizer.json>. Also "
        f"looked in the Hugging Face hub cache ({hub}, openai-community/gpt2) and tiktoken's cache "
        f"({', '.join(str(d) for d in _tiktoken_cache_dirs())}).")


def gpt2_tokenizer() -> HFTokenizer:
    """GPT-2's BPE (through `tokenizers`, no tiktoken needed), <|endoftext|> as BOS, EOS and PAD (ours)."""
    files = gpt2_files()
    if "tokenizer.json" in files:
        tok = HFTokenizer(Path(files["tokenizer.json"]).read_text(), GPT2_EOT, GPT2_EOT, GPT2_EOT,
                          source=files["tokenizer.json"])
    else:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        t = Tokenizer(models.BPE.from_file(files["vocab"], files["merges"]))
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        t.add_special_tokens([AddedToken(GPT2_EOT, special=True)])  # as in the hub's tokenizer.json
        tok = HFTokenizer(t.to_str(), GPT2_EOT, GPT2_EOT, GPT2_EOT, source=files["vocab"])
    tok.name = "gpt2"  # its state() says "hf": a tokenizers JSON like any other (no tiktoken object inside)
    return tok


# ----------------------------------------------------------------------------- tiktoken, from a local file
class TiktokenTokenizer:
    """A tiktoken encoding read from a local `<encoding>.tiktoken` file (e.g. cl100k_base.tiktoken); its
    split pattern and special tokens come from the installed tiktoken. BOS = EOS = PAD = <|endoftext|>."""

    name = "tiktoken"

    def __init__(self, path: str, encoding: str | None = None, pad_to: int = 64):
        try:
            import tiktoken
            import tiktoken.load
            from tiktoken_ext import openai_public
        except ImportError as e:
            raise ImportError(f"data.tokenizer={path}: a .tiktoken file needs the `tiktoken` package "
                              f"(pip install tiktoken), which is not installed") from e
        self.path = str(Path(os.path.expanduser(str(path))).resolve())
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"data.tokenizer: no tiktoken file at {str(path)!r}")
        self.encoding = encoding or Path(self.path).name.split(".")[0]
        ctors = {k: v for k, v in openai_public.ENCODING_CONSTRUCTORS.items() if k != "gpt2"}
        if self.encoding not in ctors:
            raise ValueError(f"data.tokenizer: {self.path}: name the file after its encoding, one of "
                             f"{sorted(ctors)} (e.g. cl100k_base.tiktoken); for GPT-2 use data.tokenizer=gpt2")
        local = tiktoken.load.load_tiktoken_bpe(self.path)
        saved = openai_public.load_tiktoken_bpe
        openai_public.load_tiktoken_bpe = lambda *a, **k: local  # the constructor's URL is never read
        try:
            spec = ctors[self.encoding]()
        finally:
            openai_public.load_tiktoken_bpe = saved
        spec.pop("explicit_n_vocab", None)
        self._enc = tiktoken.Encoding(**spec)
        self.eos_id = self._enc.eot_token
        self.bos_id = self.pad_id = self.eos_id
        self.n_tokens = self._enc.n_vocab
        self.vocab_size = _round_up(self.n_tokens, pad_to)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._enc.encode_ordinary(text)
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids if int(i) < self.n_tokens and int(i) != self.eos_id])

    def identity(self) -> str:
        h = hashlib.sha1(Path(self.path).read_bytes()).hexdigest()
        return f"tiktoken:{self.encoding}:{h}"

    def state(self) -> dict:
        return {"name": self.name, "path": self.path, "encoding": self.encoding}


# ----------------------------------------------------------------------------- building
def is_tokenizer_path(name: str) -> bool:
    return str(name) not in KNOWN


def check_tokenizer_name(name) -> None:
    """Start-up check of `data.tokenizer` (ValueError/FileNotFoundError naming the key): a known name or an
    existing file/folder. (gpt2's files are looked for when it is built: a config must validate on a
    machine without them, e.g. in CI.)"""
    name = str(name)
    if name in KNOWN:
        return
    p = Path(os.path.expanduser(name))
    if p.suffix == ".tiktoken":
        if not p.is_file():
            raise FileNotFoundError(f"data.tokenizer: no tiktoken file at {name!r}")
        return
    if not (p.is_file() or (p / "tokenizer.json").is_file()):
        raise FileNotFoundError(f"data.tokenizer: {name!r} is not one of {', '.join(KNOWN)}, nor a tokenizer.json, "
                                f"a folder holding one, or a .tiktoken file")


def build_tokenizer(name: str = "byte", train_texts=None, bpe_vocab_size: int = 4096):
    """`data.tokenizer`: "byte", "bpe" (learned on `train_texts`), "gpt2" (local files), a path to a
    tokenizer.json or a folder holding one, or a path to a `.tiktoken` file."""
    name = str(name)
    if name == "byte":
        return ByteTokenizer()
    if name == "bpe":
        if train_texts is None:
            raise ValueError("data.tokenizer=bpe: needs the training texts to learn its merges")
        return BPETokenizer.train(train_texts, int(bpe_vocab_size))
    if name in ("gpt2", "tiktoken"):
        return gpt2_tokenizer()
    if name.endswith(".tiktoken"):
        return TiktokenTokenizer(name)
    check_tokenizer_name(name)
    return HFTokenizer.from_path(name)


def tokenizer_from_state(state) -> object:
    """Rebuild a tokenizer from `tokenizer.state()` (or a bare name, for older checkpoints)."""
    if isinstance(state, str):
        state = {"name": state}
    name = state.get("name", "byte")
    if name == "bpe":
        return BPETokenizer(state["json"])
    if name == "hf" and state.get("json"):
        tok = HFTokenizer(state["json"], state.get("bos"), state.get("eos"), state.get("pad"),
                          source=state.get("source"))
        tok.name = state.get("kind") or "hf"
        return tok
    if name == "tiktoken" and state.get("path"):
        return TiktokenTokenizer(state["path"], state.get("encoding"))
    return build_tokenizer(name)
