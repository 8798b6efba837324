"""Console logging of falcon_lab's entry points.

Modules log through ``log = logging.getLogger(__name__)`` and never configure logging themselves;
``print`` is kept for what a command is run for (tables, reports, the final summary, generated text).

- Hydra apps (``fit``, ``evaluate``, ``generate``) log through Hydra's ``hydra/job_logging``: the root
  logger at INFO on stdout (``fit`` also writes ``<run dir>/fit.log``).
- The other entry points (``sweep`` and its worker and job processes, ``bench``,
  ``training.mlflow_merge``) call :func:`setup`: falcon_lab's records at INFO and above go to stdout as
  ``[falcon_lab] message`` (``[sweep] ...`` for the sweep driver, ``[bench model] ...`` for the model
  benchmark; ``warning: `` / ``error: `` after the tag). Other libraries keep Python's default
  (warnings and errors only, on stderr).
"""
from __future__ import annotations

import logging
import sys

# logger-name prefix -> console tag (the longest matching prefix wins); everything else: falcon_lab
TAGS = {
    "falcon_lab.sweep": "sweep",  # falcon_lab.sweep and falcon_lab.sweeps.*
    "falcon_lab.benchmarking.model": "bench model",
    "falcon_lab.training.mlflow_merge": "mlflow_merge",
}


def tag(name: str) -> str:
    best = ""
    for prefix in TAGS:
        if name.startswith(prefix) and len(prefix) > len(best):
            best = prefix
    return TAGS[best] if best else "falcon_lab"


class Formatter(logging.Formatter):
    """``[tag] message``, with ``warning: `` / ``error: `` after the tag for those levels."""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else \
            ("warning: " if record.levelno < logging.ERROR else "error: ")
        text = f"[{tag(record.name)}] {level}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _StdoutHandler(logging.StreamHandler):
    """Writes to the ``sys.stdout`` of the moment (pytest's capture, a redirected stream), not the
    one that was current when the handler was made."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup(level: int = logging.INFO) -> logging.Logger:
    """Show falcon_lab's log records at ``level`` and above on stdout (idempotent)."""
    pkg = logging.getLogger("falcon_lab")
    pkg.setLevel(level)
    if not any(isinstance(h, _StdoutHandler) for h in pkg.handlers):
        handler = _StdoutHandler()
        handler.setFormatter(Formatter())
        pkg.addHandler(handler)
    return pkg
