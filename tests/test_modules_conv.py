"""falcon_lab.modules.conv: the short causal depthwise convolution.

The torch path is checked against a float64 direct loop (forward and gradients), for varlen leakage
and for its output dtype under bf16 autocast. The Triton kernels run under the interpreter in ONE
subprocess with TRITON_INTERPRET=1 (tests/modules_interp_cases.py; triton reads the variable when
first imported, and other tests of this process may have imported it already); fp32 and fp16 only
(bf16 arithmetic is wrong in the interpreter).
"""

from pathlib import Path

import pytest

from interp_helpers import case_result, run_interp_cases
import torch
import torch.nn.functional as F

from falcon_lab.modules import conv
from falcon_lab.modules.conv import ShortConvolution, short_conv, short_conv_torch

HERE = Path(__file__).resolve().parent
CU = [0, 5, 17, 30]  # three packed sequences (lengths 5, 12, 13), B = 1


def pos_from_cu(cu):
    return torch.cat([torch.arange(cu[i + 1] - cu[i]) for i in range(len(cu) - 1)])


def loop_ref(x, w, cache, pos, act):
    """y[b,t] = act(Σ_j w[:, K-1-j] xp[b, t-j]) term by term, dropping j > pos[t]."""
    B, T, D = x.shape
    K = w.shape[1]
    xp = torch.cat([cache if cache is not None else x.new_zeros(B, K - 1, D), x], 1)
    rows = []
    for t in range(T):
        acc = x.new_zeros(B, D)
        for j in range(K):
            if pos is None or int(pos[t]) >= j:
                acc = acc + w[:, K - 1 - j] * xp[:, K - 1 + t - j]
        rows.append(acc)
    y = torch.stack(rows, 1)
    return (F.silu(y) if act else y), xp[:, T:]


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("act", [True, False])
@pytest.mark.parametrize("with_cache", [False, True])
@pytest.mark.parametrize("with_pos", [False, True])
def test_torch_path_matches_loop(K, act, with_cache, with_pos):
    g = torch.Generator().manual_seed(K * 8 + act * 4 + with_cache * 2 + with_pos)
    B, T, D = (1, 30, 6) if with_pos else (2, 11, 6)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(D, K, generator=g, dtype=torch.float64, requires_grad=True)
    cache = torch.randn(B, K - 1, D, generator=g, dtype=torch.float64, requires_grad=True) if with_cache else None
    pos = pos_from_cu(CU) if with_pos else None
    y, nc = short_conv_torch(x, w, cache, pos, act)
    y_ref, nc_ref = loop_ref(x, w, cache, pos, act)
    assert y.shape == (B, T, D) and nc.shape == (B, K - 1, D)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(nc, nc_ref, rtol=0, atol=0)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    ins = [x, w] + ([cache] if with_cache and K > 1 else [])
    for a, b in zip(torch.autograd.grad((y * dy).sum(), ins), torch.autograd.grad((y_ref * dy).sum(), ins)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # the public API on CPU picks the torch path
    y2, _ = short_conv(x, w, cache, pos, act)
    torch.testing.assert_close(y2, y, rtol=0, atol=0)


@pytest.mark.parametrize("act", [True, False])
def test_varlen_no_leakage(act):
    """With pos, each packed sequence equals the convolution of that sequence alone."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, CU[-1], 5, generator=g, dtype=torch.float64)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    y, _ = short_conv_torch(x, w, pos=pos_from_cu(CU), activation=act)
    for s, e in zip(CU[:-1], CU[1:]):
        alone, _ = short_conv_torch(x[:, s:e], w, activation=act)
        torch.testing.assert_close(y[:, s:e], alone, rtol=0, atol=1e-14)
    x2 = x.clone()
    x2[:, : CU[1]] += 1.0
    y2, _ = short_conv_torch(x2, w, pos=pos_from_cu(CU), activation=act)
    assert torch.equal(y2[:, CU[1]:], y[:, CU[1]:])


def test_continuation_through_cache():
    """Splitting a sequence and carrying new_cache gives the unsplit result (K=4 and T < K-1 chunks)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 12, 5, generator=g, dtype=torch.float64)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    full, nc_full = short_conv(x, w)
    ys, cache = [], None
    for s, e in ((0, 7), (7, 8), (8, 10), (10, 12)):
        y, cache = short_conv(x[:, s:e], w, cache)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, 1), full, rtol=0, atol=1e-14)
    torch.testing.assert_close(cache, nc_full, rtol=0, atol=0)


def test_bf16_autocast_keeps_input_dtype():
    mod = ShortConvolution(8)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(x)
        assert h.dtype == torch.bfloat16
        y, nc = mod(h, cache=torch.zeros(2, 3, 8))
        assert y.dtype == torch.bfloat16 and nc.dtype == torch.bfloat16
        y32, _ = mod(x)
        assert y32.dtype == torch.float32
    assert mod.weight.dtype == torch.float32
    y.float().sum().backward()
    assert mod.weight.grad.dtype == torch.float32


def test_module_parameters():
    """Parameter name/shape and init range as the mixers' former ShortConv had them (checkpoints hold
    `...conv.weight`); its numerics are the float64 loop's, tested above."""
    torch.manual_seed(0)
    new = ShortConvolution(16, 4)
    assert new.size == 4 and new.weight.shape == (16, 4) and list(new.state_dict()) == ["weight"]
    assert 0.3 < new.weight.abs().max() <= 0.5  # uniform ±1/sqrt(4)


def test_argument_errors():
    x, w = torch.randn(1, 4, 3), torch.randn(3, 4)
    with pytest.raises(ValueError):
        short_conv(x, w, backend="cuda")
    with pytest.raises(ValueError):
        short_conv(x, torch.randn(4, 4))
    with pytest.raises(ValueError):
        short_conv(x, torch.randn(3, 9), backend="triton")
    with pytest.raises(ValueError):
        short_conv(x, w, cache=torch.randn(1, 2, 3))
    if not conv._INTERPRET:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            short_conv(x, w, backend="triton")


def test_poison_switch_takes_0_or_1(monkeypatch):
    monkeypatch.setenv("FALCON_TRITON_POISON", "1")
    assert conv._alloc((2, 3), torch.float32, "cpu").isnan().all()
    monkeypatch.setenv("FALCON_TRITON_POISON", "true")  # used to mean "off", silently
    with pytest.raises(ValueError, match="FALCON_TRITON_POISON must be '0' or '1', got 'true'"):
        conv._alloc((2, 3), torch.float32, "cpu")


# ------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter
# ------------------------------------------------------------------------------------------------
def _c(id, **kw):
    base = dict(B=2, T=37, D=48, K=4, act=True, cache=False, cu=None, dtype="float32", seed=1)
    base.update(kw, id=id)
    return base


CASES = [
    _c("K4-silu"),
    _c("K4-linear-cache", act=False, cache=True, seed=2),
    _c("K3-silu-cache-tiles16x32", K=3, cache=True, BT=16, BD=32, seed=3),  # 3 T-tiles x 2 D-tiles
    _c("K3-linear", K=3, act=False, T=70, seed=4),  # 2 T-tiles of 64
    _c("K1-silu", K=1, seed=5),
    _c("K8-silu-cache", K=8, cache=True, T=20, D=20, seed=6),
    _c("varlen-K4-silu", B=1, T=30, cu=CU, seed=7),
    _c("varlen-K4-cache-tiles8x16", B=1, T=30, cu=CU, cache=True, BT=8, BD=16, seed=8),
    _c("decode-T1-K4-cache", T=1, cache=True, seed=9),
    _c("short-T2-K4-cache", T=2, cache=True, seed=10),
    _c("fp16-K4-silu", dtype="float16", seed=11),
    _c("fp16-K3-linear-cache", K=3, act=False, cache=True, dtype="float16", seed=12),
    _c("fp16-varlen-K4", B=1, T=30, cu=CU, dtype="float16", seed=13),
    # y as [3, B, T, D/3] (q, k, v convolved together, three contiguous outputs)
    _c("split3-K4-silu-cache-tiles16x16", D=48, split=3, cache=True, BT=16, BD=16, seed=17),
    _c("split3-varlen-K4", B=1, T=30, cu=CU, D=48, split=3, seed=18),
    _c("split3-bf16-K4", D=96, split=3, dtype="bfloat16", seed=19),
]
EXTRA = [_c("compile-fullgraph", kind="compile", cache=True, seed=14),
         _c("compile-fullgraph-varlen", kind="compile", B=1, T=30, cu=CU, seed=15),
         _c("opcheck", kind="opcheck", B=1, T=30, D=20, cache=True, cu=CU, seed=16)]


@pytest.fixture(scope="module")
def results():
    return run_interp_cases("modules_interp_cases.py", CASES + EXTRA, timeout=300, FALCON_TRITON_POISON="1")


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_triton_kernels_match_float64(results, case):
    res = case_result(results, case["id"])
    assert set(res) >= {"y", "dx", "dw"} | ({"new_cache"} if case["K"] > 1 else set())
    lim = {"float16": 3e-3, "bfloat16": 2e-2}.get(case["dtype"], 1e-5)  # NaN (poisoned, unwritten) gives inf
    for k, e in res.items():
        if k == "split_layout_exact":
            assert e is True, f"{case['id']}: the split layout holds other numbers than the plain one"
        elif k == "leak":
            assert e == 0.0, f"{case['id']}: output of later sequences changed by {e}"
        else:
            assert e <= lim, f"{case['id']}: {k} relative error {e:.3e} > {lim:.0e} ({res})"


@pytest.mark.parametrize("case", EXTRA[:2], ids=[c["id"] for c in EXTRA[:2]])
def test_triton_custom_op_compiles_fullgraph(results, case):
    r = results.get(case["id"])
    assert r is not None and "error" not in r, r
    for k, e in r["res"].items():
        assert e <= 1e-6, f"{case['id']}: compiled vs eager {k} differs by {e:.3e}"


def test_triton_custom_ops_pass_opcheck(results):
    r = results.get("opcheck")
    assert r is not None and "error" not in r, r
    for op, checks in r["res"].items():
        assert checks and all(v == "SUCCESS" for v in checks.values()), (op, checks)
