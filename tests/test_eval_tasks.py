"""Task generators: addition answers are right at every width and format, held-out validation pairs
never reach training, MQAR answers are recoverable by construction, passkey prompts fit."""
import pytest

from falcon_lab.data.tasks.addition import FORMATS, AdditionTask, format_example, parse_answer
from falcon_lab.data.tasks.mqar import MQARSpec, make_mqar, recover_answers
from falcon_lab.data.tasks.passkey import QUESTION, make_passkey, passkey_grid


@pytest.mark.parametrize("fmt", FORMATS)
def test_addition_answers_right_for_every_width(fmt):
    task = AdditionTask(fmt=fmt, seed=3)
    for n in range(1, 49):
        for ex in task.fresh(n, 5, "check"):
            assert parse_answer(ex.answer, fmt) == ex.a + ex.b
            if fmt == "paper":
                a_s, b_s = ex.prompt[:-2].split(" + ")
                assert len(a_s) == len(b_s) == n and int(a_s) == ex.a and int(b_s) == ex.b
                assert len(ex.answer) == n + 2  # space + n+1 digits
                assert ex.answer[1:] == f"{ex.a + ex.b:0{n + 1}d}"[::-1]
            elif fmt == "bracketed":
                a_s, b_s = ex.prompt[:-2].split(" + ")
                assert int(a_s[1:-1][::-1]) == ex.a and len(a_s) == n + 2
                assert int(b_s[1:-1][::-1]) == ex.b
            else:  # evaluation sets use exactly n digits per operand
                assert len(str(ex.a)) == len(str(ex.b)) == n


def test_addition_hand_examples():
    assert format_example(42, 917, 4).prompt == "0042 + 0917 ="
    assert format_example(42, 917, 4).answer == " 95900"
    assert format_example(42, 917, 4, "bracketed").text == "[2400] + [7190] = [95900]"
    assert format_example(5, 7, 1).answer == " 21"
    assert format_example(99, 1, 3, "variable").text == "[99] + [1] = [001]"
    with pytest.raises(ValueError, match="format"):
        format_example(1, 2, 1, "nope")
    with pytest.raises(ValueError, match="width"):
        format_example(100, 2, 2)
    assert parse_answer(" 9x", "paper") is None


def test_addition_validation_held_out_from_training():
    task = AdditionTask(seed=1, val_per_width=8)
    held = set(task.heldout_widths())
    assert 1 not in held and 2 not in held  # 100 and 10^4 pairs: too few to hold out
    assert set(range(3, 33)) <= held
    val = task.validation()
    assert sorted(val) == list(range(1, 33))
    assert all(len(v) == 8 for v in val.values())
    val_pairs = {(ex.width, ex.a, ex.b) for n in held for ex in val[n]}
    # force collisions: a training stream whose rng would hit held-out pairs is redirected
    train = [task.train_example(i) for i in range(3000)]
    assert not val_pairs & {(ex.width, ex.a, ex.b) for ex in train}
    # same index -> same example (a resumed run sees the same data)
    assert task.train_example(17) == AdditionTask(seed=1, val_per_width=8).train_example(17)
    widths = [ex.width for ex in train]
    assert min(widths) == 1 and max(widths) == 32


def test_addition_rejection_really_rejects():
    # tiny width with hold-out forced on: training must never emit a held-out pair
    task = AdditionTask(train_widths=(1, 1), seed=0, val_per_width=60, min_pairs_for_holdout=1)
    held = {(ex.a, ex.b) for ex in task.validation()[1]}
    assert len(held) == 60
    seen = {(ex.a, ex.b) for ex in (task.train_example(i) for i in range(2000))}
    assert not seen & held
    assert len(seen) == 40  # exactly the 100 - 60 remaining pairs


def test_addition_bad_config_names_key():
    with pytest.raises(ValueError, match="train_widths"):
        AdditionTask(train_widths=(0, 3))
    with pytest.raises(ValueError, match="format"):
        AdditionTask(fmt="latex")


def test_mqar_answers_recoverable_by_construction():
    for nkv, T in [(1, 8), (4, 32), (16, 64), (32, 256)]:
        d = make_mqar(MQARSpec(nkv, T), 20, seed=nkv)
        assert d["input_ids"].shape == (20, T)
        assert ((d["targets"] != -100).sum(1) == nkv).all()  # every key queried once
        assert recover_answers(d["input_ids"], nkv, d["targets"])
    # a corrupted value is detected (the check can fail)
    d = make_mqar(MQARSpec(4, 32), 2, seed=0)
    ids = d["input_ids"].clone()
    ids[0, 1] = 128 if ids[0, 1] != 128 else 129
    assert not recover_answers(ids, 4, d["targets"])


def test_mqar_bad_specs():
    with pytest.raises(ValueError, match="seq_len"):
        make_mqar(MQARSpec(8, 16), 1)
    with pytest.raises(ValueError, match="num_kv_pairs"):
        make_mqar(MQARSpec(200, 1024), 1)
    with pytest.raises(ValueError, match="overlap"):
        make_mqar(MQARSpec(2, 16, key_ids=(1, 130)), 1)


def test_passkey_fits_and_places_key():
    for L in (150, 400, 1000):
        for depth in (0.0, 0.5, 1.0):
            ex = make_passkey(L, depth, seed=2)
            assert len(ex.prompt) <= L
            assert len(ex.prompt) > L - 40  # filled up to about the length
            pos = ex.prompt.index(f"The pass key is {ex.key}")
            assert ex.answer == " " + ex.key
            needle = f"The pass key is {ex.key}. Remember it. {ex.key} is the pass key. "
            filler_len = len(ex.prompt) - len(needle) - len(QUESTION)
            assert abs(pos / filler_len - depth) < 0.15  # depth = fraction of the filler before it
    assert len(passkey_grid([200, 300], [0.0, 1.0], per_cell=2)) == 8
    with pytest.raises(ValueError, match="context_len"):
        make_passkey(20, 0.5)


def test_task_datamodules_batches():
    from omegaconf import OmegaConf

    from falcon_lab.data import build_datamodule
    dm = build_datamodule(OmegaConf.create({"name": "addition", "batch_size": 4, "val_per_width": 2}))
    b = next(iter(dm.train_dataloader()))
    tok = dm.tokenizer
    for ids, lab in zip(b["input_ids"].tolist(), b["labels"].tolist()):
        scored = [y for y in lab if y != -100]
        first = next(i for i, y in enumerate(lab) if y != -100)
        text = tok.decode(ids[:first + 1])
        a, rest = text.split(" + ")
        assert rest.endswith("=")  # loss starts right after "="
        assert scored[-1] == tok.eos_id
        assert tok.decode(scored[:-1]) == " " + f"{int(a) + int(rest[:-2]):0{len(a) + 1}d}"[::-1]
        assert ids[first + 1:first + len(scored)] == scored[:-1]  # labels are the shifted inputs
    assert sum(1 for _ in dm.val_dataloader()) >= 1
    dm = build_datamodule(OmegaConf.create({"name": "mqar", "batch_size": 3, "seq_len": 32,
                                            "num_kv_pairs": [2, 4]}))
    b = next(iter(dm.train_dataloader()))
    assert b["input_ids"].shape == (3, 32)
    lab = b["labels"]
    pos = (lab != -100).nonzero().tolist()
    assert all(b["input_ids"][r, c + 1] == lab[r, c] for r, c in pos)
    with pytest.raises(ValueError, match="bogus"):
        build_datamodule(OmegaConf.create({"name": "addition", "bogus": 1}))
    with pytest.raises(ValueError, match="data.num_kv_pairs"):
        build_datamodule(OmegaConf.create({"name": "mqar", "seq_len": 16, "num_kv_pairs": 8}))
    with pytest.raises(ValueError, match="data.seq_len"):
        build_datamodule(OmegaConf.create({"name": "addition", "seq_len": 50}))


def test_variable_format_holds_pairs_out_under_every_width_cap():
    # in the variable format the same pair can be drawn under different width caps: hold-out must
    # be by pair, not by (cap, pair)
    task = AdditionTask(fmt="variable", train_widths=(1, 2), seed=0, val_per_width=30, min_pairs_for_holdout=1)
    held = {(ex.a, ex.b) for v in task.validation().values() for ex in v}
    seen = {(ex.a, ex.b) for ex in (task.train_example(i) for i in range(4000))}
    assert not seen & held
    assert task.is_held_out(2, *next(iter(held))) and task.is_held_out(1, *next(iter(held)))
