"""The evaluation driver behind ``python -m falcon_lab.evaluate``: load a checkpoint, run the
requested suites, write JSON + PNG per suite, log metrics and artifacts to MLflow, print tables.

The MLflow run: ``mlflow.run_id`` if given; else the checkpoint's training run (recorded in the
checkpoint by training, or found by the ``run_dir`` tag training sets: the checkpoint lives in
``<run_dir>/checkpoints/``); else a new
run in ``mlflow.experiment_name`` (default: the checkpoint's experiment, else ``falcon_lab_eval``),
tagged ``eval.source_ckpt`` and with the checkpoint's mixer/variant tags so compare lines it up.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

SUITES = ("ppl", "lm_eval", "addition", "mqar", "passkey")
DEFAULT_MQAR_GRID = [(4, 64), (8, 64), (16, 128), (32, 256)]


class EvalConfigError(ValueError):
    pass


def _train_len(cfg) -> int:
    try:
        return int(cfg.data.seq_len)
    except Exception:
        return 512


def _device(name: str) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(name).startswith("cuda") and not torch.cuda.is_available():
        raise EvalConfigError(f"device={name}: CUDA is not available here")
    return torch.device(str(name))


def sanitize_metric(k: str) -> str:
    return re.sub(r"[^0-9A-Za-z_\-./ :]", "_", k)


# ---------------------------------------------------------------------------------------------
# MLflow
# ---------------------------------------------------------------------------------------------
def _ckpt_meta(path) -> dict:
    from falcon_lab.training.validate import load_checkpoint_safely

    try:
        ck = load_checkpoint_safely(path, "ckpt", mmap=True)
    except Exception:
        return {}
    meta = ck.get("falcon_lab") if isinstance(ck, dict) else None
    return dict(meta) if isinstance(meta, dict) else {}


def _existing_store(uri) -> bool:
    """True for a tracking URI taken from a checkpoint that may be followed: a SQLite store whose file already
    exists, or a server/database URI (nothing is created on this machine). A SQLite path that does not exist,
    or a file: store, is not followed."""
    if not uri:
        return False
    uri = str(uri)
    if uri.startswith("sqlite:"):
        path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
        return bool(path) and os.path.isfile(path)
    return not uri.startswith("file:") and "://" in uri


class MlflowSink:
    def __init__(self, ecfg, train_cfg, ckpt_path: str):
        from mlflow.tracking import MlflowClient

        from falcon_lab.training.mlflow import resolve_artifact_location, resolve_tracking_uri
        m = ecfg.mlflow
        meta = _ckpt_meta(ckpt_path)  # {"mlflow_run_id", "tracking_uri"} recorded by training
        # the store named inside the checkpoint (its metadata, or its training config) is used only when it
        # already exists: a checkpoint must never make evaluate create a database wherever it points
        ck_uris = [meta.get("tracking_uri")]
        if train_cfg is not None and train_cfg.get("logger") is not None:
            ck_uris.append(train_cfg.logger.get("tracking_uri"))
        uri = m.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or \
            next((u for u in ck_uris if _existing_store(u)), None) or resolve_tracking_uri(None)
        self.uri = uri
        # an explicit client, not mlflow.set_tracking_uri: that also sets $MLFLOW_TRACKING_URI for the rest of
        # the process, so a later fit or sweep in it would log to the store this evaluation chose
        self.client = MlflowClient(tracking_uri=uri)
        self.created = False
        run_id = m.get("run_id")
        if run_id is None and meta.get("mlflow_run_id") and meta.get("tracking_uri") == uri:
            try:
                self.client.get_run(meta["mlflow_run_id"])
                run_id = meta["mlflow_run_id"]
            except Exception:  # deleted, or not in this store
                run_id = None
        if run_id is None:
            run_id = self._find_training_run(ckpt_path)
        if run_id is None:
            exp_name = m.get("experiment_name") or (
                str(train_cfg.logger.get("experiment_name")) if train_cfg is not None and train_cfg.get("logger")
                else None) or "falcon_lab_eval"
            exp = self.client.get_experiment_by_name(exp_name)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(
                exp_name, artifact_location=resolve_artifact_location(uri))
            tags = {"eval.source_ckpt": str(Path(ckpt_path).resolve()), "mlflow.runName": f"eval:{Path(ckpt_path).stem}"}
            if train_cfg is not None:
                try:
                    from falcon_lab.training.mlflow import run_tags
                    tags.update(run_tags(train_cfg))
                except Exception:
                    pass
            run_id = self.client.create_run(exp_id, tags=tags).info.run_id
            self.created = True
        else:
            self.client.get_run(run_id)  # clear error if it does not exist
        self.run_id = run_id

    def _find_training_run(self, ckpt_path):
        run_dir = str(Path(ckpt_path).resolve().parent.parent)
        try:
            exps = [e.experiment_id for e in self.client.search_experiments()]
            if not exps:
                return None
            runs = self.client.search_runs(exps, filter_string=f"tags.run_dir = '{run_dir}'", max_results=5,
                                           order_by=["attributes.start_time DESC"])
        except Exception:
            return None
        if len(runs) > 1:
            log.info("%d MLflow runs used %s; logging to the latest, %s (mlflow.run_id= to choose)",
                     len(runs), run_dir, runs[0].info.run_id)
        return runs[0].info.run_id if runs else None

    def log_metrics(self, metrics: dict, step: int = 0):
        from mlflow.entities import Metric
        ts = int(time.time() * 1000)
        ms = [Metric(sanitize_metric(k), float(v), ts, step) for k, v in metrics.items()
              if v is not None and not (isinstance(v, float) and math.isnan(v))]
        for i in range(0, len(ms), 500):
            self.client.log_batch(self.run_id, metrics=ms[i:i + 500])

    def log_artifact(self, path: str, artifact_path: str = "eval"):
        self.client.log_artifact(self.run_id, path, artifact_path)

    def set_tag(self, k, v):
        self.client.set_tag(self.run_id, k, v)

    def close(self):
        if self.created:
            self.client.set_terminated(self.run_id, "FINISHED")


# ---------------------------------------------------------------------------------------------
# suites
# ---------------------------------------------------------------------------------------------
def _dump(obj, path):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    return path


def run_ppl(model, tok, train_cfg, ecfg, out: Path):
    from falcon_lab.evaluation.perplexity import SourceUnavailable, load_texts, perplexity, position_curve
    p = ecfg.ppl
    L = int(p.get("max_length") or _train_len(train_cfg))
    metrics, results, tables, pngs, unavailable = {}, {}, [], [], {}
    for src in p.sources:
        name = re.sub(r"[^0-9A-Za-z_]+", "_", str(src).split("/")[-1]).strip("_") or "text"
        try:
            docs = load_texts(str(src), max_docs=p.get("max_docs"), max_chars=p.get("max_chars"),
                              data_cfg=train_cfg.data if train_cfg is not None else None)
        except SourceUnavailable as e:
            unavailable[str(src)] = str(e)
            tables.append(f"{src}: unavailable ({e})")
            continue
        r = perplexity(model, tok, docs, name=name, max_length=L, stride=p.get("stride"),
                       batch_size=int(ecfg.batch_size), progress=True)
        metrics.update(r.metrics())
        results[name] = r.to_dict()
        tables.append(f"{name:>14s}: ppl {r.ppl:9.3f}  loss {r.loss:.4f}  bits/byte {r.bits_per_byte:.4f}  "
                      f"word ppl {r.word_ppl:9.3f}  ({r.n_tokens} tokens, {r.n_docs} docs, window {L})")
        ex = p.get("extrapolation") or {}
        if ex.get("enabled", True):
            for f in ex.get("factors", [4]):
                try:
                    pc = position_curve(model, tok, docs, seq_len=int(f * _train_len(train_cfg)),
                                        n_windows=int(ex.get("n_windows", 8)), train_len=_train_len(train_cfg),
                                        batch_size=max(1, int(ecfg.batch_size) // 4), name=f"{name}_x{f}")
                except ValueError as e:
                    tables.append(f"{name}: no extrapolation curve at x{f} ({e})")
                    continue
                metrics.update(pc.metrics())
                results[f"{name}_position_x{f}"] = pc.to_dict()
                pngs.append(_plot_curve(pc, out / f"ppl_position_{name}_x{f}.png"))
                m = pc.metrics()
                if f"extrap/{pc.name}/loss_beyond_train_len" in m:
                    tables.append(f"{'':>14s}  loss vs position to {pc.seq_len}: within train len "
                                  f"{m[f'extrap/{pc.name}/loss_within_train_len']:.4f}, beyond "
                                  f"{m[f'extrap/{pc.name}/loss_beyond_train_len']:.4f}")
    results["unavailable"] = unavailable
    scored = {k: v for k, v in results.items() if isinstance(v, dict) and "bits_per_byte" in v}
    if scored:
        pngs.insert(0, _plot_ppl(scored, out / "ppl_summary.png"))
    return metrics, results, "\n".join(tables), pngs, {}


def _plot_ppl(scored: dict, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(scored)
    fig, ax = plt.subplots(1, 2, figsize=(2.5 + 1.2 * len(names), 3.2))
    ax[0].bar(names, [scored[n]["ppl"] for n in names])
    ax[0].set_title("token perplexity")
    ax[1].bar(names, [scored[n]["bits_per_byte"] for n in names], color="C1")
    ax[1].set_title("bits per byte")
    for a in ax:
        a.tick_params(axis="x", labelsize=7, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def _plot_curve(pc, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    b = pc.buckets(64)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot([x for x, _ in b], [y for _, y in b], "-")
    if pc.train_len:
        ax.axvline(pc.train_len, color="gray", ls="--", lw=0.8, label="training length")
        ax.legend(fontsize=7)
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("mean NLL (nats)")
    ax.set_title(f"Loss vs position: {pc.name} ({pc.n_windows} windows)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def run_lm_eval(model, tok, train_cfg, ecfg, out: Path):
    from falcon_lab.evaluation.downstream import load_suite, plot_downstream, run_suite
    from falcon_lab.evaluation.lm_eval_adapter import FalconLabLM
    c = ecfg.lm_eval
    if c.get("tasks"):
        # task names straight from the command line: "name" (metric acc) or "name:metric"
        tasks = {}
        for t in c.tasks:
            name, _, metric = str(t).partition(":")
            tasks[name] = metric or "acc"
        inc = c.get("include_path")
        if inc:
            incs = [inc] if isinstance(inc, str) else list(inc)
            inc = [str(Path(i).expanduser().resolve()) for i in incs]
        suite = load_suite({"name": "custom", "tasks": tasks, "include_path": inc or None,
                            "include_defaults": bool(c.get("include_defaults", not inc))})
    else:
        suite = load_suite(str(c.suite))
    if c.get("num_fewshot") is not None:
        nf = c.num_fewshot
        suite["num_fewshot"] = [int(nf)] if isinstance(nf, int) else [int(x) for x in nf]
    lm = FalconLabLM(model=model, tokenizer=tok, batch_size=int(ecfg.batch_size),
                     max_length=int(c.get("max_length") or _train_len(train_cfg)),
                     device=str(next(model.parameters()).device))
    r = run_suite(lm, suite, limit=c.get("limit"), seed=int(ecfg.seed))
    png = plot_downstream(r, str(out / f"lm_eval_{r.suite}.png"))
    return r.metrics(), r.to_dict(), r.table(), [png], {}


def _addition_task(train_cfg, ecfg):
    from falcon_lab.data.tasks.addition import AdditionTask
    d = dict(ecfg.addition.get("task") or {})
    if train_cfg is not None and train_cfg.data.get("name") == "addition":
        td = train_cfg.data
        base = {"train_widths": td.get("train_widths", [1, 32]), "ood_widths": td.get("ood_widths", [33, 48]),
                "fmt": td.get("format", "paper"), "val_per_width": td.get("val_per_width", 32),
                "min_pairs_for_holdout": td.get("min_pairs_for_holdout", 100_000), "seed": td.get("seed", 0)}
        eos = bool(td.get("eos_in_answer", True))
    else:
        base, eos = {}, True
    if "format" in d:
        d["fmt"] = d.pop("format")
    base.update(d)
    eos = bool(base.pop("eos_in_answer", eos))
    for k in ("train_widths", "ood_widths"):
        if k in base:
            base[k] = tuple(base[k])
    try:
        return AdditionTask(**base), eos
    except TypeError as e:
        raise EvalConfigError(f"addition.task: {e}") from None


def run_addition(model, tok, train_cfg, ecfg, out: Path):
    from falcon_lab.evaluation.addition import evaluate_addition, plot_addition
    a = ecfg.addition
    task, eos = _addition_task(train_cfg, ecfg)
    notes = []
    if train_cfg is not None and train_cfg.data.get("name") != "addition":
        notes.append(f"checkpoint trained on data.name={train_cfg.data.get('name')!r}, not addition")
    r = evaluate_addition(model, tok, task, n_examples=int(a.n_examples), eos_in_answer=eos,
                          free_running=bool(a.free_running), ood=bool(a.ood), batch_size=int(ecfg.batch_size),
                          ood_widths=list(a.widths) if a.get("widths") else None,
                          val_widths=list(a.val_widths) if a.get("val_widths") else None, progress=True)
    r.notes += notes
    png = plot_addition(r, str(out / "addition_accuracy_vs_width.png"))
    tags = {"eval.addition_format": task.fmt}
    return r.metrics(), r.to_dict(), r.table() + ("\n" + "\n".join(r.notes) if r.notes else ""), [png], tags


def run_mqar(model, tok, train_cfg, ecfg, out: Path):
    from falcon_lab.evaluation.mqar import evaluate_mqar, plot_mqar
    c = ecfg.mqar
    kw = {}
    if train_cfg is not None and train_cfg.data.get("name") == "mqar":
        td = train_cfg.data
        kw = {"key_ids": tuple(td.get("key_ids", (1, 128))), "value_ids": tuple(td.get("value_ids", (128, 256))),
              "filler_id": int(td.get("filler_id", 0))}
    grid = c.get("grid")
    if not grid:
        if train_cfg is not None and train_cfg.data.get("name") == "mqar":
            nk = train_cfg.data.get("num_kv_pairs", [4, 8, 16])
            nk = [nk] if isinstance(nk, int) else list(nk)
            T = int(train_cfg.data.seq_len)  # the training cells, then twice the pairs at twice the length
            grid = [(n, T) for n in nk] + [(2 * max(nk), 2 * T)]
        else:
            grid = DEFAULT_MQAR_GRID
    r = evaluate_mqar(model, [tuple(g) for g in grid], n_examples=int(c.n_examples),
                      batch_size=int(ecfg.batch_size), seed=int(ecfg.seed), **kw)
    png = plot_mqar(r, str(out / "mqar_accuracy.png"))
    return r.metrics(), r.to_dict(), r.table(), [png], {}


def run_passkey(model, tok, train_cfg, ecfg, out: Path):
    from falcon_lab.evaluation.passkey import evaluate_passkey, plot_passkey
    c = ecfg.passkey
    T = _train_len(train_cfg)
    lens = list(c.context_lens) if c.get("context_lens") else [max(160, int(f * T)) for f in (0.5, 1, 2, 4)]
    r = evaluate_passkey(model, tok, context_lens=sorted(set(int(x) for x in lens)), depths=list(c.depths),
                         per_cell=int(c.per_cell), seed=int(ecfg.seed), batch_size=max(1, int(ecfg.batch_size) // 4),
                         train_len=T)
    png = plot_passkey(r, str(out / "passkey_heatmap.png"))
    return r.metrics(), r.to_dict(), r.table(), [png], {}


RUNNERS = {"ppl": run_ppl, "lm_eval": run_lm_eval, "addition": run_addition, "mqar": run_mqar,
           "passkey": run_passkey}


def compose_eval(overrides=None) -> DictConfig:
    """The ``python -m falcon_lab.evaluate`` config with ``overrides``, without running Hydra's app."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    gh = GlobalHydra.instance()
    if gh.is_initialized():
        gh.clear()
    with initialize_config_module(config_module="falcon_lab.configs", version_base="1.3"):
        return compose(config_name="evaluate", overrides=list(overrides or []))


def check_config(ecfg):
    if OmegaConf.is_missing(ecfg, "ckpt") or not ecfg.get("ckpt"):
        raise EvalConfigError("ckpt: required (a checkpoint written by python -m falcon_lab.fit), "
                              "e.g. ckpt=outputs/.../checkpoints/last.ckpt")
    if not os.path.isfile(str(ecfg.ckpt)):
        raise EvalConfigError(f"ckpt: no file at {ecfg.ckpt!r}")
    suites = list(ecfg.suites) if not isinstance(ecfg.suites, str) else [ecfg.suites]
    bad = [s for s in suites if s not in SUITES]
    if bad or not suites:
        raise EvalConfigError(f"suites: unknown {bad}; choose from {list(SUITES)}")
    dt = ecfg.get("dtype")
    if dt is not None and not (isinstance(getattr(torch, str(dt), None), torch.dtype)
                               and getattr(torch, str(dt)).is_floating_point):
        raise EvalConfigError(f"dtype: {dt!r} is not a floating-point torch dtype; use null (the checkpoint's "
                              "float32), float32, bfloat16 or float16")
    if int(ecfg.batch_size) < 1:
        raise EvalConfigError(f"batch_size={ecfg.batch_size}: must be >= 1")
    return suites


TASK_DATA = ("addition", "mqar")  # synthetic-task checkpoints (data.name): no natural language


def suite_misfits(suites, train_cfg) -> dict[str, str]:
    """{suite: why it does not fit this checkpoint}, from the training config the checkpoint records
    (``data.name``: lm = text, addition, mqar). Empty when the checkpoint records none."""
    try:
        data = train_cfg.data
        name = data.get("name")
    except Exception:
        return {}
    if not name:
        return {}
    what = f"the checkpoint was trained on data.name={name!r}"
    if name == "lm":
        what += f" (text{', ' + str(data.get('path') or data.get('hf_name')) if data.get('path') or data.get('hf_name') else ''})"
    out = {}
    for s in suites:
        if s in TASK_DATA and name != s:
            out[s] = f"{what}, not {s}: it never saw the task's format, so it would score ~0"
        elif s in ("lm_eval", "passkey") and name in TASK_DATA:
            out[s] = f"{what}, a synthetic task without natural language: {s} needs a language model"
    return out


def evaluate(ecfg: DictConfig) -> dict:
    """Run the suites of an evaluate config. Returns {"metrics", "run_id", "out_dir", "tracking_uri",
    "results"}."""
    suites = check_config(ecfg)
    from falcon_lab.training import load_checkpoint
    from falcon_lab.training.validate import ConfigError
    torch.manual_seed(int(ecfg.seed))
    try:
        model, tok, train_cfg = load_checkpoint(str(ecfg.ckpt))
    except ConfigError as e:  # not a checkpoint, or one that would run code: refused, naming ckpt
        raise EvalConfigError(str(e)) from None
    misfit = suite_misfits(suites, train_cfg) if ecfg.get("fit_check", True) else {}
    if misfit:  # refused before any work, not zeros after minutes
        raise EvalConfigError("suites that do not fit this checkpoint:\n" + "\n".join(
            f"  {s}: {why}" for s, why in misfit.items()) + "\nDrop them from suites=, or run them anyway "
            "with fit_check=false.")
    dev = _device(ecfg.get("device", "auto"))
    model = model.to(dev)
    if ecfg.get("dtype"):
        model = model.to(getattr(torch, str(ecfg.dtype)))
    model.eval()
    ckpt = Path(str(ecfg.ckpt)).resolve()
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    if ecfg.get("out_dir"):
        out = Path(str(ecfg.out_dir)).expanduser().resolve()
    elif ckpt.parent.name == "checkpoints":
        out = ckpt.parent.parent / "eval" / stamp
    else:
        out = Path.cwd() / "outputs" / "eval" / stamp
    out.mkdir(parents=True, exist_ok=True)
    sink = MlflowSink(ecfg, train_cfg, str(ckpt)) if ecfg.mlflow.get("enabled", True) else None
    all_metrics, all_results = {}, {}
    try:
        if sink is not None:
            sink.set_tag("eval.last_ckpt", str(ckpt))
            sink.set_tag("eval.suites", ",".join(suites))
        for s in suites:
            t0 = time.time()
            with torch.no_grad():
                metrics, result, table, pngs, tags = RUNNERS[s](model, tok, train_cfg, ecfg, out)
            metrics[f"eval_time_s/{s}"] = time.time() - t0
            result = {"suite": s, "ckpt": str(ckpt), "result": result, "metrics": metrics}
            js = _dump(result, out / f"{s}.json")
            print(f"\n== {s} ({time.time() - t0:.1f} s) ==\n{table}", flush=True)
            all_metrics.update(metrics)
            all_results[s] = result
            if sink is not None:
                sink.log_metrics(metrics)
                if s == "ppl":  # the loss-vs-position curves as metric histories (step = position)
                    for k, v in result["result"].items():
                        if isinstance(v, dict) and "buckets" in v:
                            for pos, val in v["buckets"]:
                                sink.log_metrics({f"extrap/{v['name']}/loss_at_position": val}, step=int(pos))
                for k, v in tags.items():
                    sink.set_tag(k, v)
                for f in [js] + pngs:
                    sink.log_artifact(str(f), "eval")
    finally:
        if sink is not None:
            sink.close()
    _dump({"ckpt": str(ckpt), "metrics": all_metrics}, out / "summary.json")
    if sink is not None:
        print(f"\n[falcon_lab] metrics logged to MLflow run {sink.run_id} ({sink.uri})"
              f"{' (new run)' if sink.created else ' (the training run)'}")
    print(f"[falcon_lab] results in {out}", flush=True)
    return {"metrics": all_metrics, "run_id": sink.run_id if sink else None, "out_dir": str(out),
            "tracking_uri": sink.uri if sink else None, "results": all_results}
