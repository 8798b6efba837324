"""The README's runnable examples run."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _block(tag):
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- example:{tag}.*?-->\s*```python\n(.*?)```", text, re.S)
    assert m, f"README example {tag!r} not found"
    return m.group(1)


def test_operator_example_runs():
    code = _block("operators")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([2, 100, 4, 32]) torch.Size([2, 4, 32, 32])" in out.stdout


def test_lab_names_its_commands_on_a_typo():
    """`./lab <typo>` stops before installing anything and lists the commands (was: a bare
    'No module named falcon_lab.<typo>')."""
    out = subprocess.run(["bash", str(ROOT / "lab"), "evalute"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown command 'evalute'" in out.stderr and "evaluate" in out.stderr
    out = subprocess.run(["bash", str(ROOT / "lab"), "help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "commands: fit test evaluate" in out.stdout
