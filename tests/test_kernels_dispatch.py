"""One encoding of a variant (FalconSpec) and one dispatch decision (dispatch.select), used by the op
and by the mixers' "which backend ran" label; fla's names for the op's three entry points."""
import os

import pytest
import torch

from falcon_lab.kernels import (VARIANTS, FalconSpec, chunk_falcon, fused_recurrent_falcon,
                                naive_recurrent_falcon, recurrent_falcon)
from falcon_lab.kernels.dispatch import select
from falcon_lab.kernels.triton import PROVEN_CHUNK, PROVEN_DECODE, check
from interp_helpers import import_with


def test_spec_table():
    assert {v: tuple(s) for v, s in VARIANTS.items()} == {
        "1": (True, False, False), "2": (True, True, False), "3": (True, False, True),
        "1A": (False, False, False), "2A": (False, True, False), "3A": (False, False, True)}
    for v, s in VARIANTS.items():
        assert FalconSpec.from_variant(v) is s and s.label == f"Falcon-{v}"
        assert FalconSpec.from_flags(delta=s.delta, per_column=s.per_column, windowed=s.windowed) is s
        assert s.window(4) == (4 if v.startswith("3") else 1)
    with pytest.raises(ValueError, match="variant"):
        FalconSpec.from_variant("4")
    assert PROVEN_CHUNK <= set(VARIANTS) and PROVEN_DECODE <= set(VARIANTS)


def test_select_on_cpu_and_forced_torch():
    q = torch.zeros(1, 8, 1, 16)
    for v, s in VARIANTS.items():
        c = select(s, q, window=4, grad=True)
        assert (c.label, c.core.__name__) == ("torch", "core_chunk") and "cpu" in c.reason
        c = select(s, q, window=4, grad=False, step=True)
        assert (c.label, c.core.__name__) == ("torch", "core_recurrent")
        assert select(s, q, window=4, grad=True, backend="torch").reason == "backend='torch'"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_proven_tables_decide_cuda_dispatch(variant):
    """What CUDA would run, asked of the Triton module without a GPU (device_type only)."""
    s = FalconSpec.from_variant(variant)
    ok, why = check(s, window=4, T=64, grad=True, device_type="cuda")
    assert ok == (variant in PROVEN_CHUNK) and why
    ok, why = check(s, window=4, T=1, grad=False, device_type="cuda")
    assert ok == (variant in PROVEN_DECODE) and why
    ok, why = check(s, window=3, T=64, grad=True, device_type="cuda")
    assert ok == (variant in PROVEN_CHUNK and variant != "3") and why  # Falcon-3 tiles need W | 16


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_step_equals_naive_and_chunk_on_cpu(variant):
    torch.manual_seed(0)
    B, T, H, K = 2, 9, 2, 8
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, K, dtype=torch.float64)
    shape = (B, T, H, K) if FalconSpec.from_variant(variant).per_column else (B, T, H)
    beta, lam = torch.rand(shape, dtype=torch.float64), 0.3 * torch.rand(B, T, H, dtype=torch.float64)
    kw = dict(variant=variant, window=3)
    ref, _ = naive_recurrent_falcon(q, k, v, beta, lam, **kw)
    assert recurrent_falcon is naive_recurrent_falcon
    out, _ = fused_recurrent_falcon(q, k, v, beta, lam, **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # CPU: the same token recurrence
    ch, _ = chunk_falcon(q, k, v, beta, lam, chunk_size=4, **kw)
    torch.testing.assert_close(ch, ref, rtol=1e-9, atol=1e-10)


def test_banded_falcon_3a_avoids_the_chunk_that_failed_on_the_h200():
    """window_linear's K = 128, C = 64 rows failed on the H200 (2026-12-02); core runs it at C <= 32 above K = 64
    and keeps the asked chunk elsewhere (the scan is exact at any chunk size)."""
    from falcon_lab.kernels.triton.window_linear import chunk_for

    assert [chunk_for(128, 64), chunk_for(128, 32), chunk_for(128, 16), chunk_for(64, 64), chunk_for(16, 64)] == \
        [32, 32, 16, 64, 64]


def test_core_operator_backward_gets_no_zero_gradients_for_unused_outputs(monkeypatch):
    """The custom operator returns its saved intermediates as outputs; their gradients (and dS_T when S_T is
    unused) must reach the backward as None, not as zero tensors of their full size, eager and compiled."""
    from falcon_lab.kernels.triton import ops

    seen = []

    def fwd(q, x, v, eta, g, S0, cfg, cu=None):
        return [q * 2.0, q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[-1]), q.new_ones(64, 64)]

    def bwd(q, x, v, eta, g, saved, dO, dST, cfg, need_ds0, cu=None):
        seen.append(dST)
        z = torch.zeros_like
        return [dO * 2.0, z(x), z(v), z(eta), z(g), None]

    monkeypatch.setitem(ops._FAMILIES, "test_family",
                        (fwd, bwd, lambda q, x, v, cfg, cu=None: [((64, 64), torch.float32)]))
    q, x, v = (torch.randn(1, 5, 2, 4, requires_grad=True) for _ in range(3))
    eta, g = torch.rand(1, 5, 2), torch.rand(1, 5, 2)

    def loss(q):
        return ops.chunk_core(q, x, v, eta, g, None, "test_family", [0])[0].sum()

    loss(q).backward()
    torch.testing.assert_close(q.grad, torch.full_like(q, 2.0))
    q.grad = None
    torch.compile(loss, backend="aot_eager", fullgraph=True)(q).backward()
    torch.testing.assert_close(q.grad, torch.full_like(q, 2.0))
    assert len(seen) == 2 and all(d is None for d in seen), seen


def test_core_runs_the_operator_only_where_something_must_see_it(monkeypatch):
    """Plain eager calls take the cheaper autograd.Function; under a dispatch mode (selective checkpointing,
    fake tensors) the registered operator runs, so the mode sees one `falcon_lab::chunk_core_fwd`. Both give
    the family's forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from falcon_lab.kernels.triton import ops

    def fwd(q, x, v, eta, g, S0, cfg, cu=None):
        return [q * 3.0, q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[-1]), q.new_ones(4)]

    def bwd(q, x, v, eta, g, saved, dO, dST, cfg, need_ds0, cu=None):
        z = torch.zeros_like
        return [dO * 3.0, z(x), z(v), z(eta), z(g), None]

    monkeypatch.setitem(ops._FAMILIES, "test_family", (fwd, bwd, lambda q, x, v, cfg, cu=None: [((4,), torch.float32)]))

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, x, v = (torch.randn(1, 5, 2, 4, requires_grad=True) for _ in range(3))
    eta, g = torch.rand(1, 5, 2), torch.rand(1, 5, 2)
    o, _ = ops.chunk_core(q, x, v, eta, g, None, "test_family", [0])
    assert type(o.grad_fn).__name__ == "_ChunkCoreBackward"
    o.sum().backward()
    torch.testing.assert_close(q.grad, torch.full_like(q, 3.0))
    q.grad = None
    with Seen() as mode:
        o, _ = ops.chunk_core(q, x, v, eta, g, None, "test_family", [0])
    assert "falcon_lab.chunk_core_fwd.default" in mode.ops, mode.ops
    o.sum().backward()
    torch.testing.assert_close(q.grad, torch.full_like(q, 3.0))


def test_host_integer_helpers_agree_with_triton():
    """The launchers' cdiv / next_pow2 (kernels/triton/host.py) replace triton.cdiv / next_power_of_2, whose host
    calls cost ~12 us each in Triton 3.6: same values."""
    import triton

    from falcon_lab.kernels.triton.host import cdiv, next_pow2

    assert [next_pow2(n) for n in range(1, 600)] == [triton.next_power_of_2(n) for n in range(1, 600)]
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 300) for b in (1, 3, 16, 64, 100))


def test_fp32_dot_precision_small_tiles_use_ieee_on_gpu():
    """tf32x3 builds with K or V <= 16 misbehaved on the H200 (a shared-memory read out of bounds, compute-sanitizer,
    2026-12-02): those run "ieee"; larger fp32 tiles keep tf32x3, 16-bit operands and allow_tf32 keep tf32, and the
    interpreter (CPU) always takes ieee."""
    from falcon_lab.kernels.triton.common import _prec

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _prec(torch.float32, False, cuda, 16, 64) == "ieee"
    assert _prec(torch.float32, False, cuda, 64, 16) == "ieee"
    assert _prec(torch.float32, False, cuda, 64, 64) == "tf32x3"
    assert _prec(torch.float32, False, cuda) == "tf32x3"
    assert _prec(torch.float32, True, cuda, 16, 16) == "tf32"
    assert _prec(torch.bfloat16, False, cuda, 16, 16) == "tf32"
    assert _prec(torch.float32, False, cpu, 64, 64) == "ieee"


def test_state_pass_value_tile_switch(monkeypatch):
    """FALCON_TRITON_STATE_BV: "off" keeps _cfg's tile; a number sets it (capped at V's tile); "auto" (the default)
    halves it while the state pass would have fewer than STATE_PROGRAMS programs, not below 16 (32 in fp32)."""
    from falcon_lab.kernels.triton import common

    if "FALCON_TRITON_STATE_BV" not in os.environ:
        assert common.STATE_BV == "auto"
    monkeypatch.setattr(common, "STATE_BV", "off")
    assert common.state_bv(32, 128, 6, torch.bfloat16) == 32
    monkeypatch.setattr(common, "STATE_BV", "16")
    assert common.state_bv(32, 128, 6, torch.bfloat16) == 16 and common.state_bv(64, 16, 6, torch.bfloat16) == 16
    monkeypatch.setattr(common, "STATE_BV", "auto")
    assert common.state_bv(32, 128, 6, torch.bfloat16) == 16      # (1, 32768, 6, 128): 24 programs -> 48
    assert common.state_bv(32, 128, 6, torch.float32) == 32       # fp32 keeps value tiles >= 32
    assert common.state_bv(64, 64, 48, torch.bfloat16) == 16      # (4, 8192, 12, 64): 48 -> 192
    assert common.state_bv(64, 64, 192 * 2, torch.bfloat16) == 64  # enough programs already
    monkeypatch.setattr(common, "STATE_BV", "24")
    with pytest.raises(ValueError, match="FALCON_TRITON_STATE_BV"):
        common.state_bv(32, 128, 6, torch.bfloat16)


def test_linear_state_pass_key_tiles(monkeypatch):
    """FALCON_TRITON_LINEAR_KSPLIT: "off" keeps the whole key width (NKB = 1) with state_bv's value tile; "scalar" (the
    default, chunk.py's linear passes) and "on" (percol's too) halve the key tile (not below KSPLIT_MIN_BK) while the
    pass would have fewer than STATE_PROGRAMS programs, then the value tile with NKB x the programs; chunk.py's delta
    rule (and Falcon-3's groups) never split."""
    from falcon_lab.kernels.triton import chunk, common, percol

    if "FALCON_TRITON_LINEAR_KSPLIT" not in os.environ:
        assert common.LINEAR_KSPLIT == "scalar"
    monkeypatch.setattr(common, "STATE_BV", "auto")
    monkeypatch.setattr(percol, "INTRA", "blocked")
    monkeypatch.setattr(common, "LINEAR_KSPLIT", "scalar")
    assert common.linear_state_tiles(128, 32, 128, 128, 6, torch.bfloat16) == (32, 16, 4)
    assert percol._state_tiles(128, 32, 128, 128, 6, torch.bfloat16) == (128, 32, 1)  # Falcon-2A's: only under "on"
    monkeypatch.setattr(common, "LINEAR_KSPLIT", "off")
    assert common.linear_state_tiles(128, 32, 128, 128, 6, torch.bfloat16) == (128, 16, 1)
    monkeypatch.setattr(common, "LINEAR_KSPLIT", "on")
    # (1, 32768, 6, 128): 24 programs -> key tiles of 32 (96) -> value tiles of 16 (192)
    assert common.linear_state_tiles(128, 32, 128, 128, 6, torch.bfloat16) == (32, 16, 4)
    assert common.linear_state_tiles(128, 32, 128, 128, 6, torch.float32) == (32, 32, 4)  # fp32 value tiles >= 32
    # (4, 8192, 12, 64): 48 -> key tiles of 32 (96) -> value tiles of 32 (192), 16 (384)
    assert common.linear_state_tiles(64, 64, 64, 64, 48, torch.bfloat16) == (32, 16, 2)
    # (16, 2048, 12, 64): 192 -> 384 programs with two key tiles, the value tile kept
    assert common.linear_state_tiles(64, 64, 64, 64, 192, torch.bfloat16) == (32, 64, 2)
    assert common.linear_state_tiles(64, 64, 64, 64, 192 * 4, torch.bfloat16) == (64, 64, 1)  # enough already
    assert common.linear_state_tiles(32, 32, 32, 32, 1, torch.bfloat16)[2] == 1  # key tiles >= KSPLIT_MIN_BK (32)
    assert chunk._state_tiles(128, 32, 128, 128, 6, torch.bfloat16, True, 1) == (128, 16, 1)  # the delta rule
    assert chunk._state_tiles(128, 32, 128, 128, 6, torch.bfloat16, False, 4)[2] == 1  # Falcon-3's groups
    assert chunk._state_tiles(128, 32, 128, 128, 6, torch.bfloat16, False, 1) == (32, 16, 4)
    assert percol._state_tiles(128, 32, 128, 128, 6, torch.bfloat16) == (32, 16, 4)
    monkeypatch.setattr(percol, "INTRA", "exact")  # the broadcast backward adds DU's parts itself: never split
    assert percol._state_tiles(128, 32, 128, 128, 6, torch.bfloat16) == (128, 32, 1)


def test_state_pass_launch_switches(monkeypatch):
    """FALCON_TRITON_STATE_STAGES / _WARPS: empty (the defaults) keep the call's compile options; 1-4 stages are set for
    16-bit calls, never for fp32 (its 1 stage), warps for every call; anything else fails at import, naming the
    variable."""
    from falcon_lab.kernels.triton import common

    if not {"FALCON_TRITON_STATE_STAGES", "FALCON_TRITON_STATE_WARPS"} & set(os.environ):
        assert common.STATE_STAGES == common.STATE_WARPS == "" and common.state_opts({}) == {}
    monkeypatch.setattr(common, "STATE_STAGES", "4")
    monkeypatch.setattr(common, "STATE_WARPS", "")
    assert common.state_opts({}) == {"num_stages": 4}
    assert common.state_opts(common._stages(torch.float32)) == {"num_stages": 1}
    monkeypatch.setattr(common, "STATE_WARPS", "2")
    assert common.state_opts(common._stages(torch.float32)) == {"num_stages": 1, "num_warps": 2}
    for var, bad, msg in (("FALCON_TRITON_STATE_STAGES", "5", "must be empty or 1-4, got '5'"),
                          ("FALCON_TRITON_STATE_WARPS", "3", "must be empty, 1, 2, 4 or 8, got '3'")):
        out = import_with("falcon_lab.kernels.triton.common", **{var: bad})
        assert out.returncode != 0 and f"{var} {msg}" in out.stderr, out.stderr[-400:]
