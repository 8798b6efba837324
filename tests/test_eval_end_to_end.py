"""A tiny model trained on CPU, then evaluated end to end by the evaluate driver, its numbers in
MLflow on the training run; compare gathers the experiment into a table. One training run shared
by the module (CI budget)."""
import json
import math
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    old_cwd, old_env = os.getcwd(), {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "HF_HOME")}
    os.chdir(tmp)
    uri = f"sqlite:///{tmp / 'mlruns' / 'mlflow.db'}"
    (tmp / "mlruns").mkdir()
    os.environ["MLFLOW_TRACKING_URI"] = uri
    os.environ["HF_HOME"] = str(tmp / "hf")
    from falcon_lab.training import compose, run
    cfg = compose(["trainer.max_steps=12", "trainer.val_check_interval=6", "trainer.limit_val_batches=2",
                   "trainer.log_every_n_steps=2", "trainer.enable_progress_bar=false", "data.seq_len=64",
                   "data.batch_size=8", "checks.n_sentences=4", "logger.experiment_name=e2e_eval",
                   f"run_dir={tmp / 'run'}"])
    res = run(cfg)
    yield tmp, uri, res
    os.chdir(old_cwd)
    for k, v in old_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_evaluate_end_to_end_logs_to_training_run(trained):
    from mlflow.tracking import MlflowClient

    from falcon_lab.evaluation.perplexity import load_texts, rolling_pairs
    from falcon_lab.evaluation.runner import compose_eval, evaluate
    from falcon_lab.training import load_checkpoint
    tmp, uri, res = trained
    ckpt = res["last_ckpt_path"]
    ecfg = compose_eval([f"ckpt={ckpt}", "suites=[ppl,lm_eval,addition,mqar,passkey]", "device=cpu", "fit_check=false",
                         "ppl.max_docs=3", "ppl.max_chars=3000", "ppl.extrapolation.n_windows=2",
                         "addition.n_examples=3", "addition.widths=[33,48]", "addition.val_widths=[1,3]",
                         "+addition.task.val_per_width=3", "mqar.grid=[[2,16]]", "mqar.n_examples=4",
                         "passkey.context_lens=[130,200]", "passkey.depths=[0.5]", "passkey.per_cell=1",
                         "lm_eval.limit=4"])
    out = evaluate(ecfg)
    assert out["run_id"] == res["run_id"]  # found the training run through its run_dir tag
    m = out["metrics"]
    for k in ("ppl/corpus/ppl", "ppl/corpus/bits_per_byte", "lm_eval/local/mean_0shot", "addition/ood_mean",
              "addition/acc_d33", "addition/acc_d48", "mqar/acc_mean", "mqar/state_numel", "passkey/acc_mean",
              "extrap/corpus_x4/loss_beyond_train_len"):
        assert k in m, k
    # the corpus perplexity equals a direct recomputation with the loaded model
    model, tok, cfg = load_checkpoint(ckpt)
    docs = load_texts("corpus", max_docs=3, max_chars=3000, data_cfg=cfg.data)
    nll, n = 0.0, 0
    with torch.no_grad():
        for d in docs:
            for ctx, cont in rolling_pairs(tok.encode(d), tok.bos_id, 64):
                inp = torch.tensor([(ctx + cont)[:-1]])
                lp = torch.log_softmax(model(inp).double(), -1)[0, -len(cont):]
                nll -= float(lp.gather(-1, torch.tensor(cont)[:, None]).sum())
                n += len(cont)
    assert m["ppl/corpus/ppl"] == pytest.approx(math.exp(nll / n), rel=1e-4)
    assert 1.0 < m["ppl/corpus/ppl"] < 300.0
    # in MLflow, on the training run, with artifacts
    client = MlflowClient(uri)
    run = client.get_run(res["run_id"])
    assert run.data.metrics["ppl/corpus/ppl"] == pytest.approx(m["ppl/corpus/ppl"])
    assert run.data.metrics["mqar/state_numel"] > 0
    arts = {a.path for a in client.list_artifacts(res["run_id"], "eval")}
    assert {"eval/ppl.json", "eval/ppl_summary.png", "eval/addition_accuracy_vs_width.png", "eval/passkey_heatmap.png",
            "eval/mqar_accuracy.png", "eval/lm_eval_local.png"} <= arts
    assert {f"eval/{s}.json" for s in ("ppl", "lm_eval", "addition", "mqar", "passkey")} <= arts
    hist = client.get_metric_history(res["run_id"], "extrap/corpus_x4/loss_at_position")
    assert len(hist) > 8 and max(h.step for h in hist) == 256
    summary = json.loads((Path(out["out_dir"]) / "summary.json").read_text())
    assert summary["metrics"]["addition/ood_mean"] == m["addition/ood_mean"]


def test_evaluate_rejects_bad_config(trained):
    from falcon_lab.evaluation.runner import EvalConfigError, compose_eval, evaluate
    tmp, uri, res = trained
    with pytest.raises(EvalConfigError, match="ckpt"):
        evaluate(compose_eval([]))
    with pytest.raises(EvalConfigError, match="suites"):
        evaluate(compose_eval([f"ckpt={res['last_ckpt_path']}", "suites=[ppl,bogus]"]))
    # a text checkpoint: the synthetic-task suites are refused up front, naming why
    with pytest.raises(EvalConfigError, match=r"(?s)addition: the checkpoint was trained on data.name='lm'.*fit_check"):
        evaluate(compose_eval([f"ckpt={res['last_ckpt_path']}", "suites=[ppl,addition]", "device=cpu"]))


def test_compare_gathers_experiment(trained):
    from falcon_lab.compare import compare
    from falcon_lab.evaluation.runner import compose_eval, evaluate
    tmp, uri, res = trained
    evaluate(compose_eval([f"ckpt={res['last_ckpt_path']}", "suites=[mqar,addition]", "fit_check=false", "mqar.grid=[[2,16]]",
                           "mqar.n_examples=2", "addition.n_examples=2", "addition.widths=[33]",
                           "addition.val_widths=[2]", "addition.free_running=false", "device=cpu"]))
    from falcon_lab.sweeps.tracking import open_parent
    parent = open_parent(uri, "e2e_eval", "a_study", None, {"n_trials": 3})  # a sweep in the experiment
    out = compare(experiment_name="e2e_eval", tracking_uri=uri, out_dir=str(tmp / "cmp"))
    md = Path(out["markdown"]).read_text()
    assert res["run_id"][:8] in md
    # the sweep's parent run is named above the table, not a row of empty cells
    assert parent not in {r["run_id"] for r in out["rows"]}
    assert f"Sweep parent runs (their trials are the rows): sweep-a_study ({parent[:8]})" in md
    assert {"val loss (best)", "val ppl (best)", "tokens/s", "mqar/acc_mean"} <= set(out["columns"])
    row = next(r for r in out["rows"] if r["run_id"] == res["run_id"])
    vals = dict(zip(out["columns"], row["vals"]))
    assert vals["tokens/s"] > 0 and vals["val ppl (best)"] == pytest.approx(math.exp(vals["val loss (best)"]))
    assert row["state"] and row["params"]
    assert all(Path(p).is_file() for p in out["plots"])
    assert {"compare_addition_vs_width.png", "compare_mqar_vs_state.png"} <= {Path(p).name for p in out["plots"]}
    with pytest.raises(ValueError, match="experiment"):
        compare(experiment_name="no_such_experiment", tracking_uri=uri, out_dir=str(tmp / "cmp2"))


def test_addition_callback_logs_best_step(trained):
    """experiment=addition: training.run attaches the AdditionEvalCallback from the config; accuracy
    is logged at each eval step and the best step (by ID validation) recorded at the end."""
    from mlflow.tracking import MlflowClient

    from falcon_lab.evaluation.addition import callback_from_cfg
    from falcon_lab.training import compose, run
    tmp, uri, _ = trained
    cfg = compose(["experiment=addition", "trainer.max_steps=4", "trainer.val_check_interval=2",
                   "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false", "data.batch_size=4",
                   "data.val_per_width=2", "addition_eval.every_n_steps=2", "addition_eval.n_examples=2",
                   "+addition_eval.ood_widths=[33,48]", "+addition_eval.val_widths=[1,2,3]",
                   f"run_dir={tmp / 'add_run'}", "logger.experiment_name=e2e_addition"])
    res = run(cfg)  # no explicit callbacks: the addition_eval node is enough
    client = MlflowClient(uri)
    hist = client.get_metric_history(res["run_id"], "addition/val_acc")
    assert sorted(h.step for h in hist) == [2, 4]
    r = client.get_run(res["run_id"])
    assert r.data.metrics["addition/best_step"] in (2.0, 4.0)
    assert {"addition/acc_d33", "addition/acc_d48", "addition/ood_mean"} <= set(r.data.metrics)
    assert "addition_history.json" in {a.path for a in client.list_artifacts(res["run_id"])}
    assert callback_from_cfg(compose([])) is None  # not an addition run: no callback
    # the accuracy history rides in the checkpoint, so a resumed run keeps its best step
    ck = torch.load(res["last_ckpt_path"], map_location="cpu", weights_only=False)
    states = [v for k, v in ck["callbacks"].items() if "AdditionEvalCallback" in k]
    assert states and [h["step"] for h in states[0]["history"]] == [2, 4]
    # per-width accuracies ride along for the per-width plot; the file on disk matches the checkpoint
    assert set(states[0]["history"][-1]["ood_by_width"]) == {"33", "48"}
    assert set(states[0]["history"][-1]["val_by_width"]) == {"1", "2", "3"}
    on_disk = json.loads((tmp / "add_run" / "addition_history.json").read_text())
    assert [h["step"] for h in on_disk["history"]] == [2, 4]
    fresh = callback_from_cfg(cfg)
    fresh.load_state_dict(states[0])
    assert fresh.best["step"] == r.data.metrics["addition/best_step"]
    assert fresh.best["addition/val_acc"] == pytest.approx(r.data.metrics["addition/best/val_acc"])


def test_lm_eval_by_registered_name_with_checkpoint(trained, tmp_path):
    """lm_eval.simple_evaluate(model="falcon_lab", model_args="checkpoint=PATH") on a local task
    equals the same adapter wrapped around the loaded model."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import falcon_lab.evaluation  # noqa: F401  (registers "falcon_lab")
    from falcon_lab.evaluation.downstream import localize_tasks, run_suite
    from falcon_lab.evaluation.lm_eval_adapter import FalconLabLM
    from falcon_lab.training import load_checkpoint
    _, _, res = trained
    inc = localize_tasks([Path(__file__).resolve().parents[1] / "evaluation" / "tasks"], str(tmp_path))
    out = lm_eval.simple_evaluate(model="falcon_lab", model_args=f"checkpoint={res['last_ckpt_path']},batch_size=4",
                                  tasks=["falcon_local_mc"], device="cpu",
                                  task_manager=TaskManager(include_path=inc, include_defaults=False))
    by_name = out["results"]["falcon_local_mc"]["acc,none"]
    model, tok, cfg = load_checkpoint(res["last_ckpt_path"])
    direct = run_suite(FalconLabLM(model=model, tokenizer=tok, max_length=int(cfg.data.seq_len)), "local")
    assert by_name == pytest.approx(direct.scores[0]["falcon_local_mc"])


@pytest.mark.parametrize("mixer", [["mixer=falcon"], ["mixer=falcon", "mixer.variant=3A"], ["mixer=attention"]])
def test_real_decoder_recurrent_decode_equals_full_forward(mixer):
    """Lock-step batched decoding (prefill + step with per-row prompt lengths) of the platform's own
    decoder equals greedy decoding by re-running the full forward."""
    from falcon_lab.evaluation.common import greedy_generate
    from falcon_lab.models import build_model
    from falcon_lab.training import compose
    cfg = compose(mixer)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.mixer, 259).eval()
    with torch.no_grad():  # sharpen the logits so ties cannot decide the comparison
        model.embed.weight.mul_(8.0)
    prompts = [[256] + list(range(40, 40 + n)) for n in (3, 9, 1, 14, 6)]
    rec = greedy_generate(model, prompts, max_new_tokens=10, batch_size=5, use_recurrent=True)
    full = greedy_generate(model, prompts, max_new_tokens=10, batch_size=5, use_recurrent=False)
    assert rec == full


def test_addition_experiment_rows_compose():
    """Every Table 3 row at every scale of experiments/addition/run_addition.py composes and passes
    the training config validation (no compute)."""
    from falcon_lab.training import compose
    from falcon_lab.training.validate import validate_config
    from script_helpers import load_script

    mod = load_script("experiments/addition/run_addition.py")
    for row, ov in mod.ROWS.items():
        for scale, sov in mod.SCALES.items():
            cfg = compose(["experiment=addition"] + ov + sov)
            validate_config(cfg)
            assert cfg.data.name == "addition" and cfg.addition_eval.every_n_steps >= 1
    cfg = compose(["experiment=addition"] + mod.ROWS["falcon_3a_3"])
    assert cfg.mixer.variant == "3A" and cfg.mixer.preset == ".3"


def test_evaluate_finds_run_by_run_dir_or_creates_one(trained, tmp_path):
    """Without the run id recorded in the checkpoint, the run is found through its run_dir tag; a
    checkpoint outside any run dir gets a new run tagged with its path."""
    from mlflow.tracking import MlflowClient

    from falcon_lab.evaluation.runner import compose_eval, evaluate
    tmp, uri, res = trained
    ck = torch.load(res["last_ckpt_path"], map_location="cpu", weights_only=False)
    ck.pop("falcon_lab", None)
    bare = Path(res["last_ckpt_path"]).parent / "bare.ckpt"
    torch.save(ck, bare)
    small = ["suites=[mqar]", "fit_check=false", "mqar.grid=[[2,16]]", "mqar.n_examples=2", "device=cpu"]
    out = evaluate(compose_eval([f"ckpt={bare}"] + small))
    assert out["run_id"] == res["run_id"]
    elsewhere = tmp_path / "moved.ckpt"
    torch.save(ck, elsewhere)
    out = evaluate(compose_eval([f"ckpt={elsewhere}", "mlflow.experiment_name=e2e_eval_moved"] + small))
    assert out["run_id"] != res["run_id"]
    run = MlflowClient(uri).get_run(out["run_id"])
    assert run.data.tags["eval.source_ckpt"] == str(elsewhere.resolve())
    assert run.data.tags.get("mixer") == "falcon" and run.info.status == "FINISHED"
    assert "mqar/acc_mean" in run.data.metrics


def test_addition_report_table_marks_incomplete_rows_and_plots(tmp_path):
    """experiments/addition/report.py: seeds aggregated (mean, range), incomplete runs starred with
    their last step, per-width plot from the best step's ood_by_width."""
    import json

    from script_helpers import load_script

    mod = load_script("experiments/addition/report.py", "addition_report")
    d = tmp_path / "h200"
    d.mkdir()

    def row(name, seed, ood, complete, last):
        hist = [{"step": 100, "addition/val_acc": 0.9, "ood_by_width": {"33": ood, "34": ood / 2}}]
        return {"row": name, "seed": seed, "format": "paper", "ood_widths": [33, 48], "best_step": 100,
                "val_acc": 0.9, "ood_mean": ood, "acc_first_ood": ood, "acc_last_ood": 0.0,
                "complete": complete, "last_eval_step": last, "history": hist}
    (d / "falcon_1a_3_seed0.json").write_text(json.dumps(row("falcon_1a_3", 0, 0.5, True, 2000)))
    (d / "falcon_1a_3_seed1.json").write_text(json.dumps(row("falcon_1a_3", 1, 0.7, False, 900)))
    assert mod.main(["--scale", "h200", "--results", str(tmp_path)]) == 0
    md = (d / "table.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("| Falcon-1A.3"))
    assert "0, 1*" in line and "60.0 (50.0–70.0)" in line and "stopped at step 900" in line
    assert "85.9 / 100.0 / 69.0" in line
    assert "capped" not in md  # the text format has no capped split
    assert (d / "per_width.png").stat().st_size > 0
    # the variable format's capped split gets its own columns, seeds aggregated the same way
    v = tmp_path / "h200-var"
    v.mkdir()
    for seed, cap in ((0, 0.4), (1, 0.6)):
        r = row("transformer", seed, 0.0, True, 1200)
        r.update(format="variable", ood_cap_mean=cap, acc_cap_first=cap + 0.2, acc_cap_last=cap - 0.2)
        r["history"][0]["ood_cap_by_width"] = {"33": cap, "34": cap}
        (v / f"transformer_seed{seed}.json").write_text(json.dumps(r))
    assert mod.main(["--scale", "h200-var", "--results", str(tmp_path)]) == 0
    md = (v / "table.md").read_text()
    assert "capped: mean 33–48" in md
    line = next(x for x in md.splitlines() if x.startswith("| Transformer"))
    assert "50.0 (40.0–60.0) | 70.0 (60.0–80.0) | 30.0 (20.0–40.0)" in line
    assert (v / "per_width.png").stat().st_size > 0


def test_load_checkpoint_drops_training_time_knobs(trained, tmp_path):
    """A checkpoint trained with model.compile / activation checkpointing loads as the plain model."""
    from falcon_lab.training import load_checkpoint
    _, _, res = trained
    ck = torch.load(res["last_ckpt_path"], map_location="cpu", weights_only=False)
    ck["hyper_parameters"]["cfg"]["model"].update({"compile": True, "activation_checkpointing": True})
    p = tmp_path / "knobs.ckpt"
    torch.save(ck, p)
    model, _, cfg = load_checkpoint(str(p))
    assert cfg.model.compile is True  # the recorded config is kept as trained
    assert not model.activation_checkpointing
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in model.blocks)
