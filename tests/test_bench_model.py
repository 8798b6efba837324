"""CPU smoke of `python -m falcon_lab.bench model` (whole-model throughput / decode benchmark).
No timing assertions: only that every expected measurement exists, is positive and is labelled."""
import json

import pytest

from falcon_lab.bench import main as bench_main


def _run(tmp_path, *extra):
    out = tmp_path / "res"
    bench_main(["model", "--size", "tiny", "--device", "cpu", "--quick", "--mixers", "falcon-3A,transformer",
                "--seq-lens", "64", "--tokens-per-step", "128", "--contexts", "64,128", "--batches", "1,2",
                "--threads", "1", "--out", str(out), *extra])
    return out, json.loads((out / "model_cpu.json").read_text())


def test_bench_model_cpu_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    out, res = _run(tmp_path, "--mlflow", "--cuda-graphs")
    assert res["gpu"] == "cpu" and res["torch"] and res["commit"] and res["size"] == "tiny"
    rows = res["rows"]
    assert not [r for r in rows if r.get("error")], [r for r in rows if r.get("error")]
    for r in rows:
        assert {"mixer", "variant", "preset", "seq_len", "batch", "metric", "value", "unit"} <= set(r)
        assert r["value"] > 0, r
    got = {(r["mixer"], r["metric"], r["seq_len"], r["batch"]) for r in rows}
    for m in ("falcon-3A", "transformer"):
        assert (m, "train_tokens_per_s", 64, 2) in got  # batch = 128 // 64
        for ctx in (64, 128):
            for b in (1, 2):
                for metric in ("prefill_s", "decode_ms_per_token", "decode_tokens_per_s", "state_bytes_per_seq"):
                    assert (m, metric, ctx, b) in got, (m, metric, ctx, b)
    f3a = [r for r in rows if r["mixer"] == "falcon-3A"]
    assert {r["variant"] for r in f3a} == {"Falcon-3A"} and {r["preset"] for r in f3a} == {".3"}
    # state bytes: Falcon's state is constant in the context, the KV cache grows linearly with it
    sb = {(r["mixer"], r["seq_len"]): r for r in rows if r["metric"] == "state_bytes_per_seq" and r["batch"] == 1}
    assert sb[("falcon-3A", 64)]["value"] == sb[("falcon-3A", 128)]["value"]
    assert sb[("transformer", 128)]["value"] == 2 * sb[("transformer", 64)]["value"]
    assert sb[("transformer", 64)]["value"] == 4 * sb[("transformer", 64)]["state_numel_per_seq"]  # fp32 on CPU
    # --cuda-graphs on CPU: eager with the reason recorded
    dec = [r for r in rows if r["metric"] == "decode_ms_per_token"]
    assert all(r["decode_mode"] == "eager" and "CUDA" in r["cuda_graph_fallback"] for r in dec)
    assert (out / "model_cpu.md").read_text().count("| falcon-3A |") >= 3
    assert (out / "model_cpu_train_tokens_per_s.png").stat().st_size > 0
    assert (out / "model_cpu_decode_ms_per_token.png").stat().st_size > 0
    # one MLflow run per mixer, tagged like the training runs
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("falcon_lab")
    runs = client.search_runs([exp.experiment_id], "tags.benchmark = 'model'")
    by = {r.data.tags["mixer"]: r for r in runs}
    assert set(by) == {"falcon", "attention"}
    assert by["falcon"].data.tags["variant"] == "Falcon-3A" and by["falcon"].data.tags["preset"] == ".3"
    assert by["falcon"].data.metrics["bench/train_tokens_per_s/T64_B2"] > 0
    assert by["attention"].data.metrics["bench/decode_ms_per_token/T128_B1"] > 0
    assert all(r.info.status == "FINISHED" for r in runs)


def test_bench_model_unknown_mixer(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["model", "--size", "tiny", "--device", "cpu", "--mixers", "falcon-1,transformerz",
                    "--out", str(tmp_path)])
    assert "transformerz" in str(e.value.code) and "--mixers" in str(e.value.code)
    assert not (tmp_path / "model_cpu.json").exists()


def test_bench_model_fla_not_run_on_cpu(tmp_path):
    out = tmp_path / "res"
    bench_main(["model", "--size", "tiny", "--device", "cpu", "--quick", "--mixers", "fla_deltanet",
                "--seq-lens", "32", "--tokens-per-step", "32", "--contexts", "16", "--batches", "1", "--out", str(out)])
    rows = json.loads((out / "model_cpu.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["metric"] == "not_run" and rows[0]["error"].startswith("not run:")


def test_bench_prefill_matches_decoder_prefill():
    """The benchmark's prefill (LM head on the last position only) gives Decoder.prefill's last logits and
    a state that continues decoding identically."""
    import torch

    from falcon_lab.benchmarking.model import build, prefill

    for name in ("falcon-3", "transformer"):
        model, _ = build(name, "tiny", vocab=97)
        model.eval()
        ids = torch.randint(0, 97, (2, 40))
        with torch.no_grad():
            ref_logits, ref_state = model.prefill(ids)
            last, state = prefill(model, ids)
            torch.testing.assert_close(last, ref_logits[:, -1])
            a, _ = model.step(ids[:, 0], state)
            b, _ = model.step(ids[:, 0], ref_state)
        torch.testing.assert_close(a, b)


def test_bench_model_bad_flag_values(tmp_path):
    with pytest.raises(SystemExit) as e:
        bench_main(["model", "--size", "tiny", "--device", "cpu", "--seq-lens", "64,x", "--out", str(tmp_path)])
    assert "--seq-lens" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        bench_main(["model", "--size", "huge", "--device", "cpu", "--out", str(tmp_path)])
    assert "--size" in str(e.value.code) and "huge" in str(e.value.code)


def test_bench_graph_precondition_on_real_states():
    """--cuda-graphs replays one captured step only if the step keeps the state static: true for a
    Falcon state, false (with the reason) for the growing KV cache."""
    import torch

    from falcon_lab.benchmarking.model import build, prefill
    from falcon_lab.models.graph_step import check_static_step
    from falcon_lab.models.graph_step import state_leaves as _leaves

    for name, ok in (("falcon-3A", True), ("transformer", False)):
        model, _ = build(name, "tiny", vocab=50)
        model.eval()
        with torch.no_grad():
            last, st = prefill(model, torch.randint(0, 50, (2, 12)))
            _, new = model.step(last.argmax(-1), st)
        if ok:
            check_static_step(_leaves(st, []), _leaves(new, []))
        else:
            with pytest.raises(RuntimeError, match="KV cache"):
                check_static_step(_leaves(st, []), _leaves(new, []))


def test_bench_model_runs_accumulate(tmp_path):
    """A run split by --mixers (or re-run after an interruption) ends in one JSON; a mismatching setting
    is refused naming --out; --fresh starts over."""
    out = tmp_path / "res"
    base = ["model", "--size", "tiny", "--device", "cpu", "--quick", "--seq-lens", "32", "--tokens-per-step", "32",
            "--contexts", "16", "--batches", "1", "--decode-steps", "1", "--steps", "1", "--out", str(out)]
    bench_main(base + ["--mixers", "retnet"])
    bench_main(base + ["--mixers", "falcon-1"])
    rows = json.loads((out / "model_cpu.json").read_text())["rows"]
    assert {r["mixer"] for r in rows} == {"retnet", "falcon-1"} and all(r["commit"] for r in rows)
    n = len(rows)
    bench_main(base + ["--mixers", "falcon-1"])  # measured again: replaced, not duplicated
    assert len(json.loads((out / "model_cpu.json").read_text())["rows"]) == n
    with pytest.raises(SystemExit) as e:
        bench_main(base[:-2] + ["--out", str(out), "--mixers", "falcon-1", "--tokens-per-step", "64"])
    assert "--out" in str(e.value.code) and "tokens_per_step" in str(e.value.code)
    bench_main(base + ["--mixers", "falcon-1", "--fresh"])
    assert {r["mixer"] for r in json.loads((out / "model_cpu.json").read_text())["rows"]} == {"falcon-1"}


def test_decode_speedup_table_compares_eager_with_eager():
    """The decode speed-up over the Transformer uses eager rows only; `+graph` rows (a --cuda-graphs run)
    stay in the latency table but not in the eager-vs-eager ratio."""
    from falcon_lab.benchmarking.model import markdown

    def row(m, c, v):
        return {"mixer": m, "variant": None, "preset": None, "seq_len": c, "batch": 16,
                "metric": "decode_ms_per_token", "value": v, "unit": "ms"}
    res = {"gpu": "g", "torch": "t", "triton": "x", "commit": "abc", "size": "small",
           "rows": [row("transformer", 1024, 3.0), row("transformer", 16384, 9.0),
                    row("falcon-1A", 1024, 3.0), row("falcon-1A", 16384, 3.0),
                    row("falcon-1A+graph", 1024, 0.5), row("falcon-1A+graph", 16384, 0.5)]}
    md = markdown(res)
    part = md.split("## Decode speed-up over the Transformer's KV-cache decode (eager vs eager)")[1]
    assert "| falcon-1A | 1.00x | 3.00x |" in part
    assert "falcon-1A+graph" not in part
    assert "| falcon-1A+graph | 0.5 | 0.5 |" in md


def test_merge_results_later_file_wins_per_mixer(tmp_path):
    import json

    from falcon_lab.benchmarking.model import merge_results

    def res(rows, gpu="NVIDIA H200"):
        return {"gpu": gpu, "torch": "t", "triton": "x", "commit": "c", "size": "small", "vocab": 50304,
                "tokens_per_step": 32768, "rows": rows}

    def row(m, v):
        return {"mixer": m, "variant": None, "preset": None, "seq_len": 2048, "batch": 16,
                "metric": "train_tokens_per_s", "value": v, "unit": "tokens/s", "commit": "c"}
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(res([row("falcon-1", 1.0), row("transformer", 2.0)])))
    b.write_text(json.dumps(res([row("falcon-1", 3.0)])))
    out = merge_results([a, b], tmp_path / "out")
    got = {r["mixer"]: r["value"] for r in out["rows"]}
    assert got == {"falcon-1": 3.0, "transformer": 2.0}
    # cell granularity: a file re-measuring one cell keeps the mixer's other cells
    other = dict(row("falcon-1", 9.0), seq_len=8192, batch=4)
    d = tmp_path / "d.json"
    d.write_text(json.dumps(res([other])))
    out = merge_results([a, b, d], tmp_path / "out3")
    got = {(r["mixer"], r["seq_len"]): r["value"] for r in out["rows"]}
    assert got == {("falcon-1", 2048): 3.0, ("falcon-1", 8192): 9.0, ("transformer", 2048): 2.0}
    assert (tmp_path / "out" / "model_h200.json").exists() and (tmp_path / "out" / "model_h200.md").exists()
    c.write_text(json.dumps(res([row("x", 1.0)], gpu="NVIDIA H100")))
    with pytest.raises(ValueError, match="gpu"):
        merge_results([a, c], tmp_path / "out2")


def test_bench_model_chunked_prefill_rows(tmp_path):
    """--prefill-chunk prefills in segments with the state carried; its rows say so. A bad value is named."""
    out, res = _run(tmp_path, "--prefill-chunk", "48", "--seq-lens", "")
    pre = [r for r in res["rows"] if r["metric"] == "prefill_s"]
    assert pre and all(r["prefill_chunk"] == 48 and r["value"] > 0 for r in pre)
    assert not [r for r in res["rows"] if r.get("error")]
    with pytest.raises(SystemExit) as e:
        _run(tmp_path, "--prefill-chunk", "0")
    assert "--prefill-chunk" in str(e.value.code)


def test_bench_model_compile_builds_compiled_blocks_and_labels_rows():
    from falcon_lab.benchmarking.model import _label, build
    model, cfg = build("falcon-1A", "tiny", vocab=64, extra=("model.compile=true",))
    assert cfg.model.compile is True
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model.blocks)
    assert _label("falcon-1A", False, True) == "falcon-1A+compile"
    assert _label("falcon-1A", True, True) == "falcon-1A+compile+graph"


def test_decode_speedup_graph_vs_graph_when_the_transformer_was_captured():
    from falcon_lab.benchmarking.model import markdown

    def row(m, v):
        return {"mixer": m, "variant": None, "preset": None, "seq_len": 1024, "batch": 16,
                "metric": "decode_ms_per_token", "value": v, "unit": "ms"}
    res = {"gpu": "g", "torch": "t", "triton": "x", "commit": "abc", "size": "small",
           "rows": [row("transformer", 8.0), row("transformer+statickv+graph", 2.0), row("falcon-1", 4.0),
                    row("falcon-1+graph", 0.5)]}
    md = markdown(res)
    g = md.split("(CUDA graph vs CUDA graph)")[1]
    assert "| falcon-1+graph | 4.00x |" in g and "| falcon-1 |" not in g.split("##")[0]
    e = md.split("(eager vs eager)")[1].split("##")[0]
    assert "| falcon-1 | 2.00x |" in e and "+graph" not in e


def test_bench_model_static_kv_rows(tmp_path):
    out = tmp_path / "res"
    bench_main(["model", "--size", "tiny", "--device", "cpu", "--quick", "--mixers", "transformer,falcon-1A",
                "--seq-lens", "", "--contexts", "32", "--batches", "2", "--static-kv", "--out", str(out)])
    res = json.loads((out / "model_cpu.json").read_text())
    mixers = {r["mixer"] for r in res["rows"]}
    assert mixers == {"transformer+statickv", "falcon-1A"} and not [r for r in res["rows"] if r.get("error")]


def test_cpu_run_defaults_to_a_cpu_sized_step(tmp_path, capsys):
    """Without --tokens-per-step a CPU run takes 2048 tokens per step and says so (the GPU protocol's
    32768 tokens x 50304 logits alone is 6.6 GB on the host); batch = 2048 // seq_len."""
    out = tmp_path / "res"
    bench_main(["model", "--size", "tiny", "--device", "cpu", "--quick", "--mixers", "retnet", "--seq-lens", "256",
                "--contexts", "", "--vocab", "256", "--threads", "1", "--out", str(out)])
    res = json.loads((out / "model_cpu.json").read_text())
    assert res["tokens_per_step"] == 2048
    assert {(r["metric"], r["batch"]) for r in res["rows"]} >= {("train_tokens_per_s", 8)}
    assert "CPU: 2048 tokens per step" in capsys.readouterr().out


def test_profile_attribution_and_top_kernel_lines():
    """The profile's categories by kernel name, and the log lines of the top kernels."""
    from falcon_lab.benchmarking.profile import classify, top_kernels_lines

    known = {"falcon_op": {"chunk_fwd_kernel"}, "modules": {"norm_fwd"}}
    assert classify("chunk_fwd_kernel", known) == "falcon_op"
    assert classify("norm_fwd", known) == "modules"
    assert classify("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", known) == "matmul"
    assert classify("triton_poi_fused_add_mul_0", known) == "other"
    prof = {"total_ms": 10.0, "top_kernels": [{"name": "a", "category": "loss", "ms": 4.0, "calls": 4},
                                              {"name": "b", "category": "other", "ms": 1.0, "calls": 2}]}
    lines = top_kernels_lines(prof)
    assert len(lines) == 2 and "40.0 %" in lines[0] and "[loss] a" in lines[0] and "x2" in lines[1]
