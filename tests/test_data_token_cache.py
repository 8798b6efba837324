"""Issue 17, point 7 (the rest): text corpora (data=kjv / text / jsonl) are tokenised once into a token cache that
every process reuses (`data.cache_dir: auto`, the per-user cache), keyed by the corpus files, the tokenizer and the
data settings, written atomically, and off with `data.cache_dir=null`. Every test points the cache at tmp_path."""
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from falcon_lab.data import build_datamodule
from falcon_lab.data import lm as lm_mod
from falcon_lab.data import shards
from falcon_lab.data.tokenizer import ByteTokenizer
from falcon_lab.training.config import compose



@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    """`auto` resolves to tmp_path/auto-cache: nothing is written to the real home."""
    d = tmp_path / "auto-cache"
    monkeypatch.setenv(lm_mod.CACHE_ENV, str(d))
    return d


@pytest.fixture
def encodes(monkeypatch):
    """Counts the documents the byte tokenizer encodes (its numpy fast path, the one the datamodule uses)."""
    calls = {"n": 0}
    orig = ByteTokenizer.encode_array

    def counted(self, text, add_bos=False, add_eos=False):
        calls["n"] += 1
        return orig(self, text, add_bos, add_eos)

    monkeypatch.setattr(ByteTokenizer, "encode_array", counted)
    return calls


def _corpus(path: Path, n: int = 60, salt: str = "") -> Path:
    path.write_text("\n\n".join(f"Document {i}{salt}: " + "the quick brown fox jumps over the lazy dog. " * 3
                                for i in range(n)) + "\n")
    return path


def _text_dm(path, *over):
    return build_datamodule(compose(["data=text", f"data.path={path}", "data.sample_by=paragraph",
                                     "data.seq_len=32", *over]).data, seed=0)


def _streams(dm):
    return {s: np.asarray(dm.token_stream(s), dtype=np.int64) for s in ("train", "validation")}


def test_text_corpora_default_to_the_per_user_cache(cache_env, monkeypatch, tmp_path):
    for name in ("kjv", "text", "jsonl"):
        assert compose([f"data={name}"]).data.cache_dir == "auto"
    assert lm_mod.resolve_cache_dir("auto") == cache_env
    assert lm_mod.resolve_cache_dir(None) is None and lm_mod.resolve_cache_dir(False) is None
    assert lm_mod.resolve_cache_dir("off") is None and lm_mod.resolve_cache_dir("null") is None
    assert lm_mod.resolve_cache_dir("~/x") == Path.home() / "x"
    monkeypatch.setenv(lm_mod.CACHE_ENV, "off")  # the environment can switch `auto` off
    assert lm_mod.resolve_cache_dir("auto") is None
    monkeypatch.delenv(lm_mod.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert lm_mod.resolve_cache_dir("auto") == tmp_path / "xdg" / "falcon_lab" / "tokens"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert lm_mod.resolve_cache_dir("auto") == tmp_path / "home" / ".cache" / "falcon_lab" / "tokens"


def test_a_second_build_reads_the_cache_instead_of_tokenising(cache_env, encodes, tmp_path, monkeypatch):
    corpus = _corpus(tmp_path / "corpus.txt")
    dm = _text_dm(corpus)
    dm.prepare_data()  # what Lightning runs on local rank 0
    first = _streams(dm)
    n_docs = encodes["n"]
    assert n_docs >= 60
    folders = [p.parent for p in cache_env.glob("text-corpus.txt-*/meta.json")]
    assert len(folders) == 1 and dm.shard_dir() == folders[0].resolve()
    meta = json.loads((folders[0] / "meta.json").read_text())
    assert meta["splits"]["train"]["documents"] + meta["splits"]["validation"]["documents"] == 60
    assert not list(folders[0].glob(".*tmp*"))  # temporary files renamed into place

    # a new process (a DDP rank, a sweep worker, a rerun) reads the shards: no encoding, not even the corpus loaded
    monkeypatch.setattr(lm_mod.Corpus, "_local_splits", lambda self: pytest.fail("corpus re-read"))
    again = _text_dm(corpus)
    again.prepare_data()
    second = _streams(again)
    assert encodes["n"] == n_docs, "re-tokenised"
    assert again.shard_dir() == dm.shard_dir()
    assert isinstance(again.token_stream("train"), np.memmap)
    for s in first:
        assert np.array_equal(first[s], second[s])
    x, y = again.rows("train")[0]
    assert x.shape == (32,) and y.shape == (32,)


def test_a_changed_corpus_tokenizer_or_setting_gets_new_shards(cache_env, encodes, tmp_path):
    corpus = _corpus(tmp_path / "corpus.txt")
    old = _text_dm(corpus)
    a = _streams(old)
    _corpus(corpus, salt=" changed")  # same name, other content (and size)
    st = os.stat(corpus)
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a clock-resolution-proof mtime change
    n = encodes["n"]
    new = _text_dm(corpus)
    b = _streams(new)
    assert encodes["n"] > n  # tokenised again
    assert new.shard_dir() != old.shard_dir()
    assert not np.array_equal(a["train"], b["train"])
    text = ByteTokenizer().decode(int(t) for t in b["train"][:200] if t < 256)
    assert "changed" in text
    # the data settings that change the tokens are in the key; the packing length is not (tokens do not change)
    assert _text_dm(corpus, "data.doc_boundary=eos").shard_dir() != new.shard_dir()
    assert _text_dm(corpus, "data.val_percent=10").shard_dir() != new.shard_dir()
    assert _text_dm(corpus, "data.sample_by=line").shard_dir() != new.shard_dir()
    assert _text_dm(corpus, "data.seq_len=16").shard_dir() == new.shard_dir()
    assert len({p.parent for p in cache_env.glob("*/meta.json")}) == 2


def test_the_cache_dir_is_respected_and_null_switches_it_off(cache_env, encodes, tmp_path):
    corpus = _corpus(tmp_path / "corpus.jsonl", n=0)
    corpus.write_text("".join(json.dumps({"body": f"record {i} " + "lorem ipsum dolor sit amet " * 4}) + "\n"
                              for i in range(50)))
    mine = tmp_path / "my cache"
    dm = build_datamodule(compose(["data=jsonl", f"data.path={corpus}", "data.text_field=body", "data.val_percent=20",
                                   f"data.cache_dir={mine}", "data.seq_len=32"]).data)
    dm.setup()
    assert dm.shard_dir().parent == mine.resolve()
    assert len(list(mine.glob("jsonl-corpus.jsonl-*/train.bin"))) == 1
    assert not cache_env.exists()  # only the folder asked for

    off = build_datamodule(compose(["data=jsonl", f"data.path={corpus}", "data.text_field=body", "data.val_percent=20",
                                    "data.cache_dir=null", "data.seq_len=32"]).data)
    n = encodes["n"]
    off.setup()
    assert off.shard_dir() is None and encodes["n"] == n + 50  # tokenised in memory, as before
    assert not cache_env.exists()
    assert np.array_equal(np.asarray(off.token_stream("train"), np.int64),
                          np.asarray(dm.token_stream("train"), np.int64))


def test_kjv_is_cached_too_and_an_unwritable_auto_cache_falls_back_to_memory(tmp_path, monkeypatch, encodes):
    monkeypatch.setenv(lm_mod.CACHE_ENV, str(tmp_path / "c"))
    dm = build_datamodule(compose(["data.seq_len=64"]).data)
    dm.token_stream("validation")
    assert dm.shard_dir().name.startswith("kjv-") and (dm.shard_dir() / "meta.json").is_file()
    n = encodes["n"]
    build_datamodule(compose(["data.seq_len=64"]).data).token_stream("train")
    assert encodes["n"] == n  # the whole Bible tokenised once, by the first build
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(lm_mod.CACHE_ENV, str(blocker / "tokens"))  # cannot be created
    dm = build_datamodule(compose(["data.seq_len=64"]).data)
    assert dm.shard_dir() is None and len(dm.token_stream("validation")) > 1000


def test_an_incomplete_shard_folder_is_rebuilt(cache_env, tmp_path):
    corpus = _corpus(tmp_path / "corpus.txt")
    dm = _text_dm(corpus)
    a = _streams(dm)
    train = dm.shard_dir() / "train.bin"
    train.write_bytes(train.read_bytes()[:10])  # e.g. a disk that filled up under another writer
    b = _streams(_text_dm(corpus))
    assert np.array_equal(a["train"], b["train"]) and train.stat().st_size == 2 * len(a["train"])


def _build_at_once(barrier, cfg, queue):
    import hashlib

    barrier.wait(timeout=60)  # both processes start tokenising at the same moment
    dm = build_datamodule(cfg)
    dm.prepare_data()
    queue.put((hashlib.sha1(np.asarray(dm.token_stream("train"), np.int64).tobytes()).hexdigest(),
               len(dm.token_stream("validation"))))


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_concurrent_processes_build_one_consistent_cache(tmp_path):
    """Two processes (two sweep workers, two nodes' rank 0) tokenising the same corpus at the same moment: both get
    the same tokens, the folder ends complete and without temporary files. (Forked, so the test does not pay two
    imports of torch and Lightning.)"""
    import multiprocessing as mp

    from omegaconf import OmegaConf

    corpus = _corpus(tmp_path / "corpus.txt", n=2000)
    cache = tmp_path / "shared"
    cfg = OmegaConf.create(dict(name="lm", source="text", path=str(corpus), sample_by="paragraph", tokenizer="byte",
                                seq_len=32, batch_size=4, cache_dir=str(cache)))
    ctx = mp.get_context("fork")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_build_at_once, args=(barrier, cfg, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got[0] == got[1] and got[0][1] > 0
    folder = next(cache.glob("text-corpus.txt-*"))
    meta = shards.read_meta(folder)
    assert meta is not None and shards.is_complete(folder, meta)
    assert not list(folder.glob(".*tmp*"))
    local = build_datamodule(OmegaConf.merge(cfg, {"cache_dir": None}))
    assert got[0][1] == len(local.token_stream("validation"))
