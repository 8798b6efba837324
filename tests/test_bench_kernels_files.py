"""`python -m falcon_lab.bench kernels`: only a full default run (every op, every shape) writes
kernels_h200.{json,md,png}; a partial run (--ops, --quick) writes kernels_h200_partial.* instead."""
from falcon_lab.benchmarking.kernels import OPS, SHAPES, result_stem


def test_only_a_full_run_owns_the_result_file():
    assert result_stem(OPS, SHAPES) == "kernels_h200"
    assert result_stem(list(reversed(OPS)), SHAPES) == "kernels_h200"  # order of --ops does not matter
    assert result_stem(["falcon-1", "falcon-2"], SHAPES) == "kernels_h200_partial"
    assert result_stem(OPS, SHAPES[:1]) == "kernels_h200_partial"  # --quick
