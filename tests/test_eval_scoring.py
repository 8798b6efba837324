"""Scorers against hand-built models whose log-probabilities are known: perplexity, rolling
windows, exact match, greedy decoding (recurrent vs full forward), MQAR accuracy and state size."""
import math

import pytest
import torch

from falcon_lab.data.tasks.addition import AdditionTask
from falcon_lab.data.tasks.mqar import MQARSpec, make_mqar
from falcon_lab.evaluation.addition import evaluate_addition, example_tokens, score_examples
from falcon_lab.evaluation.common import greedy_generate, score_continuations
from falcon_lab.evaluation.mqar import evaluate_mqar, state_numel
from falcon_lab.evaluation.passkey import evaluate_passkey
from falcon_lab.evaluation.perplexity import perplexity, position_curve, rolling_pairs
from falcon_lab.evaluation.toy import BigramLM, LookupLM, PrefixSumLM, ToyByteTokenizer, cycle_table

TOK = ToyByteTokenizer()


def direct_nll(model: BigramLM, text: str, max_length: int) -> float:
    """NLL by hand: BOS then each byte; a window restart conditions on the previous byte only,
    which for a bigram model is the same as any longer context."""
    ids = [TOK.bos_id] + TOK.encode(text)
    return -sum(model.logprob(a, b) for a, b in zip(ids[:-1], ids[1:]))


def test_rolling_pairs_predict_every_token_once():
    toks = list(range(10, 33))
    for L in (1, 4, 7, 23, 50):
        for stride in sorted({1, max(1, L // 2), L}):
            pairs = rolling_pairs(toks, 0, L, stride)
            pred = [t for _, c in pairs for t in c]
            assert pred == toks
            for ctx, cont in pairs:
                assert len(ctx) + len(cont) - 1 <= L  # model input never exceeds max_length
                full = [0] + toks
                # context is exactly what precedes the continuation in the document
                start = full.index(cont[0]) if cont[0] in full else None
                assert full[start - len(ctx):start] == ctx
    with pytest.raises(ValueError, match="stride"):
        rolling_pairs(toks, 0, 4, 5)


def test_perplexity_matches_known_logprobs():
    torch.manual_seed(1)
    model = BigramLM(torch.randn(259, 259) * 2)
    docs = ["In the beginning was the word.", "abc", "A longer document, with some words, " * 3]
    for L in (8, 64):
        res = perplexity(model, TOK, docs, max_length=L, batch_size=3)
        want = sum(direct_nll(model, d, L) for d in docs)
        assert res.nll_sum == pytest.approx(want, rel=1e-5)
        assert res.n_tokens == sum(len(d.encode()) for d in docs)
        assert res.n_words == sum(len(d.split()) for d in docs)
        assert res.ppl == pytest.approx(math.exp(want / res.n_tokens), rel=1e-5)
        assert res.bits_per_byte == pytest.approx(want / res.n_bytes / math.log(2), rel=1e-5)
        assert res.word_ppl == pytest.approx(math.exp(want / res.n_words), rel=1e-5)


def test_context_dependent_scoring_uses_the_right_context():
    # PrefixSumLM depends on the whole prefix: a padding or truncation bug changes its log-probs
    torch.manual_seed(2)
    model = PrefixSumLM(torch.randn(259, 259))
    pairs = [([256, 5, 9], [3, 4]), ([256], [7]), ([256] + list(range(40)), [1, 2, 3])]
    got = score_continuations(model, pairs, batch_size=2)
    for (ctx, cont), g in zip(pairs, got):
        seq = ctx + cont
        want = 0.0
        for t in range(len(ctx), len(seq)):
            lp = torch.log_softmax(model.table[sum(seq[:t]) % 259].double(), -1)
            want += float(lp[seq[t]])
        assert g.logprob == pytest.approx(want, rel=1e-5)
    # truncation to max_length keeps the last tokens
    trunc = score_continuations(model, [pairs[2]], max_length=10)[0]
    seq = pairs[2][0] + pairs[2][1]
    inp = seq[:-1][-10:]
    lp = torch.log_softmax(model.forward(torch.tensor([inp])).double(), -1)[0]
    assert trunc.logprob == pytest.approx(float(sum(lp[len(inp) - 3 + i, c] for i, c in enumerate([1, 2, 3]))),
                                          rel=1e-5)


def test_exact_match_on_hand_built_cases():
    task = AdditionTask(train_widths=(1, 4), ood_widths=(5, 6), val_per_width=3, seed=0)
    exs = {n: task.fresh(n, 4, "hand") for n in (3, 5)}
    seqs = [sum(example_tokens(TOK, e), []) for v in exs.values() for e in v]
    perfect = LookupLM.from_sequences(seqs)
    s = score_examples(perfect, TOK, exs, free_running=True)
    assert all(w.exact == 1.0 and w.token_acc == 1.0 and w.free_exact == 1.0 for w in s.values())
    # corrupt one digit of one example: that example fails exact match, token accuracy drops by one
    bad = exs[5][1]
    ctx, ans = example_tokens(TOK, bad)
    corrupt = LookupLM.from_sequences(seqs)
    key = tuple(ctx + ans[:2])
    corrupt.next[key] = ord("0") + (corrupt.next[key] - ord("0") + 1) % 10
    s2 = score_examples(corrupt, TOK, exs, free_running=True)
    assert s2[3].exact == 1.0
    assert s2[5].exact == 0.75 and s2[5].free_exact == 0.75
    n_tok = sum(len(example_tokens(TOK, e)[1]) for e in exs[5])
    assert s2[5].token_acc == pytest.approx((n_tok - 1) / n_tok)
    # a model that never emits EOS gets every digit right but no exact match
    no_eos = [q[:-1] for q in seqs]
    s3 = score_examples(LookupLM.from_sequences(no_eos), TOK, exs, free_running=True)
    assert all(w.exact == 0.0 and w.free_exact == 0.0 and w.token_acc < 1.0 for w in s3.values())


def test_evaluate_addition_reports_heldout_flags_and_ood():
    task = AdditionTask(train_widths=(1, 3), ood_widths=(4, 5), val_per_width=2, seed=0)
    val = task.validation()
    seqs = [sum(example_tokens(TOK, e), []) for v in val.values() for e in v]
    seqs += [sum(example_tokens(TOK, e), []) for e in task.fresh(4, 5, "ood")]
    res = evaluate_addition(LookupLM.from_sequences(seqs), TOK, task, n_examples=5)
    assert res.val_acc == 1.0
    assert res.ood[4].exact == 1.0 and res.ood[5].exact == 0.0
    m = res.metrics()
    assert m["addition/ood_mean"] == 0.5 and m["addition/acc_d4"] == 1.0 and m["addition/acc_d5"] == 0.0
    assert [w for w, s in res.val.items() if not s.held_out] == [1, 2]
    assert res.val[3].held_out and "not held out" in res.notes[0]


def test_greedy_generate_recurrent_equals_full_forward():
    torch.manual_seed(3)
    model = PrefixSumLM(torch.randn(259, 259) * 3)
    prompts = [[256, 1, 2, 3], [256], [256, 9, 8, 7, 6, 5, 4, 3], [256, 50, 60]]
    rec = greedy_generate(model, prompts, max_new_tokens=12, batch_size=3, use_recurrent=True)
    full = greedy_generate(model, prompts, max_new_tokens=12, batch_size=3, use_recurrent=False)
    assert rec == full
    for p, g in zip(prompts, rec):  # and equals a one-at-a-time reference
        seq = list(p)
        for _ in range(12):
            seq.append(int(model.table[sum(seq) % 259].argmax()))
        assert g == seq[len(p):]


def test_greedy_generate_stops():
    model = BigramLM(cycle_table("abc\n"))
    out = greedy_generate(model, [[256, ord("x"), ord("a")]], max_new_tokens=20,
                          stop=lambda g: TOK.decode(g).endswith("\n"))
    assert TOK.decode(out[0]) == "bc\n"
    t = cycle_table("abc")
    t[ord("c"), TOK.eos_id] = 50.0  # after "c" the model ends the text
    out = greedy_generate(BigramLM(t), [[256, ord("a")]], max_new_tokens=20, eos_id=TOK.eos_id)
    assert TOK.decode(out[0]) == "bc"


def test_mqar_accuracy_and_state_size():
    spec = MQARSpec(4, 32)
    data = make_mqar(spec, 8, seed=1234 + 7919 * 4 + 32)
    # a lookup model that knows the values at the query positions (and nothing else)
    table = {}
    for r, t in zip(data["input_ids"].tolist(), data["targets"].tolist()):
        for i, v in enumerate(t):
            if v != -100:
                table[tuple(r[:i + 1])] = v
    res = evaluate_mqar(LookupLM(table), [(4, 32)], n_examples=8, seed=1234)
    assert res.cells[0]["acc"] == 1.0 and res.cells[0]["n_queries"] == 32
    res0 = evaluate_mqar(BigramLM(torch.zeros(259, 259)), [(4, 32), (2, 16)], n_examples=4)
    assert all(c["acc"] == 0.0 for c in res0.cells)  # argmax id 0 is never a value
    assert state_numel(PrefixSumLM(torch.zeros(3, 3))) == 1
    assert state_numel(torch.nn.Sequential(PrefixSumLM(torch.zeros(3, 3)), PrefixSumLM(torch.zeros(3, 3)))) == 2


def test_passkey_scoring():
    from falcon_lab.data.tasks.passkey import passkey_grid
    exs = passkey_grid([120, 200], [0.0, 1.0], per_cell=2, seed=0, length_fn=lambda s: len(s) + 1)
    seqs = [[TOK.bos_id] + TOK.encode(e.prompt + e.answer) for e in exs if e.context_len == 120]
    res = evaluate_passkey(LookupLM.from_sequences(seqs), TOK, context_lens=[120, 200], depths=[0.0, 1.0],
                           per_cell=2)
    m = res.metrics()
    assert m["passkey/acc_L120"] == 1.0 and m["passkey/acc_L200"] == 0.0


def test_position_curve_shape():
    model = BigramLM(torch.zeros(259, 259))
    pc = position_curve(model, TOK, ["x" * 500], seq_len=64, n_windows=3, train_len=32)
    assert len(pc.loss) == 64 and pc.n_windows == 3
    assert all(abs(v - math.log(259)) < 1e-5 for v in pc.loss)  # uniform model: log V everywhere
    assert set(pc.metrics()) >= {"extrap/text/loss_within_train_len", "extrap/text/loss_beyond_train_len"}


def test_text_sources(tmp_path):
    from falcon_lab.evaluation.perplexity import SourceUnavailable, load_texts
    (tmp_path / "a.txt").write_text("first doc\nline two\n\nsecond doc\n")
    (tmp_path / "b.jsonl").write_text('{"text": "x y"}\n{"text": "z"}\n')
    assert load_texts(f"text:{tmp_path / 'a.txt'}") == ["first doc\nline two", "second doc"]
    assert load_texts(str(tmp_path / "b.jsonl")) == ["x y", "z"]
    assert load_texts(str(tmp_path / "b.jsonl"), max_chars=2) == ["x "]
    with pytest.raises(SourceUnavailable, match="not found"):
        load_texts("jsonl:/nonexistent.jsonl")
    with pytest.raises(ValueError, match="ppl source"):
        load_texts("nonsense")
    with pytest.raises(SourceUnavailable, match="wikitext"):  # tests run offline (conftest)
        load_texts("wikitext")
    assert len(load_texts("corpus", max_docs=2)) == 2  # the embedded corpus's validation split


def test_variable_format_adds_the_capped_ood_split():
    # variable format: besides exact-width OOD examples, the capped split draws each operand's width
    # U{1..cap} (the authors' generator); a model that knows only the capped examples at cap 4 scores
    # 1.0 there and 0.0 on the exact-width split, and the metrics say so under their own keys
    task = AdditionTask(fmt="variable", train_widths=(1, 3), ood_widths=(4, 5), val_per_width=2, seed=0)
    capped = task.fresh(4, 6, "oodcap", exact=False)
    assert any(max(len(str(e.a)), len(str(e.b))) < 4 for e in capped)  # a cap, not an exact width
    assert all(len(str(e.a)) == 4 and len(str(e.b)) == 4 for e in task.fresh(4, 6, "ood"))
    seqs = [sum(example_tokens(TOK, e), []) for e in capped]
    res = evaluate_addition(LookupLM.from_sequences(seqs), TOK, task, n_examples=6)
    assert res.ood_cap[4].exact == 1.0 and res.ood[4].exact == 0.0
    m = res.metrics()
    assert m["addition/acc_cap_d4"] == 1.0 and m["addition/ood_mean"] == 0.0
    assert m["addition/ood_cap_mean"] == pytest.approx((1.0 + res.ood_cap[5].exact) / 2)
    # the other formats have no capped split
    assert evaluate_addition(LookupLM.from_sequences(seqs), TOK, AdditionTask(train_widths=(1, 3), ood_widths=(4, 5),
                             val_per_width=2), n_examples=2).ood_cap == {}


def test_addition_view_is_shared_once_and_lists_the_table_columns(store):
    # the addition experiment's shared runs view: the best step's ID / OOD columns (capped ones for the
    # variable format), best capped OOD first; written once, a view edited in the UI is kept
    import json

    import mlflow

    from falcon_lab.evaluation.addition import ADDITION_VIEW_KEY, addition_view_state
    from falcon_lab.training.mlflow import SHARED_VIEW_PREFIX, share_view, view_url
    c = mlflow.MlflowClient(store)
    eid = c.create_experiment("addition_x")
    state = addition_view_state("variable")
    assert "metrics.`addition/best/ood_cap_mean`" in state["selectedColumns"]
    assert state["orderByKey"] == "metrics.`addition/best/ood_cap_mean`" and state["orderByAsc"] is False
    assert "metrics.`addition/best/ood_cap_mean`" not in addition_view_state("paper")["selectedColumns"]
    assert share_view(c, eid, ADDITION_VIEW_KEY, state) is True
    c.set_experiment_tag(eid, SHARED_VIEW_PREFIX + ADDITION_VIEW_KEY, json.dumps({"edited": True}))
    assert share_view(c, eid, ADDITION_VIEW_KEY, state) is False
    assert json.loads(c.get_experiment(eid).tags[SHARED_VIEW_PREFIX + ADDITION_VIEW_KEY]) == {"edited": True}
    assert view_url(store, eid, view=ADDITION_VIEW_KEY).endswith(
        f"runs?workflowType=machine_learning&viewStateShareKey={ADDITION_VIEW_KEY}")
