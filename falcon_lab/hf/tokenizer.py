"""The platform's tokenizers as Hugging Face `tokenizers` objects (`tokenizer.json`), for `AutoTokenizer`.

Each export encodes exactly as the platform does, and adds BOS in front (the platform starts every training
document with BOS; `tokenizer.encode(text)` with its default `add_special_tokens=True` gives
`[bos] + platform.encode(text)`, which is also what lm-eval's `hf` model feeds the model):

- "byte" (falcon_lab.data.tokenizer.ByteTokenizer): UTF-8 bytes 0..255 as a byte-level BPE with the 256
  byte symbols as its vocabulary and no merges (ids = byte values), then `<|bos|>`=256, `<|eos|>`=257,
  `<|pad|>`=258. `split_special_tokens=True`: the literal text "<|eos|>" is 7 bytes, as in the platform.
- every tokenizer that is a `tokenizers` JSON in the platform (the learned "bpe", a user's tokenizer.json,
  GPT-2's tokenizer.json; the JSON is stored in the checkpoint): that JSON with a BOS template (any
  post-processor of its own is replaced: the platform encodes without it). Specials stay matched in text,
  as the platform's `tokenizers` encode does.
- tiktoken encodings (a `.tiktoken` file; anything holding a tiktoken `Encoding` as `_enc`): the mergeable
  ranks turned into byte-level BPE merges (each token's merge is the split rank-ordered BPE makes of it),
  tiktoken's split pattern, its special tokens; `split_special_tokens=True` (the platform encodes with
  `encode_ordinary`). Needs tiktoken and the encoding file where the export runs (the folder needs neither).

`export_tokenizer` checks the result against the platform tokenizer on a set of texts (ASCII, accents,
CJK, emoji, whitespace runs, the special tokens' spellings) and refuses to write a tokenizer that differs.
The model's embedding may be larger than the tokenizer (vocabularies are padded to a multiple of 64): those
ids are never produced by the tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path

CHECK_TEXTS = (
    "In the beginning God created the heaven and the earth.",
    "  leading and trailing spaces  \n\nnew lines\ttabs",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber \u00c5ngstr\u00f6m",
    "\u4e2d\u6587\u5b57\u7b26 \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4",
    "emoji \U0001F600\U0001F680 and symbols \u2211\u221e\u2260",
    "x = [1, 2, 3]; print(f'{x!r}')  # code-ish 12345 6.02e23",
    "Question: what is 2+2?\nAnswer: 4",
    "specials spelled out: <|bos|> <|eos|> <|pad|> <|endoftext|>",
    "",
)


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet (GPT-2's): printable bytes map to themselves, the others to 256 + n."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def _platform_name(tok) -> str:
    try:
        return str(tok.state().get("name"))
    except Exception:
        return str(getattr(tok, "name", type(tok).__name__))


def _with_bos(tk, bos: str, bos_id: int):
    from tokenizers import processors

    tk.post_processor = processors.TemplateProcessing(single=f"{bos} $A:0", pair=f"{bos} $A:0 $B:1",
                                                      special_tokens=[(bos, bos_id)])
    return tk


def _add_specials(tk, specials: dict[str, int]) -> None:
    """Add special tokens and check they land on the platform's ids."""
    from tokenizers import AddedToken

    for text, idx in sorted(specials.items(), key=lambda kv: kv[1]):
        if tk.token_to_id(text) is None:
            tk.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        if tk.token_to_id(text) != idx:
            raise ValueError(f"tokenizer export: special token {text!r} got id {tk.token_to_id(text)}, "
                             f"the platform uses {idx}")


def byte_tokenizer(bos_id: int = 256, eos_id: int = 257, pad_id: int = 258):
    """The platform's byte tokenizer as a `tokenizers.Tokenizer` (ids = byte values, then the specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    b2u = bytes_to_unicode()
    tk = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    # GPT-2's split only chunks the text for speed: with no merges every byte is its own token anyway
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    _add_specials(tk, {"<|bos|>": bos_id, "<|eos|>": eos_id, "<|pad|>": pad_id})
    return _with_bos(tk, "<|bos|>", bos_id), {"bos_token": "<|bos|>", "eos_token": "<|eos|>",
                                              "pad_token": "<|pad|>"}, True


def _rank_bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's BPE of `token` using only merges of rank < max_rank (the lowest-ranked pair first)."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best, best_rank = None, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best_rank is None or r < best_rank):
                best, best_rank = i, r
        if best is None:
            break
        parts = parts[:best] + [parts[best] + parts[best + 1]] + parts[best + 2:]
    return parts


def tiktoken_tokenizer(enc, bos_id: int, eos_id: int, pad_id: int):
    """A tiktoken `Encoding` (its mergeable ranks, split pattern and specials) as a `tokenizers.Tokenizer`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks: dict[bytes, int] = dict(enc._mergeable_ranks)
    b2u = bytes_to_unicode()

    def sym(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {sym(b): r for b, r in ranks.items()}
    merges = []
    for b, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(b) < 2:
            continue
        parts = _rank_bpe(ranks, b, r)
        if len(parts) != 2:
            raise ValueError(f"tokenizer export: tiktoken token {b!r} (rank {r}) is not one merge of two "
                             f"lower-ranked tokens ({len(parts)} parts)")
        merges.append((sym(parts[0]), sym(parts[1])))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(enc._pat_str), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    specials = dict(enc._special_tokens)
    _add_specials(tk, specials)
    names = {v: k for k, v in specials.items()}
    for what, idx in (("bos", bos_id), ("eos", eos_id), ("pad", pad_id)):
        if idx not in names:
            raise ValueError(f"tokenizer export: the {what} id {idx} is not a tiktoken special token")
    return _with_bos(tk, names[bos_id], bos_id), {"bos_token": names[bos_id], "eos_token": names[eos_id],
                                                  "pad_token": names[pad_id]}, True


def json_tokenizer(tokenizer_json: str, bos_id: int, eos_id: int, pad_id: int):
    """A platform tokenizer that is a `tokenizers` JSON (the trained BPE): the same JSON plus a BOS template."""
    from tokenizers import Tokenizer

    tk = Tokenizer.from_str(tokenizer_json)
    names = {}
    for what, idx in (("bos", bos_id), ("eos", eos_id), ("pad", pad_id)):
        t = tk.id_to_token(int(idx))
        if t is None:
            raise ValueError(f"tokenizer export: the {what} id {idx} is not in the tokenizer's vocabulary")
        names[f"{what}_token"] = t
    return _with_bos(tk, names["bos_token"], int(bos_id)), names, False


def tokenizers_object(tok):
    """(tokenizers.Tokenizer, special token names, split_special_tokens) for a platform tokenizer."""
    name = _platform_name(tok)
    ids = (int(tok.bos_id), int(tok.eos_id), int(tok.pad_id))
    if name == "byte":
        return byte_tokenizer(*ids)
    if getattr(tok, "_enc", None) is not None:  # tiktoken (GPT-2's BPE, a .tiktoken file)
        return tiktoken_tokenizer(tok._enc, *ids)
    state = {}
    try:
        state = dict(tok.state())
    except Exception:
        pass
    if isinstance(state.get("json"), str):  # the learned BPE, a tokenizer.json, GPT-2's tokenizer.json
        return json_tokenizer(state["json"], *ids)
    inner = getattr(tok, "_tok", None)
    if inner is not None and hasattr(inner, "to_str"):
        return json_tokenizer(inner.to_str(), *ids)
    raise ValueError(f"tokenizer export: no tokenizers-format equivalent for the platform tokenizer {name!r} "
                     f"({type(tok).__name__}); known: byte, a tokenizers JSON (bpe, tokenizer.json, gpt2), tiktoken")


def hf_tokenizer(tok, model_max_length: int | None = None):
    """The platform tokenizer `tok` as a transformers fast tokenizer (AutoTokenizer's class for tokenizer.json)."""
    from transformers import PreTrainedTokenizerFast

    tk, names, split = tokenizers_object(tok)
    kw = dict(names)
    if model_max_length:
        kw["model_max_length"] = int(model_max_length)
    return PreTrainedTokenizerFast(tokenizer_object=tk, split_special_tokens=split,
                                   clean_up_tokenization_spaces=False, **kw)


def check_tokenizer(hf_tok, tok, texts=CHECK_TEXTS) -> None:
    """Raise ValueError unless `hf_tok` encodes every text as [bos] + the platform's ids and decodes them back
    to the platform's text."""
    for text in texts:
        want = [int(tok.bos_id)] + [int(i) for i in tok.encode(text)]
        got = hf_tok.encode(text)
        if got != want:
            raise ValueError(f"tokenizer export: {text!r} encodes to {got[:12]}... with the exported tokenizer, "
                             f"{want[:12]}... with the platform's")
        dec = hf_tok.decode(got, skip_special_tokens=True)
        if dec != tok.decode(want):
            raise ValueError(f"tokenizer export: {text!r} decodes to {dec!r}, the platform gives {tok.decode(want)!r}")


def export_tokenizer(tok, out, model_max_length: int | None = None, texts=CHECK_TEXTS):
    """Write `tokenizer.json` + `tokenizer_config.json` for platform tokenizer `tok` into `out` (checked first,
    on `texts`, against the platform tokenizer). Returns the transformers tokenizer."""
    hf_tok = hf_tokenizer(tok, model_max_length)
    check_tokenizer(hf_tok, tok, texts)
    out = Path(out)
    hf_tok.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # transformers 5 writes its own class name (TokenizersBackend); PreTrainedTokenizerFast names the same
    # tokenizer.json-backed class in transformers 4 and 5 alike
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["falcon_lab_tokenizer"] = _platform_name(tok)  # provenance only; transformers ignores it
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return hf_tok
