"""experiments/ablation/report.py: the study's tables and verdicts come from the committed MLflow store."""
import sqlite3

import pytest

from script_helpers import ROOT, load_script

DB = ROOT / "ablations" / "mlflow" / "mlflow.db"


def _report():
    return load_script("experiments/ablation/report.py", "ablation_report")


def test_paired_t_and_holm_match_scipy():
    from scipy import stats

    rep = _report()
    a, b = [0.91, 0.905, 0.918], [0.9012, 0.9051, 0.9121]
    m, sd, t, p = rep.t_test([x - y for x, y in zip(a, b)])
    ref = stats.ttest_rel(a, b)
    assert t == pytest.approx(ref.statistic) and p == pytest.approx(ref.pvalue)
    adj = rep.holm([0.01, 0.04, None, 0.03])
    assert adj[2] is None  # Holm over three p-values: 3 x 0.01, max(2 x 0.03, 0.03), max(1 x 0.04, 0.06)
    assert adj[0] == pytest.approx(0.03) and adj[3] == pytest.approx(0.06) and adj[1] == pytest.approx(0.06)


def test_report_from_the_committed_store(tmp_path):
    """Every arm's mean is the mean of its runs' best val/loss read straight from the store; the reference row
    and the paired differences are there; the hand-written head is kept and only the generated part rewritten."""
    rep = _report()
    (tmp_path / "REPORT.md").write_text("# kept by hand\n\n" + rep.MARKER + "\nold generated text\n")
    rep.main(["--db", str(DB), "--out", str(tmp_path)])
    text = (tmp_path / "REPORT.md").read_text()
    assert text.startswith("# kept by hand") and "old generated text" not in text
    assert "(reference)" in text and "Verdict (computed from the table)" in text
    heads = [line for line in text.splitlines() if line.startswith("## Q")]
    assert [h.split(".")[0] for h in heads] == ["## Q1 + Q6", "## Q2", "## Q3", "## Q4", "## Q5"]  # one per question
    assert text.count("\n### Language modelling") == 5
    assert (tmp_path / "reports" / "objective" / "arms.png").stat().st_size > 1000
    assert (tmp_path / "reports" / "replicates" / "curves.png").stat().st_size > 1000  # sets that disagree
    # independent read of one arm: Falcon-1A.3's best val/loss per seed, straight from SQLite
    con = sqlite3.connect(f"file:{DB}?mode=ro", uri=True)
    ids = [r for (r,) in con.execute(
        "SELECT r.run_uuid FROM runs r JOIN experiments e ON r.experiment_id=e.experiment_id JOIN tags t "
        "ON t.run_uuid=r.run_uuid WHERE e.name='ablate_objective' AND t.key='arm' AND t.value='variant=1A' "
        "AND r.status='FINISHED'")]
    best = [con.execute("SELECT MIN(value) FROM metrics WHERE run_uuid=? AND key='val/loss'", (i,)).fetchone()[0]
            for i in ids]
    assert len(best) == 3
    row = next(line for line in text.splitlines() if line.startswith("| variant=1A |"))
    assert f"{sum(best) / 3:.4f} ±" in row


def test_mqar_contrasts_pair_each_row_with_its_own_reference():
    """MQAR tables: a preset row is paired with the same variant at the slow start (the start's effect), a
    baseline and the other slow-start rows with Falcon-1A at the slow start, the one-knob arms with Falcon-1's."""
    refs = _report().mqar_refs(128)
    slow = lambda v: f"variant={v},d=128,lam_init_bias=-6,output_gate=false"  # noqa: E731
    assert refs["variant=3A,d=128"] == slow("3A")
    assert refs["mixer=deltanet,d=128"] == refs[slow("2A")] == slow("1A")
    assert refs["variant=1,d=128,lam_init_bias=-6"] == slow("1")
    assert slow("1A") not in refs  # the reference itself


def test_mqar_companion_of_a_question_keeps_its_contrasts_at_one_width():
    rep = _report()
    win = next(q for q in rep.QUESTIONS if q["key"] == "window_mqar_d256")
    sfx = ",d=256," + rep.SLOW
    assert win["experiments"] == ["ablate_window_mqar"] and win["arm_filter"] == ",d=256,"
    assert win["ref"]["variant=3A,window=8" + sfx] == "variant=3A,window=1" + sfx
    assert next(q for q in rep.QUESTIONS if q["key"] == "eta_mqar_d128")["ref"] == "gate=ctx_beta,d=128," + rep.SLOW


def test_replicates_group_identical_runs_across_questions():
    """A replicate set holds runs of different experiments whose parameters (all but names, paths and logging)
    are identical, seed included; its spread is max - min of their MQAR accuracy, read from the store."""
    rep = _report()
    sets = rep.replicates(DB)
    assert sets, "the committed store has runs repeated across questions (e.g. Falcon-1A.3 in Q1, Q3 and Q5)"
    con = sqlite3.connect(f"file:{DB}?mode=ro", uri=True)
    for s in sets:
        assert len({r["exp"] for r in s["reps"]}) >= 2 and len({r["seed"] for r in s["reps"]}) == 1
        vals = [r["value"] for r in s["reps"]]
        assert s["spread"] == pytest.approx(max(vals) - min(vals))
    # independently: Falcon-1A at the slow start, d = 256, seed 0 ran as Q1's, Q3's and Q5's cell
    one = [s for s in sets if s["arm"] == "variant=1A,d=256,lam_init_bias=-6,output_gate=false" and s["seed"] == "0"]
    assert len(one) == 1 and {r["exp"] for r in one[0]["reps"]} >= {"objective", "qk_norm", "alignment"}
    ids = [i for (i,) in con.execute(
        "SELECT r.run_uuid FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid WHERE r.status = 'FINISHED' "
        "AND t.key = 'mlflow.runName' AND t.value IN ('objmqs_d256_v1A_s0', 'qkmqs_rmsnorm_scaled_s0')")]
    params = [sorted((k, v) for k, v in con.execute("SELECT key, value FROM params WHERE run_uuid = ?", (i,))
                     if not any(x in k for x in rep._RUN_KEYS)) for i in ids]
    assert len(params) == 2 and params[0] == params[1]
    assert rep.replicate_table(sets).count("\n") == len(sets) + 1


def test_escape_rates_pool_a_configuration_over_seeds_and_blocks():
    """The share of runs at or above the threshold, per configuration, and Fisher's test on the pooled counts."""
    from scipy.stats import fisher_exact

    rep = _report()
    mk = lambda label, arm, seed, vals: dict(label=label, arm=arm, seed=seed,  # noqa: E731
                                             reps=[dict(value=v) for v in vals])
    sets = [mk("Falcon-1.3", "variant=1,d=128", "0", [0.99, 0.95]), mk("Falcon-1.3", "variant=1,d=128", "1", [0.2, 0.97]),
            mk("Falcon-1A.3", "variant=1A,d=128", "0", [0.01, 0.02, 0.9])]
    rows = rep.escape_rates(sets)
    assert [(r["label"], r["n"], r["escaped"]) for r in rows] == [("Falcon-1.3", 4, 3), ("Falcon-1A.3", 3, 1)]
    line = rep.fisher_line(rows, ("Falcon-1.3",), ("Falcon-1A.3",), "a", "b", 128)
    assert line.startswith("a 3/4 vs b 1/3") and f"p = {fisher_exact([[3, 1], [1, 2]])[1]:.3f}" in line
    assert rep.fisher_line(rows, ("Falcon-1.3",), ("Falcon-1A.3",), "a", "b", 256) is None  # no runs at that width
    assert rep.escape_table(rows).count("\n") == len(rows) + 1
