"""A source rule for the Triton kernels (issue 15): no `tl.sum(A[.., None, ..] * B[.., None, ..], axis)` whose two
factors are both broadcasts. Triton's combiner (the Combine pass, before any precision choice of ours) rewrites that
shape, a matrix product written as a broadcast, into a `tt.dot` at its default tf32 precision, so fp32 operands lose
13 bits on the GPU while the interpreter, which runs no such pass, computes it exactly. On the H200 (2026-12-02) a 0/1
selection written that way in `_pc_bwd_rows` put the blocked Falcon-2A's fp32 dq and dk 3.8e-4 off, with every
interpreter test passing (benchmarks/results/h200_logs/kernels_2026-12-02f/). Write such products as `tl.dot` with an
explicit input_precision, or as selections/stores that are not a product."""
import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "falcon_lab" / "kernels" / "triton"


def _is_broadcast(node) -> bool:
    if not isinstance(node, ast.Subscript):
        return False
    sl = node.slice
    elts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
    return any(isinstance(e, ast.Constant) and e.value is None for e in elts)


def _products_of_broadcasts(tree):
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "sum"
                and node.args and isinstance(node.args[0], ast.BinOp) and isinstance(node.args[0].op, ast.Mult)
                and _is_broadcast(node.args[0].left) and _is_broadcast(node.args[0].right)):
            yield node.lineno


def test_rule_finds_the_pattern():
    src = "def k(a, b):\n    return tl.sum(tl.where(c, a, 0.)[:, :, None] * b[None, :, :], 1)\n"
    assert list(_products_of_broadcasts(ast.parse(src))) == [2]
    ok = "def k(p, d, v):\n    return tl.sum(p[:, :, None] * d * v[None, :, :], 1) + tl.sum(p[:, None] * d, 0)\n"
    assert list(_products_of_broadcasts(ast.parse(ok))) == []


def test_no_kernel_sums_a_product_of_two_broadcasts():
    files = sorted(KERNELS.glob("*.py"))
    assert files
    found = [f"{f.name}:{line}" for f in files for line in _products_of_broadcasts(ast.parse(f.read_text()))]
    assert not found, f"a sum of a product of two broadcasts (becomes a tf32 tt.dot on the GPU): {found}"
