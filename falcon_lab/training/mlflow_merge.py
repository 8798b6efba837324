"""Copy MLflow runs from one or more stores into another: `python -m falcon_lab.training.mlflow_merge`.

Why: runs that share one GPU (or one node) as separate processes are safest with one SQLite store
each (SQLite and MLflow's migrations do not like many writers at once); afterwards their runs are
merged into the store the team browses. A store copied from another machine still works: its
artifact URIs point at that machine's paths, so artifacts are looked up beside the copied database
(``<db folder>/artifacts/<run id>/artifacts``, the layout `resolve_artifact_location` gives).

The experiment's tags (the runs-table kind and shared views the platform sets) are copied where the
destination's experiment lacks them. Each copied run keeps its name, status, start/end times, tags, params, every metric's full step
history and its artifacts, and gets the tag ``merge.source_run_id``; copying the same store twice
adds nothing (runs already copied are skipped). Parent/child links (sweeps) are remapped.

    python -m falcon_lab.training.mlflow_merge --into sqlite:///experiments/addition/mlruns/mlflow.db \\
        run1/mlflow.db run2/mlflow.db [--experiment addition_h200] [--portable .]

``--portable ROOT`` (SQLite destinations): afterwards, artifact locations under ROOT are rewritten
relative to ROOT, so a store committed to the repository opens on any clone with
``mlflow ui --backend-store-uri sqlite:///<path>/mlflow.db`` started from ROOT (ours).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from urllib.parse import urlparse

SOURCE_TAG = "merge.source_run_id"
PARENT_TAG = "mlflow.parentRunId"

log = logging.getLogger(__name__)


def _uri(s: str) -> str:
    if "://" in s:
        return s
    p = Path(s).resolve()
    if not p.exists():
        raise FileNotFoundError(f"mlflow_merge: no store at {p}")
    return f"sqlite:///{p}"


def _local_artifacts(run, src_uri: str) -> Path | None:
    """The folder holding a source run's artifacts on this machine, or None."""
    uri = run.info.artifact_uri or ""
    if uri.startswith("file:") or uri.startswith("/"):
        p = Path(urlparse(uri).path if uri.startswith("file:") else uri)
        if p.is_dir():
            return p
    if src_uri.startswith("sqlite:///"):
        p = Path(src_uri[len("sqlite:///"):]).parent / "artifacts" / run.info.run_id / "artifacts"
        if p.is_dir():
            return p
    return None


def _chunks(xs, n):
    for i in range(0, len(xs), n):
        yield xs[i:i + n]


def copy_runs(src_uri: str, dst_uri: str, experiment_name: str | None = None, verbose: bool = True) -> list:
    """Copy every run of every non-empty experiment of `src_uri` into `dst_uri` (into `experiment_name`
    if given, else an experiment of the same name). Returns [(src_run_id, dst_run_id or None if skipped)]."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from falcon_lab.training.mlflow import resolve_artifact_location

    src, dst = MlflowClient(src_uri), MlflowClient(dst_uri)
    out = []
    for exp in src.search_experiments():
        runs = src.search_runs([exp.experiment_id], max_results=50000)
        if not runs:
            continue
        name = experiment_name or exp.name
        dexp = dst.get_experiment_by_name(name)
        dexp_id = dexp.experiment_id if dexp else dst.create_experiment(
            name, artifact_location=resolve_artifact_location(dst_uri))
        # the experiment's own tags (the runs-table kind, shared views): copied where the destination lacks them
        have = (dexp.tags if dexp else None) or {}
        for k, v in (exp.tags or {}).items():
            if k not in have and not k.startswith("mlflow.note") and k != "mlflow.experiment.sourceName":
                dst.set_experiment_tag(dexp_id, k, v)
                have[k] = v
        done = {r.data.tags[SOURCE_TAG]: r.info.run_id
                for r in dst.search_runs([dexp_id], max_results=50000) if SOURCE_TAG in r.data.tags}
        # parents before children, so parent ids can be remapped
        runs.sort(key=lambda r: (PARENT_TAG in r.data.tags, r.info.start_time or 0))
        for r in runs:
            rid = r.info.run_id
            if rid in done:
                out.append((rid, None))
                continue
            tags = {k: v for k, v in r.data.tags.items() if k != PARENT_TAG}
            tags[SOURCE_TAG] = rid
            if PARENT_TAG in r.data.tags:
                tags[PARENT_TAG] = done.get(r.data.tags[PARENT_TAG], r.data.tags[PARENT_TAG])
            new = dst.create_run(dexp_id, start_time=r.info.start_time, tags=tags, run_name=r.info.run_name)
            nid = new.info.run_id
            params = [Param(k, v) for k, v in r.data.params.items()]
            for ch in _chunks(params, 100):
                dst.log_batch(nid, params=ch)
            metrics = []
            for key in r.data.metrics:
                metrics += [Metric(m.key, m.value, m.timestamp, m.step) for m in src.get_metric_history(rid, key)]
            for ch in _chunks(metrics, 1000):
                dst.log_batch(nid, metrics=ch)
            art = _local_artifacts(r, src_uri)
            if art is not None and any(art.iterdir()):
                dst.log_artifacts(nid, str(art))
            dst.set_terminated(nid, status=r.info.status, end_time=r.info.end_time)
            done[rid] = nid
            out.append((rid, nid))
            if verbose:
                log.info("%s/%s -> %s (%s); %d params, %d metric points%s", exp.name,
                         r.info.run_name or rid, name, nid, len(params), len(metrics),
                         "" if art is not None else ", no artifacts found")
    return out


def make_portable(db: str | Path, root: str | Path) -> int:
    """Rewrite a SQLite store's run artifact URIs and experiment artifact locations that lie under
    ``root`` as paths relative to ``root`` (MLflow resolves a scheme-less artifact path against the
    working directory). Locations outside ``root`` are left alone. Returns how many were rewritten."""
    import sqlite3

    root = Path(root).resolve()

    def rel(uri: str | None) -> str | None:
        if not uri:
            return None
        path = Path(urlparse(uri).path) if uri.startswith("file:") else Path(uri)
        if not path.is_absolute():
            return None
        try:
            return path.resolve().relative_to(root).as_posix()
        except ValueError:
            return None

    n = 0
    con = sqlite3.connect(str(db))
    try:
        for table, key, col in (("runs", "run_uuid", "artifact_uri"),
                                ("experiments", "experiment_id", "artifact_location")):
            for k, uri in con.execute(f"SELECT {key}, {col} FROM {table}").fetchall():
                r = rel(uri)
                if r is not None:
                    con.execute(f"UPDATE {table} SET {col} = ? WHERE {key} = ?", (r, k))
                    n += 1
        con.commit()
    finally:
        con.close()
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+", help="source stores: mlflow.db paths or tracking URIs")
    ap.add_argument("--into", required=True, help="destination tracking URI or mlflow.db path")
    ap.add_argument("--experiment", default=None, help="put every run into this experiment")
    ap.add_argument("--portable", metavar="ROOT", default=None,
                    help="afterwards store artifact locations under ROOT relative to ROOT (SQLite only)")
    a = ap.parse_args(argv)
    from falcon_lab import logs

    logs.setup()
    dst = a.into if "://" in a.into else f"sqlite:///{Path(a.into).resolve()}"
    if dst.startswith("sqlite:///"):
        Path(dst[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    n = 0
    for s in a.sources:
        n += sum(1 for _, nid in copy_runs(_uri(s), dst, a.experiment) if nid)
    print(f"[mlflow_merge] copied {n} run(s) into {dst}")
    if a.portable:
        if not dst.startswith("sqlite:///"):
            raise SystemExit("mlflow_merge: --portable needs a SQLite destination (--into path/mlflow.db)")
        k = make_portable(dst[len("sqlite:///"):], a.portable)
        print(f"[mlflow_merge] {k} artifact location(s) made relative to {Path(a.portable).resolve()}; "
              f"open it from there: mlflow ui --backend-store-uri {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
