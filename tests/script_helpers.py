"""Load a script that is not part of the falcon_lab package (experiments/...) as a module, by its path from the
repository root, for the tests of its CPU-side logic."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str, name: str | None = None):
    """The module of ROOT / relpath, executed fresh (not entered in sys.modules), named `name` or the file's stem."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
