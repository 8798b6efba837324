"""The kernel switches' registry (falcon_lab.kernels.triton.host.SWITCHES) and `python -m falcon_lab.bench
switches`: every FALCON_TRITON_* variable the kernels read goes through env_choice / env_value, so the listing cannot
miss one; each says what it decides; an override shows in bold."""
import importlib
import os
import pkgutil
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "falcon_lab", "kernels", "triton")


def _sources():
    for name in sorted(os.listdir(PKG)):
        if name.endswith(".py"):
            with open(os.path.join(PKG, name)) as f:
                yield name, f.read()


def test_every_kernel_switch_is_read_through_the_registry():
    import falcon_lab.kernels.triton as kt
    from falcon_lab.kernels.triton.host import SWITCHES

    for m in pkgutil.iter_modules(kt.__path__):
        importlib.import_module(f"{kt.__name__}.{m.name}")
    read = set()
    for name, src in _sources():
        assert not re.search(r"environ(\.get)?\(?\[?\s*[\"']FALCON_TRITON_", src), \
            f"{name} reads a FALCON_TRITON_* variable past env_choice / env_value"
        read |= set(re.findall(r"env_(?:choice|value)\(\s*\"(FALCON_TRITON_\w+)\"", src))
    assert len(read) >= 20 and read == set(SWITCHES), read ^ set(SWITCHES)
    for name, sw in SWITCHES.items():
        assert sw["what"].strip(), f"{name} does not say what it decides"
        assert sw["choices"] is None or sw["default"] in sw["choices"], name


def test_bench_switches_lists_each_once_and_marks_an_override():
    env = dict(os.environ, FALCON_TRITON_3_PAIR_SUM="torch", PYTHONPATH=ROOT)
    env.pop("FALCON_TRITON_A_DTYPE", None)
    out = subprocess.run([sys.executable, "-m", "falcon_lab.bench", "switches"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [r for r in out.stdout.splitlines() if r.startswith("| `FALCON_TRITON_")]
    names = [r.split("`")[1] for r in rows]
    assert len(names) == len(set(names)) >= 20
    pair = next(r for r in rows if "`FALCON_TRITON_3_PAIR_SUM`" in r)
    assert "**'torch'**" in pair and "'triton'" in pair, pair
    adt = next(r for r in rows if "`FALCON_TRITON_A_DTYPE`" in r)
    assert "| 'input' | 'input' |" in adt, adt  # the default, not bold
