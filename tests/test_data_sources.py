"""Data sources (Hugging Face datasets on disk, parquet/arrow/jsonl/txt, the hub cache), token shards,
document boundaries and tokenizers (tokenizer.json, learned BPE reuse, GPT-2 offline, tiktoken files).
Every dataset and tokenizer is made inside the test; nothing is downloaded."""
import ast
import hashlib
import json
import os
import socket
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from falcon_lab.data import available_datamodules, build_datamodule, get_datamodule_cls
from falcon_lab.data import shards, tokenizer as tokmod
from falcon_lab.data.lm import IGNORE, make_collate
from falcon_lab.data.sources import check_lm_config
from falcon_lab.data.tokenizer import BPETokenizer, build_tokenizer, tokenizer_from_state
from falcon_lab.training.config import compose
from falcon_lab.training.validate import ConfigError, validate_config

DOCS = [f"Document {i}: " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(5 + i % 9)) for i in range(120)]


def _dm(tmp_path=None, **kw):
    base = dict(name="lm", source="hf", seq_len=16, batch_size=4, tokenizer="byte")
    if tmp_path is not None:
        base["cache_dir"] = str(tmp_path / "cache")
    base.update(kw)
    return build_datamodule(OmegaConf.create(base))


def _texts(dm, split):
    """The documents of a split as decoded back from its token stream (byte tokenizer, bos_eos)."""
    s, tok = np.asarray(dm.token_stream(split)), dm.tokenizer
    starts = list(dm.doc_starts(split)) + [len(s)]
    return [tok.decode(s[a:b]) for a, b in zip(starts[:-1], starts[1:])]


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to resolve a host name or open a connection is recorded and refused. The hubs' offline
    flags (set for the whole suite by conftest) are turned off: the code must not depend on them."""
    import datasets.config as dconf
    from huggingface_hub import constants

    for mod, key in ((dconf, "HF_HUB_OFFLINE"), (dconf, "HF_DATASETS_OFFLINE"), (constants, "HF_HUB_OFFLINE")):
        if hasattr(mod, key):
            monkeypatch.setattr(mod, key, False)
    tries = []

    def refuse(*a, **k):
        tries.append(a)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return tries


@pytest.fixture
def isolated_caches(tmp_path, monkeypatch):
    """HF / tiktoken / falcon_lab tokenizer caches pointed into tmp_path (nothing of this machine's caches)."""
    import datasets.config as dconf
    import tempfile
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(dconf, "HF_DATASETS_CACHE", tmp_path / "ds_cache")
    monkeypatch.setenv("FALCON_LAB_TOKENIZERS", str(tmp_path / "toks"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmpdir"))
    return tmp_path


# ------------------------------------------------------------------------------------------- sources
def test_saved_datasetdict_needs_only_its_path_and_is_sharded_once(tmp_path, monkeypatch):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:100], "id": list(range(100))}),
                               "validation": datasets.Dataset.from_dict({"text": DOCS[100:], "id": list(range(20))})})
    dd.save_to_disk(str(tmp_path / "saved"))
    cfg = compose(["data=hf", f"data.path={tmp_path / 'saved'}", f"data.cache_dir={tmp_path / 'cache'}"])
    validate_config(cfg)  # no other data key needed
    dm = build_datamodule(cfg.data)
    dm.prepare_data()
    folder = dm.shard_dir()
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["splits"]["train"]["documents"] == 100 and meta["splits"]["validation"]["documents"] == 20
    dm.setup()
    assert isinstance(dm.token_stream("train"), np.memmap) and dm.token_stream("train").dtype == np.uint16
    assert _texts(dm, "validation") == DOCS[100:] and _texts(dm, "train") == DOCS[:100]

    # a rerun (another rank, another start) reads the same shards and tokenises nothing
    monkeypatch.setattr(shards, "write_split", lambda *a, **k: pytest.fail("re-tokenised"))
    again = build_datamodule(cfg.data)
    again.setup()
    assert again.shard_dir() == folder
    assert np.array_equal(np.asarray(again.token_stream("train")), np.asarray(dm.token_stream("train")))


def test_single_saved_dataset_other_column_hash_split(tmp_path):
    datasets.Dataset.from_dict({"body": DOCS, "n": list(range(len(DOCS)))}).save_to_disk(str(tmp_path / "one"))
    dm = _dm(path=str(tmp_path / "one"), text_column="body", val_percent=20.0)
    tr, va = dm.documents("train"), dm.documents("validation")
    assert va and sorted(tr + va) == sorted(DOCS) and not set(tr) & set(va)
    with pytest.raises(ValueError, match=r"data.text_column.*'text'.*\['body', 'n'\]"):
        _dm(path=str(tmp_path / "one")).documents("train")
    with pytest.raises(ValueError, match="data.text_column.*not text"):
        _dm(path=str(tmp_path / "one"), text_column="n").documents("train")


def _write(fmt, ds, path):
    if fmt == "parquet":
        ds.to_parquet(path)
    elif fmt == "jsonl":
        ds.to_json(path)
    elif fmt == "txt":
        Path(path).write_text("\n\n".join(ds["text"]))
    elif fmt == "arrow":
        ds.save_to_disk(str(path) + ".d")
        os.replace(next(Path(str(path) + ".d").glob("*.arrow")), path)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "arrow", "txt"])
def test_data_files_of_each_type(fmt, tmp_path):
    ds = datasets.Dataset.from_dict({"text": DOCS})
    _write(fmt, ds, tmp_path / f"docs.{fmt}")
    extra = {"sample_by": "paragraph"} if fmt == "txt" else {}
    dm = _dm(path=str(tmp_path / f"docs.{fmt}"), val_percent=10.0, **extra)
    assert sorted(dm.documents("train") + dm.documents("validation")) == sorted(DOCS)
    dm.setup()
    assert len(dm.rows("train")) > 0


def test_folder_of_parquet_files_is_split_by_name(tmp_path):
    (tmp_path / "d" / "data").mkdir(parents=True)
    datasets.Dataset.from_dict({"text": DOCS[:50]}).to_parquet(str(tmp_path / "d" / "data" / "train-00000-of-00002.parquet"))
    datasets.Dataset.from_dict({"text": DOCS[50:90]}).to_parquet(str(tmp_path / "d" / "data" / "train-00001-of-00002.parquet"))
    datasets.Dataset.from_dict({"text": DOCS[90:]}).to_parquet(str(tmp_path / "d" / "data" / "validation-00000-of-00001.parquet"))
    (tmp_path / "d" / "README.md").write_text("# a dataset laid out as on the hub\n")
    (tmp_path / "d" / "dataset_infos.json").write_text("{}")  # metadata, not data
    validate_config(compose(["data=hf", f"data.path={tmp_path / 'd'}"]))
    dm = _dm(tmp_path, path=str(tmp_path / "d"))
    assert dm.documents("train") == DOCS[:90] and dm.documents("validation") == DOCS[90:]
    Path(tmp_path / "d" / "notes.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match="mixes file types"):
        validate_config(compose(["data=hf", f"data.path={tmp_path / 'd'}"]))


def test_text_and_jsonl_on_a_dataset_folder_or_parquet_point_at_data_hf(tmp_path):
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(tmp_path / "p.parquet"))
    for group, path in (("text", "saved"), ("jsonl", "saved"), ("text", "p.parquet")):
        with pytest.raises(ConfigError, match=r"data.path: .* load it with data=hf data.path="):
            validate_config(compose([f"data={group}", f"data.path={tmp_path / path}"]))
        with pytest.raises(ValueError, match="data=hf"):
            _dm(source=group, path=str(tmp_path / path)).setup()


def test_hub_name_resolved_from_the_local_cache_only(isolated_caches, no_network):
    tmp = isolated_caches
    repo = tmp / "hub" / "datasets--someone--tiny"
    snap = repo / "snapshots" / ("a" * 40)
    (snap / "data").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    datasets.Dataset.from_dict({"text": DOCS[:100]}).to_parquet(str(snap / "data" / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_dict({"text": DOCS[100:]}).to_parquet(str(snap / "data" / "validation-00000-of-00001.parquet"))
    validate_config(compose(["data=hf", "data.hf_name=someone/tiny"]))
    dm = _dm(tmp, hf_name="someone/tiny")
    dm.setup()
    assert _texts(dm, "validation") == DOCS[100:]

    for check in (lambda: validate_config(compose(["data=hf", "data.hf_name=nobody/absent"])),
                  lambda: _dm(hf_name="nobody/absent").setup()):
        with pytest.raises((ConfigError, FileNotFoundError)) as e:
            check()
        msg = str(e.value)
        assert "data.hf_name" in msg and "nobody/absent" in msg and "hf download" in msg and "save_to_disk" in msg
    assert no_network == []


# ------------------------------------------------------------------------------------------- shards
def test_shard_key_follows_corpus_tokenizer_and_settings(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    key = lambda **kw: _dm(tmp_path, path=str(tmp_path / "a.jsonl"), **kw).shard_dir()  # noqa: E731
    first = key()
    assert key() == first
    assert key(doc_boundary="eos") != first
    assert key(val_percent=5.0) != first
    assert _dm(tmp_path, source="jsonl", path=str(tmp_path / "a.jsonl")).shard_dir() != first
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": d + "!"}) for d in DOCS))
    assert key() != first  # the file changed


def test_max_tokens_caps_the_training_shard(tmp_path):
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "s"))
    dm = _dm(tmp_path, path=str(tmp_path / "s"), max_tokens=500)
    dm.setup()
    assert len(dm.token_stream("train")) == 500 and len(dm.token_stream("validation")) > 0
    mem = _dm(path=str(tmp_path / "s"), max_tokens=500)
    assert np.array_equal(np.asarray(mem.token_stream("train")), np.asarray(dm.token_stream("train")))


def test_too_short_split_names_the_split_and_source(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS}),
                          "validation": datasets.Dataset.from_dict({"text": ["hi"]})}).save_to_disk(str(tmp_path / "s"))
    with pytest.raises(ValueError, match=r"data.seq_len=16: the validation split of data.path=.* has only 4 tokens"):
        _dm(tmp_path, path=str(tmp_path / "s")).setup()


# ------------------------------------------------------------------------------------------- boundaries
@pytest.mark.parametrize("boundary", ["bos_eos", "eos", "none"])
def test_document_boundaries(boundary, tmp_path):
    tok = build_tokenizer("byte")
    docs = ["ab", "cde", "fghij", "klmnopq"] * 4
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "s"))
    dm = _dm(path=str(tmp_path / "s"), doc_boundary=boundary, seq_len=8, val_split=None, val_percent=0.0)
    s = np.asarray(dm.token_stream("train"))
    b, e = tok.bos_id, tok.eos_id
    first = {"bos_eos": [b, 97, 98, e, b, 99, 100, 101, e], "eos": [97, 98, e, 99, 100, 101, e],
             "none": [97, 98, 99, 100, 101]}[boundary]
    assert s[: len(first)].tolist() == first
    assert dm.eos_id == e and dm.bos_id == b
    starts = dm.doc_starts("train")
    assert len(starts) == len(docs) and starts[:3].tolist() == {"bos_eos": [0, 4, 9], "eos": [0, 3, 7],
                                                                "none": [0, 2, 5]}[boundary]
    x, y = dm.rows("train")[0]
    if boundary == "bos_eos":  # no loss on EOS -> next BOS
        assert y[3] == IGNORE and (y != IGNORE).sum() == 7
    else:  # the token after EOS is a real prediction
        assert (y != IGNORE).all()
    if boundary == "eos":
        cu = make_collate(b, True, "eos", e)([dm.rows("train")[0]])["cu_seqlens"]
        assert cu.tolist() == [0, 3, 7, 8]  # a new document after every EOS, and the row start


def test_boundary_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="data.cu_seqlens=true needs document boundaries"):
        validate_config(compose(["data.doc_boundary=none", "data.cu_seqlens=true"]))
    with pytest.raises(ConfigError, match="data.doc_boundary: 'sep' is not one of"):
        validate_config(compose(["data.doc_boundary=sep"]))
    check_lm_config(OmegaConf.create({"source": "kjv", "doc_boundary": "eos", "cu_seqlens": True}))


# ------------------------------------------------------------------------------------------- tokenizers
def _train_hf_tokenizer(specials, texts=DOCS, vocab_size=300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return tok


def test_any_local_tokenizer_json_file_or_folder(tmp_path):
    hf = _train_hf_tokenizer(["<s>", "</s>", "<pad>"])
    (tmp_path / "tok").mkdir()
    hf.save(str(tmp_path / "tok" / "tokenizer.json"))
    text = "Document 7: word3 word10 ünï"
    for ref in (tmp_path / "tok", tmp_path / "tok" / "tokenizer.json"):
        tok = build_tokenizer(str(ref))
        assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
        ids = tok.encode(text, add_bos=True, add_eos=True)
        assert ids[1:-1] == hf.encode(text).ids and tok.decode(ids) == text
        again = tokenizer_from_state(tok.state())
        assert again.encode(text) == tok.encode(text) and again.eos_id == tok.eos_id
    # tokenizer_config.json names the specials
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"},
                                                                        "bos_token": "</s>"}))
    tok = build_tokenizer(str(tmp_path / "tok"))
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    # trained through the datamodule, with a folder as data.tokenizer
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "s"))
    dm = _dm(tmp_path, path=str(tmp_path / "s"), tokenizer=str(tmp_path / "tok" / "tokenizer.json"))
    dm.setup()
    assert (dm.shard_dir() / "tokenizer.json").is_file() and dm.token_stream("train").dtype == np.uint16
    # no end-of-text token at all: say how to name one
    _train_hf_tokenizer(["<unk>"]).save(str(tmp_path / "bare.json"))
    with pytest.raises(ValueError, match="eos_token"):
        build_tokenizer(str(tmp_path / "bare.json"))
    with pytest.raises(ConfigError, match="data.tokenizer: .*nope.* is not one of"):
        validate_config(compose(["data.tokenizer=" + str(tmp_path / "nope")]))


def test_learned_bpe_is_saved_beside_its_shards_and_reused(tmp_path, monkeypatch):
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "s"))
    kw = dict(path=str(tmp_path / "s"), tokenizer="bpe", bpe_vocab_size=320)
    dm = _dm(tmp_path, **kw)
    saved = dm.shard_dir() / "tokenizer.json"
    assert saved.is_file() and dm.tokenizer.n_tokens <= 320
    dm.setup()
    monkeypatch.setattr(BPETokenizer, "train", classmethod(lambda *a, **k: pytest.fail("BPE retrained")))
    again = _dm(tmp_path, **kw)
    assert again.tokenizer.to_json() == dm.tokenizer.to_json() == saved.read_text()
    again.setup()
    assert np.array_equal(np.asarray(again.token_stream("validation")), np.asarray(dm.token_stream("validation")))
    # ranks that each learned one: the first file written is the one every rank uses
    assert shards.write_text_once(tmp_path / "once.json", "first") == "first"
    assert shards.write_text_once(tmp_path / "once.json", "second") == "first"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".once")] == []


def _fake_gpt2_files(folder: Path, names=("vocab.json", "merges.txt")):
    """A small byte-level BPE in GPT-2's file formats (vocab + merges, with <|endoftext|>)."""
    hf = _train_hf_tokenizer(["<|endoftext|>"])
    folder.mkdir(parents=True, exist_ok=True)
    v, m = hf.model.save(str(folder))
    os.replace(v, folder / names[0])
    os.replace(m, folder / names[1])
    return hf


def test_gpt2_offline_from_local_files_or_an_error_naming_the_file(isolated_caches, no_network):
    tmp = isolated_caches
    with pytest.raises(FileNotFoundError) as e:
        build_tokenizer("gpt2")
    msg = str(e.value)
    assert "data.tokenizer=gpt2" in msg and "tokenizer.json" in msg and str(tmp / "toks" / "gpt2") in msg
    assert "FALCON_LAB_TOKENIZERS" in msg and "urllib" not in msg
    validate_config(compose(["data.tokenizer=gpt2"]))  # configs still validate where the files are not (CI)

    # tiktoken's own cache (encoder.json / vocab.bpe under sha1 of their URLs) is enough, without tiktoken
    urls = [f"https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/{n}" for n in ("encoder.json", "vocab.bpe")]
    hf = _fake_gpt2_files(tmp / "tiktoken", tuple(hashlib.sha1(u.encode()).hexdigest() for u in urls))
    text = "Document 3: word1 word2"
    tok = build_tokenizer("gpt2")
    assert tok.eos_id == tok.bos_id == hf.token_to_id("<|endoftext|>")
    assert tok.encode(text) == hf.encode(text).ids and tok.decode(tok.encode(text, True, True)) == text
    assert tokenizer_from_state(tok.state()).encode(text) == tok.encode(text)

    # the documented place wins: $FALCON_LAB_TOKENIZERS/gpt2/{vocab.json, merges.txt}
    hf2 = _fake_gpt2_files(tmp / "toks" / "gpt2")
    assert tokmod.gpt2_files()["vocab"] == str(tmp / "toks" / "gpt2" / "vocab.json")
    assert build_tokenizer("gpt2").encode(text) == hf2.encode(text).ids
    assert no_network == []


def test_tiktoken_file_without_the_package_names_it(tmp_path, monkeypatch):
    (tmp_path / "cl100k_base.tiktoken").write_text("")
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ImportError, match=r"`tiktoken` package \(pip install tiktoken\)"):
        build_tokenizer(str(tmp_path / "cl100k_base.tiktoken"))
    with pytest.raises(ConfigError, match="no tiktoken file"):
        validate_config(compose(["data.tokenizer=" + str(tmp_path / "missing.tiktoken")]))


def test_tiktoken_file_loads_with_the_package(tmp_path):
    pytest.importorskip("tiktoken")
    import base64

    ranks = {bytes([b]): b for b in range(256)}
    for w in (b"th", b"he", b"the", b" t", b" the"):
        ranks[w] = len(ranks)
    (tmp_path / "cl100k_base.tiktoken").write_bytes(
        b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))
    tok = build_tokenizer(str(tmp_path / "cl100k_base.tiktoken"))
    assert tok.encode("the the") == [258, 260] and tok.decode(tok.encode("the the", True, True)) == "the the"
    assert tokenizer_from_state(tok.state()).encode("the the") == [258, 260]


# ------------------------------------------------------------------------------------------- registry
def test_registry_and_datamodules_import_one_way():
    root = Path(__file__).resolve().parents[1] / "falcon_lab" / "data"

    def imports(path):
        mods = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                mods |= {a.name for a in node.names}
        return mods

    assert not {m for m in imports(root / "registry.py") if m.startswith("falcon_lab")}
    for f in [root / "lm.py", *sorted((root / "tasks").glob("*.py"))]:
        assert "falcon_lab.data.registry" not in imports(f), f
    assert {"lm", "addition", "mqar"} <= set(available_datamodules())
    assert get_datamodule_cls("lm").__name__ == "LMDataModule"


# ------------------------------------------------------------------------------------------- end to end
def test_fit_on_a_saved_dataset_with_a_tokenizer_json(tmp_path, monkeypatch):
    from falcon_lab.training import load_checkpoint, run

    monkeypatch.chdir(tmp_path)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS * 3}),
                          "validation": datasets.Dataset.from_dict({"text": DOCS[:20]})}).save_to_disk("saved")
    _train_hf_tokenizer(["<|endoftext|>"]).save(str(tmp_path / "tokenizer.json"))
    res = run(compose(["debug=smoke", "logger=none", "data=hf", "data.path=saved", "data.cache_dir=cache",
                       f"data.tokenizer={tmp_path / 'tokenizer.json'}", "data.doc_boundary=eos",
                       "data.cu_seqlens=true", "data.seq_len=32", "trainer.max_steps=2", "checks.shuffle=false"]))
    assert torch.isfinite(torch.tensor(res["final_val_loss"]))
    assert len(list((tmp_path / "cache").glob("hf-saved-*/meta.json"))) == 1  # prepare_data wrote the shards
    model, tok, cfg = load_checkpoint(res["ckpt_path"])
    assert tok.decode(tok.encode("Document 5: word1")) == "Document 5: word1" and model.vocab_size == tok.vocab_size
