"""Scoring of variable-length addition (paper Table 3) and a Lightning callback that runs it during
training so the best step can be chosen by in-distribution validation.

Per width: teacher-forced exact match of the whole answer (every answer token, EOS included, is the
argmax given the gold prefix; the paper's metric), token accuracy, and free-running greedy exact
match (decoded until EOS; it equals teacher-forced exact match whenever the decoder is right, which
makes it a check on the recurrent decode path). OOD summary: the mean over the OOD widths (the
paper's "Mean acc."), accuracy at the first and last OOD width (Acc@d33 / Acc@d48).
Accuracies are fractions in [0, 1]; tables print percentages.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import torch

from falcon_lab.data.tasks.addition import AdditionExample, AdditionTask
from falcon_lab.evaluation.common import as_tokenizer, greedy_generate, save_accuracy_plot, score_continuations

log = logging.getLogger(__name__)


def example_tokens(tok, ex: AdditionExample, eos_in_answer: bool = True) -> tuple[list[int], list[int]]:
    """(context, answer) token ids: context = BOS + prompt, answer = answer text (+ EOS)."""
    tok = as_tokenizer(tok)
    ctx = [tok.bos_id] + tok.encode(ex.prompt)
    ans = tok.encode(ex.answer) + ([tok.eos_id] if eos_in_answer else [])
    return ctx, ans


@dataclass
class WidthScore:
    width: int
    n: int
    exact: float          # teacher-forced exact match of the whole answer
    token_acc: float
    free_exact: float | None = None
    held_out: bool | None = None  # validation only: were these pairs kept out of training?


def score_examples(model, tokenizer, examples_by_width: dict[int, list[AdditionExample]], *,
                   eos_in_answer: bool = True, free_running: bool = False, batch_size: int = 32,
                   held_out: dict[int, bool] | None = None, progress: bool = False,
                   desc: str = "addition") -> dict[int, WidthScore]:
    tok = as_tokenizer(tokenizer)
    flat = [(n, ex) for n, exs in sorted(examples_by_width.items()) for ex in exs]
    pairs = [example_tokens(tok, ex, eos_in_answer) for _, ex in flat]
    scores = score_continuations(model, pairs, batch_size=batch_size, pad_id=tok.pad_id, progress=progress,
                                 desc=f"{desc} (teacher-forced)")
    free = None
    if free_running:
        gens = greedy_generate(model, [c for c, _ in pairs], max_new_tokens=max(len(a) for _, a in pairs),
                               eos_id=tok.eos_id if eos_in_answer else None, batch_size=batch_size,
                               pad_id=tok.pad_id)
        free = []
        for (c, a), g in zip(pairs, gens):
            want = a[:-1] if eos_in_answer else a
            free.append(g[:len(want)] == want and (len(g) == len(want) if eos_in_answer else True))
    out: dict[int, WidthScore] = {}
    for n in sorted(examples_by_width):
        idx = [i for i, (w, _) in enumerate(flat) if w == n]
        if not idx:
            continue
        ex = sum(scores[i].is_greedy for i in idx) / len(idx)
        ta = sum(scores[i].n_correct for i in idx) / max(1, sum(scores[i].n_tokens for i in idx))
        fe = None if free is None else sum(free[i] for i in idx) / len(idx)
        out[n] = WidthScore(n, len(idx), ex, ta, fe, None if held_out is None else held_out.get(n))
    return out


@dataclass
class AdditionResult:
    fmt: str
    eos_in_answer: bool
    val: dict[int, WidthScore]
    ood: dict[int, WidthScore]
    notes: list[str] = field(default_factory=list)
    # variable format only: OOD "widths" as the authors' generator reads them, a cap (each operand's
    # width ~ U{1..cap}); most capped examples lie inside the training widths (ours, reported beside
    # the exact-width split because the paper's per-width numbers fit this reading; PLAN.md)
    ood_cap: dict[int, WidthScore] = field(default_factory=dict)

    @property
    def val_acc(self) -> float:
        n = sum(s.n for s in self.val.values())
        return sum(s.exact * s.n for s in self.val.values()) / max(n, 1)

    @property
    def val_acc_heldout(self) -> float | None:
        ws = [s for s in self.val.values() if s.held_out]
        if not ws:
            return None
        return sum(s.exact * s.n for s in ws) / sum(s.n for s in ws)

    @property
    def ood_mean(self) -> float | None:
        return sum(s.exact for s in self.ood.values()) / len(self.ood) if self.ood else None

    def metrics(self, prefix: str = "addition/") -> dict[str, float]:
        m = {prefix + "val_acc": self.val_acc}
        if self.val_acc_heldout is not None:
            m[prefix + "val_acc_heldout"] = self.val_acc_heldout
        if self.ood:
            lo, hi = min(self.ood), max(self.ood)
            m[prefix + "ood_mean"] = self.ood_mean
            m[prefix + f"acc_d{lo}"] = self.ood[lo].exact
            m[prefix + f"acc_d{hi}"] = self.ood[hi].exact
            m[prefix + "ood_token_acc"] = sum(s.token_acc for s in self.ood.values()) / len(self.ood)
            fr = [s.free_exact for s in self.ood.values() if s.free_exact is not None]
            if fr:
                m[prefix + "ood_free_mean"] = sum(fr) / len(fr)
        if self.ood_cap:
            lo, hi = min(self.ood_cap), max(self.ood_cap)
            m[prefix + "ood_cap_mean"] = sum(s.exact for s in self.ood_cap.values()) / len(self.ood_cap)
            m[prefix + f"acc_cap_d{lo}"] = self.ood_cap[lo].exact
            m[prefix + f"acc_cap_d{hi}"] = self.ood_cap[hi].exact
        return m

    def to_dict(self) -> dict:
        def ws(d):
            return {str(k): vars(v) for k, v in d.items()}
        return {"format": self.fmt, "eos_in_answer": self.eos_in_answer, "metrics": self.metrics(),
                "val": ws(self.val), "ood": ws(self.ood), "ood_cap": ws(self.ood_cap), "notes": self.notes}

    def table(self) -> str:
        lines = ["width  split  n    exact%  token%  free%  held_out"]
        for split, d in (("val", self.val), ("ood", self.ood), ("cap", self.ood_cap)):
            for n, s in d.items():
                fe = "-" if s.free_exact is None else f"{100 * s.free_exact:5.1f}"
                ho = "" if s.held_out is None else str(s.held_out)
                lines.append(f"{n:5d}  {split:5s} {s.n:4d}  {100 * s.exact:6.1f}  {100 * s.token_acc:6.1f}"
                             f"  {fe:>5s}  {ho}")
        for k, v in self.metrics().items():
            lines.append(f"{k} = {100 * v:.1f}%")
        return "\n".join(lines)


def evaluate_addition(model, tokenizer, task: AdditionTask, *, n_examples: int = 100,
                      eos_in_answer: bool = True, free_running: bool = True, ood: bool = True,
                      batch_size: int = 32, val_widths=None, ood_widths=None,
                      progress: bool = False) -> AdditionResult:
    """ID validation on the held-out set fixed up front, and ``n_examples`` fresh examples per OOD
    width. ``val_widths`` / ``ood_widths`` restrict the widths (e.g. for quick checks)."""
    val = task.validation()
    if val_widths is not None:
        val = {n: val[n] for n in val_widths if n in val}
    hw = set(task.heldout_widths())
    held = {n: n in hw for n in val}
    notes = []
    small = sorted(n for n in val if n not in hw)
    if small:
        notes.append(f"widths {small} have fewer than {task.min_pairs_for_holdout} operand pairs: "
                     "their validation pairs are not held out of training (held_out=false)")
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        v = score_examples(model, tokenizer, val, eos_in_answer=eos_in_answer, free_running=free_running,
                           batch_size=batch_size, held_out=held, progress=progress, desc="addition ID val")
        o, cap = {}, {}
        if ood:
            widths = ood_widths if ood_widths is not None else range(task.ood_widths[0], task.ood_widths[1] + 1)
            o = score_examples(model, tokenizer, {n: task.fresh(n, n_examples, "ood") for n in widths},
                               eos_in_answer=eos_in_answer, free_running=free_running,
                               batch_size=batch_size, progress=progress, desc="addition OOD")
            if task.fmt == "variable":
                cap = score_examples(model, tokenizer,
                                     {n: task.fresh(n, n_examples, "oodcap", exact=False) for n in widths},
                                     eos_in_answer=eos_in_answer, free_running=free_running,
                                     batch_size=batch_size, progress=progress, desc="addition OOD (capped)")
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    return AdditionResult(task.fmt, eos_in_answer, v, o, notes, cap)


def plot_addition(result: AdditionResult, path: str, title: str | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for split, d, c in (("ID val", result.val, "tab:blue"), ("OOD", result.ood, "tab:red")):
        if d:
            ws = sorted(d)
            ax.plot(ws, [100 * d[w].exact for w in ws], "o-", color=c, ms=3, label=f"{split} exact (TF)")
            ax.plot(ws, [100 * d[w].token_acc for w in ws], ":", color=c, label=f"{split} token acc")
    if result.val and result.ood:
        ax.axvline(max(result.val) + 0.5, color="gray", lw=0.8)
    return save_accuracy_plot(fig, ax, path, "operand width (digits)",
                              title or f"Addition accuracy vs width (format={result.fmt})")


# ---------------------------------------------------------------------------------------------
# Lightning callback
# ---------------------------------------------------------------------------------------------
def _lightning_callback_base():
    import lightning.pytorch as pl
    return pl.Callback


class AdditionEvalCallback(_lightning_callback_base()):
    """Evaluates addition every ``every_n_steps`` optimizer steps (and at the end of fit), logs
    ``addition/val_acc``, ``addition/ood_mean``, ``addition/acc_d33``, ``addition/acc_d48`` to every
    logger at the global step, and keeps the best step by ID validation accuracy (ties go to the
    later step; ours). At the end it logs ``addition/best_step`` and the metrics at that step
    (``addition/best/...``), and writes ``addition_history.json`` to ``dirpath`` (and to MLflow).
    """

    def __init__(self, task: AdditionTask | None = None, tokenizer=None, *, every_n_steps: int = 100,
                 n_examples: int = 100, ood: bool = True, eos_in_answer: bool = True,
                 batch_size: int = 64, dirpath: str | None = None, val_widths=None, ood_widths=None):
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"AdditionEvalCallback every_n_steps={every_n_steps}: must be >= 1")
        self.task = task or AdditionTask()
        self.tokenizer = tokenizer
        self.every_n_steps, self.n_examples, self.ood = every_n_steps, n_examples, ood
        self.eos_in_answer, self.batch_size, self.dirpath = eos_in_answer, batch_size, dirpath
        self.val_widths, self.ood_widths = val_widths, ood_widths
        self.history: list[dict] = []
        self.best: dict | None = None
        self._last_step = -1

    def _tok(self, trainer, pl_module):
        for src in (self.tokenizer, getattr(pl_module, "tokenizer", None),
                    getattr(getattr(trainer, "datamodule", None), "tokenizer", None)):
            if src is not None:
                return src
        raise ValueError("AdditionEvalCallback: no tokenizer (pass tokenizer=, or give the module or "
                         "datamodule a .tokenizer)")

    def _run(self, trainer, pl_module):
        step = int(trainer.global_step)
        if step == self._last_step:
            return
        self._last_step = step
        model = getattr(pl_module, "model", pl_module)
        with torch.no_grad():
            res = evaluate_addition(model, self._tok(trainer, pl_module), self.task,
                                    n_examples=self.n_examples, eos_in_answer=self.eos_in_answer,
                                    free_running=False, ood=self.ood, batch_size=self.batch_size,
                                    val_widths=self.val_widths, ood_widths=self.ood_widths)
        if hasattr(pl_module, "train"):
            pl_module.train()
        m = res.metrics()
        widths = {"val_by_width": {str(w): sc.exact for w, sc in res.val.items()},
                  "ood_by_width": {str(w): sc.exact for w, sc in res.ood.items()},  # for per-width plots
                  **({"ood_cap_by_width": {str(w): sc.exact for w, sc in res.ood_cap.items()}} if res.ood_cap else {})}
        self.history.append({"step": step, **m, **widths})
        if self.best is None or m["addition/val_acc"] >= self.best["addition/val_acc"]:
            self.best = {"step": step, **m, **widths}
        for lg in trainer.loggers:
            lg.log_metrics(m, step=step)
        self._write()

    def _write(self) -> str | None:
        """addition_history.json in dirpath, rewritten after every evaluation so a run killed part-way
        still leaves its history and best step so far on disk (ours)."""
        if not self.dirpath:
            return None
        import os
        os.makedirs(self.dirpath, exist_ok=True)
        path = os.path.join(self.dirpath, "addition_history.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"format": self.task.fmt, "history": self.history, "best": self.best}, f, indent=1)
        os.replace(tmp, path)
        return path

    # the history and best step travel in Lightning checkpoints, so a resumed run keeps them
    def state_dict(self):
        return {"history": self.history, "best": self.best, "last_step": self._last_step}

    def load_state_dict(self, state):
        self.history = list(state.get("history", []))
        self.best = state.get("best")
        self._last_step = int(state.get("last_step", -1))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > 0 and trainer.global_step % self.every_n_steps == 0:
            self._run(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self._run(trainer, pl_module)
        if self.best is None:
            return
        final = {"addition/best_step": float(self.best["step"])}
        final.update({k.replace("addition/", "addition/best/"): v for k, v in self.best.items()
                      if k.startswith("addition/")})
        for lg in trainer.loggers:
            lg.log_metrics(final, step=int(trainer.global_step))
        path = self._write()
        for lg in trainer.loggers:
            exp, run_id = getattr(lg, "experiment", None), getattr(lg, "run_id", None)
            if path and run_id and hasattr(exp, "log_artifact"):
                exp.log_artifact(run_id, path)
            if run_id and hasattr(exp, "set_experiment_tag") and getattr(lg, "experiment_id", None):
                try:  # the experiment's addition view (the table's columns), beside the platform's default one
                    from falcon_lab.training.mlflow import share_view
                    share_view(exp, lg.experiment_id, ADDITION_VIEW_KEY, addition_view_state(self.task.fmt))
                except Exception as e:  # noqa: BLE001 - a view must not fail a finished run
                    log.warning("could not add the MLflow addition view: %s", str(e)[:200])


ADDITION_VIEW_KEY = "falcon-lab-addition"


def addition_view_state(fmt: str = "paper") -> dict:
    """The runs-table columns of an addition experiment: the best step's ID and OOD accuracies (the capped split
    too for the variable format), ordered by mean OOD accuracy, best first. Opened by
    falcon_lab.training.mlflow.view_url(uri, experiment_id, view=ADDITION_VIEW_KEY)."""
    from falcon_lab.training.mlflow import view_state

    metrics = ["addition/best/val_acc", "addition/best/ood_mean", "addition/best/acc_d33", "addition/best/acc_d48"]
    order = "addition/best/ood_mean"
    if fmt == "variable":
        metrics += ["addition/best/ood_cap_mean", "addition/best/acc_cap_d33", "addition/best/acc_cap_d48"]
        order = "addition/best/ood_cap_mean"
    return view_state(metrics=metrics + ["addition/best_step"], tags=("label", "steps", "params_total"),
                      params=("seed", "mixer.name", "mixer.variant", "mixer.preset", "data.format", "model.d_model",
                              "model.n_layers"), order_by=order, ascending=False)


def callback_from_cfg(cfg, tokenizer=None, dirpath: str | None = None) -> "AdditionEvalCallback | None":
    """The AdditionEvalCallback a training config asks for (``addition_eval`` node, data.name ==
    "addition"), or None. ``training.run`` callers: ``callbacks=[callback_from_cfg(cfg)]``."""
    node = cfg.get("addition_eval") if hasattr(cfg, "get") else None
    if not node or cfg.data.get("name") != "addition":
        return None
    d = cfg.data
    allowed = {"every_n_steps", "n_examples", "ood", "batch_size", "val_widths", "ood_widths"}
    unknown = sorted(set(node.keys()) - allowed)
    if unknown:
        raise ValueError(f"addition_eval: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    task = AdditionTask(train_widths=tuple(d.get("train_widths", (1, 32))),
                        ood_widths=tuple(d.get("ood_widths", (33, 48))), fmt=str(d.get("format", "paper")),
                        val_per_width=int(d.get("val_per_width", 32)),
                        min_pairs_for_holdout=int(d.get("min_pairs_for_holdout", 100_000)),
                        seed=int(d.get("seed", 0)))
    vw, ow = node.get("val_widths"), node.get("ood_widths")
    return AdditionEvalCallback(task, tokenizer, every_n_steps=int(node.get("every_n_steps", 100)),
                                n_examples=int(node.get("n_examples", 100)), ood=bool(node.get("ood", True)),
                                eos_in_answer=bool(d.get("eos_in_answer", True)),
                                batch_size=int(node.get("batch_size", 128)), dirpath=dirpath,
                                val_widths=list(vw) if vw is not None else None,
                                ood_widths=list(ow) if ow is not None else None)
