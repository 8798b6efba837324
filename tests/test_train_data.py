"""Corpus, tokenizer, packing, resumable order, local files."""
import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from falcon_lab.data import ByteTokenizer, build_datamodule
from falcon_lab.data.corpus import load_kjv, split_of
from falcon_lab.data.lm import IGNORE, PackedRows, StepBatchSampler, cu_seqlens_from_bos


def test_byte_tokenizer_roundtrip_and_vocab():
    tok = ByteTokenizer()
    text = "In the beginning — God ∑ créé"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == text
    assert tok.vocab_size % 64 == 0 and tok.vocab_size > max(tok.bos_id, tok.eos_id, tok.pad_id)
    assert list(tok.encode_array(text, True, True)) == ids


def test_kjv_corpus_split_is_deterministic_and_disjoint():
    tr, va, te = load_kjv("train"), load_kjv("validation"), load_kjv("test")
    assert tr[0]["text"].startswith("In the beginning God created the heaven and the earth.")
    assert len(tr) + len(va) + len(te) == 1189  # chapters of the KJV
    keys = [{(d["book"], d["chapter"]) for d in s} for s in (tr, va, te)]
    assert not (keys[0] & keys[1]) and not (keys[0] & keys[2]) and not (keys[1] & keys[2])
    assert 10 <= len(va) <= 60 and 10 <= len(te) <= 60
    assert all(split_of(d["book"], d["chapter"]) == "validation" for d in va)


def test_packing_labels_and_cu_seqlens():
    tok = ByteTokenizer()
    stream = np.concatenate([tok.encode_array("ab", True, True), tok.encode_array("cde", True, True)])
    rows = PackedRows(stream, seq_len=4, eos_id=tok.eos_id, pad_id=tok.pad_id)
    x, y = rows[0]
    assert x.tolist() == [tok.bos_id, 97, 98, tok.eos_id]
    assert y.tolist() == [97, 98, tok.eos_id, IGNORE]  # no loss on predicting the next document's BOS
    cu = cu_seqlens_from_bos(torch.stack([rows[0][0], rows[1][0]]), tok.bos_id)
    assert cu.tolist() == [0, 4, 8]
    x1, _ = rows[1]
    assert x1.tolist() == [tok.bos_id, 99, 100, 101]


def test_step_sampler_resume_and_ranks():
    full = list(StepBatchSampler(50, 4, seed=3, total_batches=30))
    assert list(StepBatchSampler(50, 4, seed=3, start_batch=17, total_batches=30)) == full[17:]
    r0 = list(StepBatchSampler(50, 2, seed=3, total_batches=30, rank=0, world_size=2))
    r1 = list(StepBatchSampler(50, 2, seed=3, total_batches=30, rank=1, world_size=2))
    assert [a + b for a, b in zip(r0, r1)] == full  # ranks split each global batch
    first_epoch = [i for b in full for i in b][:50]
    assert sorted(first_epoch) == list(range(50))  # every row once per epoch


def _dm(**kw):
    base = dict(name="lm", source="kjv", seq_len=32, batch_size=4, tokenizer="byte", cu_seqlens=False)
    base.update(kw)
    return build_datamodule(OmegaConf.create(base))


def test_local_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("first document here.\n\nsecond paragraph.\n")
    recs = [{"body": f"record number {i} " * 5} for i in range(40)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    dm = _dm(source="text", path=str(tmp_path / "a.txt"), val_path=str(tmp_path / "a.txt"), seq_len=8)
    assert dm.tokenizer.decode(dm.token_stream("train")).startswith("first document here.")
    dm = _dm(source="jsonl", path=str(tmp_path / "d.jsonl"), text_field="body", seq_len=16, val_percent=20.0)
    tr, va = dm.documents("train"), dm.documents("validation")
    assert len(tr) + len(va) == 40 and va and not set(tr) & set(va)
    with pytest.raises(KeyError, match="data.text_field"):
        _dm(source="jsonl", path=str(tmp_path / "d.jsonl"), text_field="nope").documents("train")
    with pytest.raises(FileNotFoundError, match="data.path"):
        _dm(source="text", path=str(tmp_path / "missing.txt")).documents("train")


def test_token_cache_is_memory_mapped(tmp_path):
    dm = _dm(cache_dir=str(tmp_path))
    a = dm.token_stream("validation")
    b = _dm(cache_dir=str(tmp_path)).token_stream("validation")
    assert isinstance(b, np.memmap) and np.array_equal(np.asarray(a), np.asarray(b))


def test_unknown_datamodule_names_the_key():
    with pytest.raises(ValueError, match="data.name"):
        build_datamodule(OmegaConf.create({"name": "nope"}))


def test_bpe_trained_on_the_split_roundtrips():
    import tokenizers  # a declared dependency: fail, never skip
    from falcon_lab.data.tokenizer import BPETokenizer, tokenizer_from_state

    assert tokenizers.__version__

    docs = [d["text"] for d in load_kjv("train")[:200]]
    tok = BPETokenizer.train(docs, vocab_size=512)
    text = "And God said unto Moses, I AM THAT I AM: ünïcode too"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert tok.decode(ids) == text and ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3 and tok.vocab_size % 64 == 0
    assert len(ids) < 0.6 * len(text.encode())  # merges learned from the corpus compress it
    again = tokenizer_from_state(tok.state())
    assert again.encode(text) == tok.encode(text)
