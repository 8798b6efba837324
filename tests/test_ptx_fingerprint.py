"""experiments/h200/ptx_fingerprint.py: what its normalisation forgives (names, line info, constant order, unused
arguments) and what it does not (a changed computation), and one real run on this machine's Triton."""
import json
import os
import subprocess
import sys

from script_helpers import ROOT, load_script

TOOL = ROOT / "experiments" / "h200" / "ptx_fingerprint.py"


def _tool():
    return load_script("experiments/h200/ptx_fingerprint.py")


IR = """#loc = loc(unknown)
#loc1 = loc("X")
module {{
  tt.func public @{name}({args}) attributes {{noinline = false}} {{
{consts}
    %0 = tt.get_program_id x : i32 loc(#loc2)
    %1 = tt.splat %{x} : !tt.ptr<f32> -> tensor<16x!tt.ptr<f32>> loc(#loc3)
    %2 = tt.addptr %1, %{c16} : tensor<16x!tt.ptr<f32>>, tensor<16xi32> loc(#loc3)
    %3 = tt.load %2 : tensor<16x!tt.ptr<f32>> loc(#loc4)
    %4 = arith.{op} %3, %{c2} : tensor<16xf32> loc(#loc5)
    tt.store %2, %4 : tensor<16x!tt.ptr<f32>> loc(#loc6)
    tt.return loc(#loc7)
  }} loc(#loc)
}} loc(#loc)
"""


def _ir(name="_k", x="X", unused=False, swap=False, op="mulf"):
    args = f'%{x}: !tt.ptr<f32> {{tt.divisibility = 16 : i32}} loc("{x}")'
    if unused:
        args += ', %WT: !tt.ptr<f32> {tt.divisibility = 16 : i32} loc("WT")'
    c16, c2 = ("cst", "cst_0") if not swap else ("cst_0", "cst")
    consts = [f"    %{c16} = arith.constant dense<16> : tensor<16xi32> loc(#loc)",
              f"    %{c2} = arith.constant dense<2.000000e+00> : tensor<16xf32> loc(#loc)"]
    if swap:
        consts.reverse()
    return IR.format(name=name, args=args, consts="\n".join(consts), x=x, c16=c16, c2=c2, op=op)


def test_normalisation_forgives_names_locations_constant_order_and_unused_arguments():
    pf = _tool()
    base = pf._normalise(_ir(), "_k")
    assert "KERNEL" in base and "loc(" not in base and "%X" not in base
    assert pf._normalise(_ir(name="_other"), "_other") == base              # the kernel's name
    assert pf._normalise(_ir(x="XW"), "_k") == base                         # an argument's name
    assert pf._normalise(_ir(swap=True), "_k") == base                      # constants hoisted in another order
    assert pf._normalise(_ir(unused=True), "_k") == base                    # an argument the body never reads
    assert pf._normalise(_ir(op="addf"), "_k") != base                      # a different computation
    # a block argument's call-site location, whose #loc numbers move when the kernel's source lines do
    blk = "  ^bb0(%intra_13: f32 loc(callsite(#loc at #loc{n})), %intra_14: f32 loc(callsite(#loc at #loc{n}))):"
    a, b = (pf._normalise(_ir() + blk.format(n=n), "_k") for n in (12, 14))
    assert a == b and "loc(" not in a


def test_a_real_run_fingerprints_kernels_and_compares_two_files(tmp_path):
    """Record the public core's launches, compile the decode kernel's builds with this machine's Triton for sm_90,
    and compare the file with itself and with a changed copy."""
    out = tmp_path / "fp.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    r = subprocess.run([sys.executable, str(TOOL), "--quick", "--only", "^_decode_step$", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    fps = res["fingerprints"]
    assert res["target"] == "cuda sm_90" and res["builds"] >= 8
    assert all(k.startswith("_decode_step ") for k in fps) and len(set(fps.values())) >= 2
    same = subprocess.run([sys.executable, str(TOOL), "--compare", str(out), str(out)], capture_output=True,
                          text=True, timeout=60)
    assert same.returncode == 0 and "_decode_step" in same.stdout and "same" in same.stdout
    changed = dict(res, fingerprints={k: ("0" * 16 if i == 0 else v) for i, (k, v) in enumerate(fps.items())})
    (tmp_path / "changed.json").write_text(json.dumps(changed))
    diff = subprocess.run([sys.executable, str(TOOL), "--compare", str(out), str(tmp_path / "changed.json")],
                          capture_output=True, text=True, timeout=60)
    assert diff.returncode == 1 and "DIFFERENT in 1 of" in diff.stdout
