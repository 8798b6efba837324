"""Downstream suites through lm-eval: a suite is a set of tasks, each with the metric that counts,
run at one or more few-shot settings; the suite score is the unweighted mean of those metrics.

Suites: ``paper8`` (built in: the paper's 8 tasks, reference §8.3), ``local`` (the shipped offline
tasks in the repository's ``evaluation/tasks/``), or the path of a suite YAML like
``evaluation/suites/*.yaml``::

    name: my_suite
    include_defaults: false        # load lm-eval's built-in task registry too (~8 s)?
    include_path: ../tasks         # task YAML folder(s), relative to the suite file
    num_fewshot: [0, 1]
    tasks: {task_name: metric, ...}

Local task YAMLs use ``dataset_path: json`` with ``data_files`` relative to the YAML file; they are
copied to a temporary folder with those paths made absolute, so they run from any directory.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

PAPER8 = {"name": "paper8", "include_defaults": True, "include_path": None, "num_fewshot": [0, 1],
          "tasks": {"piqa": "acc", "hellaswag": "acc_norm", "winogrande": "acc", "arc_easy": "acc",
                    "arc_challenge": "acc_norm", "openbookqa": "acc_norm", "social_iqa": "acc",
                    "sciq": "acc"}}

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILTIN = {"paper8": PAPER8,
           "local": {"name": "local", "include_defaults": False,
                     "include_path": str(REPO_ROOT / "evaluation" / "tasks"), "num_fewshot": [0],
                     "tasks": {"falcon_local_mc": "acc", "falcon_local_rolling": "word_perplexity"}}}

LOWER_IS_BETTER = {"word_perplexity", "byte_perplexity", "bits_per_byte", "perplexity"}


def load_suite(suite) -> dict:
    """A suite dict from a built-in name, a YAML path, or a dict/DictConfig."""
    if isinstance(suite, str) and suite in BUILTIN:
        return dict(BUILTIN[suite])
    if isinstance(suite, str):
        p = Path(suite)
        if not p.is_file() and (REPO_ROOT / suite).is_file():
            p = REPO_ROOT / suite
        if not p.is_file():
            raise ValueError(f"lm_eval.suite={suite!r}: not a built-in suite ({sorted(BUILTIN)}) or a "
                             "suite YAML file")
        import yaml
        d = yaml.safe_load(p.read_text())
        inc = d.get("include_path")
        if inc:
            incs = [inc] if isinstance(inc, str) else list(inc)
            d["include_path"] = [str((p.parent / i).resolve()) if not os.path.isabs(i) else i for i in incs]
        d.setdefault("name", p.stem)
    else:
        try:
            from omegaconf import OmegaConf
            d = OmegaConf.to_container(suite, resolve=True) if OmegaConf.is_config(suite) else dict(suite)
        except ImportError:
            d = dict(suite)
    for key in ("tasks",):
        if not d.get(key):
            raise ValueError(f"lm_eval suite {d.get('name', '?')!r}: missing '{key}' (task: metric)")
    d.setdefault("include_defaults", False)
    d.setdefault("num_fewshot", [0])
    if isinstance(d["num_fewshot"], int):
        d["num_fewshot"] = [d["num_fewshot"]]
    return d


_DATA_FILE = re.compile(r"^(\s+)([\w-]+):\s*(\S+\.(?:jsonl|json|csv|parquet|txt))\s*$")


def localize_tasks(include_paths, dest: str) -> list[str]:
    """Copy each task folder to ``dest`` with relative data file paths made absolute."""
    out = []
    for k, src in enumerate(include_paths):
        src = Path(src)
        if not src.is_dir():
            raise ValueError(f"lm_eval include_path {src}: not a folder")
        tgt = Path(dest) / f"inc{k}"
        shutil.copytree(src, tgt)
        for y in list(tgt.rglob("*.yaml")) + list(tgt.rglob("*.yml")):
            orig_dir = src / y.parent.relative_to(tgt)
            lines = []
            for line in y.read_text().splitlines():
                m = _DATA_FILE.match(line)
                if m and not os.path.isabs(m.group(3)) and "://" not in m.group(3):
                    line = f"{m.group(1)}{m.group(2)}: {(orig_dir / m.group(3)).resolve()}"
                lines.append(line)
            y.write_text("\n".join(lines) + "\n")
        out.append(str(tgt))
    return out


# ---------------------------------------------------------------------------------------------
# offline: detected once, up front
# ---------------------------------------------------------------------------------------------
LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas"}
_TRUE = {"1", "true", "yes", "on"}
_HUB_STATE: dict = {}


def hub_offline_reason(timeout: float = 1.5) -> str | None:
    """Why the Hugging Face hub cannot be reached (None when it can): HF_HUB_OFFLINE /
    HF_DATASETS_OFFLINE set, or no TCP connection to the hub's endpoint (HF_ENDPOINT, default
    huggingface.co:443) within ``timeout`` seconds. Probed once per process (cached)."""
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(k, "").strip().lower() in _TRUE:
            return f"{k} is set"
    from urllib.parse import urlparse
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    if (host, port) not in _HUB_STATE:
        import socket
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            _HUB_STATE[(host, port)] = None
        except OSError as e:
            _HUB_STATE[(host, port)] = f"{host}:{port} unreachable ({type(e).__name__}: {e})"
    return _HUB_STATE[(host, port)]


class hub_offline_mode:
    """Context manager: the hub libraries in offline mode (datasets and huggingface_hub read their
    HF_HUB_OFFLINE at import, so their module constants are switched, then restored): cached
    datasets load from the cache, uncached ones fail at once instead of retrying the network."""

    _targets = (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
                ("datasets.config", "HF_DATASETS_OFFLINE"))

    def __enter__(self):
        import importlib
        self._old = []
        for mod, name in self._targets:
            try:
                m = importlib.import_module(mod)
            except ImportError:
                continue
            if hasattr(m, name):
                self._old.append((m, name, getattr(m, name)))
                setattr(m, name, True)
        return self

    def __exit__(self, *exc):
        for m, name, v in self._old:
            setattr(m, name, v)
        return False


def _needs_hub(tm, task: str) -> bool:
    """Whether lm-eval task ``task`` loads its data from the hub (not a local builder with files)."""
    try:
        entry = tm.task_index[task]
        cfg = entry.cfg if hasattr(entry, "cfg") else entry
        cfg = dict(cfg) if cfg else {}
        if not cfg.get("dataset_path") and (entry.yaml_path if hasattr(entry, "yaml_path") else None):
            from lm_eval import utils
            cfg = utils.load_yaml_config(str(entry.yaml_path), mode="simple")
    except Exception:
        return True
    dp = cfg.get("dataset_path")
    if not dp:
        return True  # a group, or unknown: assume it does
    return not (str(dp) in LOCAL_BUILDERS or os.path.isdir(str(dp)))


@dataclass
class DownstreamResult:
    suite: str
    scores: dict = field(default_factory=dict)   # {shots: {task: value}}
    metrics_used: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict, repr=False)
    missing: dict = field(default_factory=dict)  # {task: reason}

    def _acc_tasks(self):
        return [t for t, m in self.metrics_used.items() if m not in LOWER_IS_BETTER]

    def mean(self, shots: int) -> float | None:
        """Unweighted mean of the accuracy-type metrics; None unless every such task ran (a mean
        over a subset is not the suite's number; see partial_mean)."""
        got = self.scores.get(shots, {})
        tasks = self._acc_tasks()
        if not tasks or any(t not in got for t in tasks):
            return None
        return sum(got[t] for t in tasks) / len(tasks)

    def partial_mean(self, shots: int) -> tuple[float | None, int]:
        got = self.scores.get(shots, {})
        vals = [got[t] for t in self._acc_tasks() if t in got]
        return (sum(vals) / len(vals) if vals else None), len(vals)

    def metrics(self, prefix: str = "lm_eval/") -> dict[str, float]:
        m = {}
        for shots, d in self.scores.items():
            for t, v in d.items():
                m[f"{prefix}{t}/{self.metrics_used[t]}_{shots}shot"] = v
            mean = self.mean(shots)
            if mean is not None:
                m[f"{prefix}{self.suite}/mean_{shots}shot"] = mean
            else:
                pm, k = self.partial_mean(shots)
                if pm is not None:
                    m[f"{prefix}{self.suite}/partial_mean_{shots}shot_{k}_of_{len(self._acc_tasks())}"] = pm
        return m

    def to_dict(self):
        return {"suite": self.suite, "scores": {str(k): v for k, v in self.scores.items()},
                "metrics_used": self.metrics_used, "metrics": self.metrics(), "missing": self.missing}

    def table(self) -> str:
        shots = sorted(self.scores)
        lines = ["task".ljust(24) + "metric".ljust(16) + "".join(f"{s}-shot".rjust(10) for s in shots)]
        for t, mname in self.metrics_used.items():
            row = t.ljust(24) + mname.ljust(16)
            for s in shots:
                v = self.scores[s].get(t)
                row += ("-" if v is None else (f"{100 * v:.2f}" if mname not in LOWER_IS_BETTER
                                               else f"{v:.4g}")).rjust(10)
            lines.append(row)
        lines.append("mean (acc-type)".ljust(40) + "".join(
            (f"{100 * self.mean(s):.2f}" if self.mean(s) is not None else "-").rjust(10) for s in shots))
        if any(self.mean(s) is None and self.partial_mean(s)[0] is not None for s in shots):
            lines.append("(no suite mean: some tasks did not run; partial means are logged as "
                         "partial_mean_*)")
        for t, why in self.missing.items():
            lines.append(f"{t}: not run ({why})")
        return "\n".join(lines)


def run_suite(lm, suite, *, limit: int | None = None, seed: int = 1234) -> DownstreamResult:
    """Evaluate ``lm`` (a FalconLabLM or any lm-eval LM) on a suite. Local json tasks need no
    network. When the suite has hub tasks, whether the hub is reachable is checked once up front
    (:func:`hub_offline_reason`); offline, the tasks run in offline mode (from the dataset cache),
    and those not cached are reported as not run, with the reason, at once (no network retries)."""
    import contextlib

    import lm_eval
    from lm_eval.tasks import TaskManager

    s = load_suite(suite)
    res = DownstreamResult(s["name"], metrics_used=dict(s["tasks"]))
    with tempfile.TemporaryDirectory(prefix="falcon_lab_tasks_") as tmp, contextlib.ExitStack() as stack:
        inc = s.get("include_path")
        incs = localize_tasks([inc] if isinstance(inc, str) else inc, tmp) if inc else None
        tm = TaskManager(include_path=incs, include_defaults=bool(s["include_defaults"]))
        hub_tasks = {t for t in s["tasks"] if _needs_hub(tm, t)}
        offline = hub_offline_reason() if hub_tasks else None
        if offline:
            stack.enter_context(hub_offline_mode())
        for shots in s["num_fewshot"]:
            res.scores[shots] = {}
            for task, metric in s["tasks"].items():
                if task in res.missing:  # failed at an earlier few-shot setting: same reason
                    continue
                try:
                    out = lm_eval.simple_evaluate(model=lm, tasks=[task], num_fewshot=int(shots),
                                                  task_manager=tm, limit=limit, bootstrap_iters=0,
                                                  random_seed=seed, numpy_random_seed=seed,
                                                  torch_random_seed=seed, fewshot_random_seed=seed,
                                                  log_samples=False)
                except Exception as e:  # dataset not cached / unknown task: reported, not hidden
                    why = f"{type(e).__name__}: {str(e)[:200]}"
                    if offline and task in hub_tasks:
                        why = f"offline ({offline}) and its dataset is not in the local cache; {why}"
                    res.missing[task] = why
                    continue
                r = out["results"][task]
                key = f"{metric},none"
                if key not in r:
                    raise ValueError(f"task {task}: metric {metric!r} not produced (has "
                                     f"{sorted(k for k in r if ',' in k)})")
                v = float(r[key])
                res.scores[shots][task] = v
                res.raw.setdefault(shots, {})[task] = {k: v for k, v in r.items()
                                                       if isinstance(v, (int, float)) and not (
                                                           isinstance(v, float) and math.isnan(v))}
    return res


def plot_downstream(result: DownstreamResult, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = [t for t in result.metrics_used if result.metrics_used[t] not in LOWER_IS_BETTER]
    shots = sorted(result.scores)
    fig, ax = plt.subplots(figsize=(1.5 + 0.8 * max(1, len(tasks)), 3.5))
    w = 0.8 / max(1, len(shots))
    for j, s in enumerate(shots):
        ax.bar([i + j * w for i in range(len(tasks))],
               [100 * result.scores[s].get(t, float("nan")) for t in tasks], w, label=f"{s}-shot")
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(tasks))], tasks, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"lm-eval suite {result.suite}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
