"""The lm-eval adapter, offline, on the shipped local tasks: its numbers equal a direct computation
of the same log-likelihoods; generate_until stops at stop strings; import hygiene."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "evaluation" / "tasks"


@pytest.fixture(scope="module")
def offline_hf(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf_home")
    with pytest.MonkeyPatch.context() as mp:  # the variables are put back afterwards
        mp.setenv("HF_HOME", str(home))
        mp.setenv("HF_DATASETS_CACHE", str(home / "datasets"))
        yield


@pytest.fixture(scope="module")
def lm_and_model():
    from falcon_lab.evaluation import FalconLabLM
    from falcon_lab.evaluation.toy import PrefixSumLM, ToyByteTokenizer
    torch.manual_seed(5)
    model = PrefixSumLM(torch.randn(259, 259))
    tok = ToyByteTokenizer()
    # carry_state=False: the windowed (attention) path; the recurrent path is tests/test_eval_fit.py
    return FalconLabLM(model=model, tokenizer=tok, batch_size=3, max_length=48, carry_state=False), model, tok


def direct_logprob(model, ids_ctx, ids_cont, max_length=48):
    """PrefixSumLM's log-prob of the continuation when the model input is the last max_length
    tokens before the final one (the adapter's left truncation)."""
    seq = ids_ctx + ids_cont
    first = max(0, len(seq) - 1 - max_length)  # first token the model sees
    lp = 0.0
    for t in range(len(ids_ctx), len(seq)):
        lp += float(torch.log_softmax(model.table[sum(seq[first:t]) % 259].double(), -1)[seq[t]])
    return lp


def test_import_falcon_lab_does_not_import_lm_eval():
    code = "import sys, falcon_lab, falcon_lab.data.tasks; assert 'lm_eval' not in sys.modules, 'lm_eval imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    code = ("import falcon_lab.evaluation, lm_eval.api.registry as r; "
            "assert r.get_model('falcon_lab').__name__ == 'FalconLabLM'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_local_multiple_choice_matches_direct(offline_hf, lm_and_model):
    from falcon_lab.evaluation.downstream import run_suite
    lm, model, tok = lm_and_model
    res = run_suite(lm, {"name": "t", "include_path": str(TASKS), "include_defaults": False,
                         "num_fewshot": [0], "tasks": {"falcon_local_mc": "acc"}})
    assert not res.missing
    docs = [json.loads(x) for x in (TASKS / "local_mc/data/test.jsonl").read_text().splitlines()]
    correct = 0
    for d in docs:
        ctx = f"Question: {d['question']}\nAnswer:"
        # lm-eval's target delimiter " " goes in front of each choice
        scores = [direct_logprob(model, [tok.bos_id] + tok.encode(ctx), tok.encode(" " + c)) for c in d["choices"]]
        correct += int(max(range(len(scores)), key=lambda i: scores[i]) == d["label"])
    assert res.scores[0]["falcon_local_mc"] == pytest.approx(correct / len(docs))


def test_local_rolling_perplexity_matches_direct(offline_hf, lm_and_model):
    from falcon_lab.evaluation.downstream import run_suite
    lm, model, tok = lm_and_model
    res = run_suite(lm, "local")  # the built-in offline suite (both local tasks)
    assert not res.missing
    docs = [json.loads(x)["text"] for x in (TASKS / "local_rolling/data/test.jsonl").read_text().splitlines()]
    # max_length=48 makes these documents span several windows; PrefixSumLM depends on the window's
    # whole input, so compute what each window sees
    from falcon_lab.evaluation.perplexity import rolling_pairs
    total, words = 0.0, 0
    for d in docs:
        for ctx, cont in rolling_pairs(tok.encode(d), tok.bos_id, 48):
            total += direct_logprob(model, ctx, cont)
        words += len(d.split())
    assert res.scores[0]["falcon_local_rolling"] == pytest.approx(math.exp(-total / words), rel=1e-4)
    assert 0.0 <= res.scores[0]["falcon_local_mc"] <= 1.0
    assert "lm_eval/local/mean_0shot" in res.metrics()


def test_loglikelihood_and_empty_context(lm_and_model):
    from lm_eval.api.instance import Instance
    lm, model, tok = lm_and_model
    reqs = [Instance("loglikelihood", {}, ("Hello", " world"), 0),
            Instance("loglikelihood", {}, ("", "abc"), 1)]
    out = lm.loglikelihood(reqs, disable_tqdm=True)
    assert out[0][0] == pytest.approx(direct_logprob(model, [tok.bos_id] + tok.encode("Hello"), tok.encode(" world")),
                                      rel=1e-5)
    assert out[1][0] == pytest.approx(direct_logprob(model, [tok.bos_id], tok.encode("abc")), rel=1e-5)


def test_generate_until_stops_at_stop_strings():
    from lm_eval.api.instance import Instance

    from falcon_lab.evaluation import FalconLabLM
    from falcon_lab.evaluation.toy import BigramLM, ToyByteTokenizer, cycle_table
    lm = FalconLabLM(model=BigramLM(cycle_table("abcde\n")), tokenizer=ToyByteTokenizer(), batch_size=2)
    reqs = [Instance("generate_until", {}, ("xa", {"until": ["\n"], "max_gen_toks": 50}), 0),
            Instance("generate_until", {}, ("zzzc", {"until": ["e", "\n"], "max_gen_toks": 50}), 1),
            Instance("generate_until", {}, ("b", {"until": ["cd"], "max_gen_toks": 50}), 2),
            Instance("generate_until", {}, ("a", {"until": ["never"], "max_gen_toks": 7}), 3)]
    out = lm.generate_until(reqs, disable_tqdm=True)
    assert out == ["bcde", "d", "", "bcde\nab"]
    with pytest.raises(ValueError, match="greedy"):
        lm.generate_until([Instance("generate_until", {}, ("a", {"until": ["x"], "do_sample": True}), 0)])


def test_adapter_rejects_bad_args():
    from falcon_lab.evaluation import FalconLabLM
    with pytest.raises(ValueError, match="checkpoint"):
        FalconLabLM()
    with pytest.raises(ValueError, match="unknown model_args"):
        FalconLabLM(model=torch.nn.Linear(1, 1), tokenizer=None, bogus=1)


def test_suite_configs_and_means():
    from falcon_lab.evaluation.downstream import DownstreamResult, load_suite
    s = load_suite("paper8")
    assert s["tasks"] == {"piqa": "acc", "hellaswag": "acc_norm", "winogrande": "acc", "arc_easy": "acc",
                          "arc_challenge": "acc_norm", "openbookqa": "acc_norm", "social_iqa": "acc",
                          "sciq": "acc"}
    assert s["num_fewshot"] == [0, 1]
    y = load_suite(str(ROOT / "evaluation" / "suites" / "paper8.yaml"))
    assert y["tasks"] == s["tasks"] and y["num_fewshot"] == s["num_fewshot"]
    loc = load_suite(str(ROOT / "evaluation" / "suites" / "local.yaml"))
    assert Path(loc["include_path"][0]) == TASKS.resolve()
    r = DownstreamResult("x", scores={0: {"a": 0.5, "b": 0.7, "p": 12.0}},
                         metrics_used={"a": "acc", "b": "acc_norm", "p": "word_perplexity"})
    assert r.mean(0) == pytest.approx(0.6)  # perplexities stay out of the mean
    r.scores[0].pop("b")
    assert r.mean(0) is None and r.partial_mean(0) == (0.5, 1)
    assert "lm_eval/x/partial_mean_0shot_1_of_2" in r.metrics()
    with pytest.raises(ValueError, match="suite"):
        load_suite("no_such_suite")


def test_paper8_tasks_exist_in_lm_eval_with_their_metrics():
    """The paper's 8 task names and the metric we read from each are what the installed lm-eval
    defines (catches renames across lm-eval versions; no datasets needed)."""
    from lm_eval.tasks import TaskManager

    from falcon_lab.evaluation.downstream import PAPER8
    tm = TaskManager()
    for task, metric in PAPER8["tasks"].items():
        entry = tm.task_index[task]
        cfg = dict(entry.cfg)
        metrics = {m["metric"] for m in cfg.get("metric_list", [])}
        assert metric in metrics, (task, metric, metrics)
        assert cfg["output_type"] == "multiple_choice"
