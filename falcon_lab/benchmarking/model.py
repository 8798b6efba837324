"""Whole-model benchmark: `python -m falcon_lab.bench model`.

For each mixer, the decoder is built through the platform's own config path (Hydra compose of the
packaged `train` config + `falcon_lab.models.build_model`), then measured:

- training: tokens/s of forward + backward + AdamW step (fused on CUDA) after warm-up, a fixed number of
  tokens per step (batch = tokens_per_step // seq_len), median over timed steps; peak memory
  (torch.cuda.max_memory_allocated, CUDA only); MFU = 3 * flops_per_token(seq_len) * tokens/s / peak, with
  the dense bf16 peak of `falcon_lab.training.callbacks.device_peak_flops` (or `--peak-flops`);
- decoding: prefill time of a context (median over repeats), then per-token latency of greedy
  `model.step` after that context (median over N steps), eager or (`--cuda-graphs`) one decode step
  captured in a CUDA graph; state / KV-cache bytes per sequence measured from the tensors the model
  actually holds after prefill, with the analytic `state_numel(1, ctx)` recorded beside it.

Every measurement is a row {"mixer", "variant", "preset", "seq_len", "batch", "metric", "value", "unit", ...};
an OOM or any other error is recorded as a row with "error" and the run continues.
Choices marked (ours) are not fixed by the issue or the paper.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
import traceback
from pathlib import Path

import torch

from falcon_lab.models.graph_step import GraphStep, state_leaves

log = logging.getLogger(__name__)

# name -> Hydra overrides of the packaged train config (the same groups `python -m falcon_lab.fit` uses)
MIXERS: dict[str, list[str]] = {
    **{f"falcon-{v}": ["mixer=falcon", f"mixer.variant={v}", "mixer.preset='.3'"]
       + (["mixer.window=4"] if v in ("3", "3A") else []) for v in ("1", "2", "3", "1A", "2A", "3A")},
    "transformer": ["mixer=attention"],
    "deltanet": ["mixer=deltanet"],
    "gated_deltanet": ["mixer=gated_deltanet"],
    "mamba2": ["mixer=mamba2"],
    "retnet": ["mixer=retnet"],
}
FLA_DELTANET = "fla_deltanet"  # fla's DeltaNetForCausalLM (needs fla + transformers + CUDA)
DEFAULT_MIXERS = list(MIXERS) + [FLA_DELTANET]
VOCAB = 50304  # ours: GPT-2's 50257 padded to a multiple of 64, as in the issue's anchors


# ---------------------------------------------------------------------------------------------------
def _commit() -> str:
    from falcon_lab.training.mlflow import git_info

    g = git_info()
    return g["git_commit"] + ("-dirty" if g["git_dirty"] == "true" else "")


def gpu_slug(device: torch.device) -> str:
    """`h200` for "NVIDIA H200", `cpu` on CPU."""
    return name_slug(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")


def name_slug(gpu_name: str) -> str:
    if gpu_name == "cpu":
        return "cpu"
    name = gpu_name.lower().replace("nvidia", "").strip()
    words = [w for w in "".join(c if c.isalnum() else " " for c in name).split()]
    return "_".join(words[:2]) or "cuda"


def parse_mixers(spec) -> list[str]:
    names = DEFAULT_MIXERS if spec in (None, "", "all") else [s.strip() for s in str(spec).split(",") if s.strip()]
    bad = [n for n in names if n not in MIXERS and n != FLA_DELTANET]
    if bad:
        raise ValueError(f"--mixers: unknown mixer(s) {bad}; choose from {DEFAULT_MIXERS}")
    return names


def build(name: str, size: str, vocab: int = VOCAB, extra: tuple = ()):
    """(model, cfg) for a platform mixer, through compose() + build_model() + parallelize() (model.compile
    true compiles the blocks, as training does); `extra`: more overrides."""
    from falcon_lab.models import build_model
    from falcon_lab.models.parallelize import parallelize
    from falcon_lab.training.config import compose
    from falcon_lab.training.module import mup_width_mult

    cfg = compose([f"model={size}"] + MIXERS[name] + list(extra))
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(cfg, resolve=True)
    model = build_model(c["model"], c["mixer"], vocab, logit_scale=1.0 / mup_width_mult(c["model"], c["optim"]))
    parallelize(model, compile=c["model"].get("compile") is True,
                activation_checkpointing=bool(c["model"].get("activation_checkpointing", False)))
    return model, cfg


def build_fla_deltanet(size: str, vocab: int = VOCAB, device=None):
    """fla's DeltaNetForCausalLM at the same width/depth/heads as the platform preset (ours: fla defaults
    for everything else). Raises RuntimeError(reason) where it cannot run."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        raise RuntimeError("not run: fla's DeltaNetForCausalLM needs CUDA (Triton kernels)")
    try:
        import transformers  # noqa: F401
        from fla.models import DeltaNetConfig, DeltaNetForCausalLM
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"not run: fla/transformers import failed: {type(e).__name__}: {e}") from e
    from falcon_lab.models import SIZE_PRESETS
    from falcon_lab.models.decoder import swiglu_hidden

    p = SIZE_PRESETS[size]
    # same width, depth, heads, tied embeddings and SwiGLU width as the platform's model (ours); logits are
    # returned (no fused loss) so the loss is computed exactly as for the platform's models
    cfg = DeltaNetConfig(hidden_size=p["d_model"], num_hidden_layers=p["n_layers"], num_heads=p["n_heads"],
                         vocab_size=vocab, tie_word_embeddings=True, hidden_ratio=None,
                         intermediate_size=swiglu_hidden(p["d_model"]), use_cache=False,
                         fuse_cross_entropy=False, fuse_linear_cross_entropy=False)
    return DeltaNetForCausalLM(cfg)


def mixer_labels(name: str, cfg) -> dict:
    if cfg is None:
        return {"mixer": name, "variant": None, "preset": None}
    m = cfg.mixer
    if m.name == "falcon":
        return {"mixer": name, "variant": f"Falcon-{m.variant}", "preset": str(m.preset)}
    return {"mixer": name, "variant": None, "preset": None}


def _label(name: str, cuda_graphs: bool, compiled: bool = False, static_kv: bool = False,
           loss_tag: str | None = None) -> str:
    """Row label: `<mixer>+graph` for a --cuda-graphs run, `<mixer>+compile` for compiled blocks,
    `transformer+statickv` for --static-kv and `+<impl>-loss` for a loss other than the default (ours), so
    such rows of one mixer live side by side with the eager ones in one results file, table and plot."""
    return (name + ("+statickv" if static_kv and name == "transformer" else "") + ("+compile" if compiled and name != FLA_DELTANET else "")
            + (f"+{loss_tag}-loss" if loss_tag else "") + ("+graph" if cuda_graphs else ""))


def _tagged(label: str, tag: str | None) -> str:
    return f"{label}+{tag}" if tag else label


def _default_loss_impl() -> str:
    from falcon_lab.training.config import compose

    return str(compose(["model=tiny"]).model.get("loss_impl", "chunked"))


# ---------------------------------------------------------------------------------------------------
class _Timer:
    """Wall-clock seconds of a region: CUDA events on CUDA, perf_counter (after sync) elsewhere."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
            torch.cuda.synchronize()
            self.s = self.a.elapsed_time(self.b) / 1e3
        else:
            self.s = time.perf_counter() - self.t0
        return False


def _autocast(device, bf16: bool):
    if device.type == "cuda" and bf16:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


def _logits(model, ids):
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def train_loss(model, x, y):
    """Mean next-token NLL through the platform's one loss path (falcon_lab/models/loss.py): platform
    models compute it inside their forward; fla's model gives its backbone's hidden states to the same
    function with its own output embedding, so every model is timed with the same loss."""
    if hasattr(model, "loss_impl"):
        nll, n = model(x, labels=y)
    else:  # a Hugging Face causal LM (fla): backbone, then our loss with its LM head
        from falcon_lab.models.loss import lm_nll

        h = model.model(input_ids=x).last_hidden_state
        nll, n = lm_nll(h, model.lm_head.weight, y, impl=model.falcon_loss_impl)
    return nll / n.clamp(min=1)


def bench_train(model, device, seq_len, tokens_per_step, steps, warmup, vocab, bf16=True, peak_flops=None,
                profile_out=None):
    """Median tokens/s of forward+backward+AdamW; returns a dict of measurements. profile_out: a dict
    that receives the CUDA-time breakdown of one more step (falcon_lab/benchmarking/profile.py)."""
    B = max(1, tokens_per_step // seq_len)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                            **({"fused": True} if device.type == "cuda" else {}))
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab, (B, seq_len + 1), generator=g).to(device)
    x, y = ids[:, :-1], ids[:, 1:]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)

    def one_step():
        with _autocast(device, bf16):
            loss = train_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times = []
    for i in range(warmup + steps):
        with _Timer(device) as t:
            loss = one_step()
        if i >= warmup:
            times.append(t.s)
        if not math.isfinite(float(loss.detach())):
            raise RuntimeError(f"training loss is {float(loss.detach())}")
    if profile_out is not None:
        from falcon_lab.benchmarking.profile import profile_step

        profile_out.update(profile_step(one_step, device))
    med = statistics.median(times)
    out = {"batch": B, "tokens_per_s": B * seq_len / med, "step_s": med, "n_timed": len(times)}
    if device.type == "cuda":
        out["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
    fpt = model.flops_per_token(seq_len) if hasattr(model, "flops_per_token") else None
    if fpt is not None:
        out["flops_per_token_fwd"] = float(fpt)
        if peak_flops:
            out["mfu"] = 3.0 * fpt * out["tokens_per_s"] / peak_flops
    del opt
    model.zero_grad(set_to_none=True)
    return out


# ---- decode state helpers: falcon_lab.models.graph_step (shared with generation) -----------------------
def state_bytes(state) -> int:
    return int(sum(t.numel() * t.element_size() for t in state_leaves(state, []) if torch.is_tensor(t)))


@torch.no_grad()
def prefill(model, ids, chunk_tokens: int | None = None, state=None):
    """`Decoder.prefill` with the LM head on the last position only (ours, as serving engines do: full-context
    logits at 64k x 16 rows x 50304 would need ~100 GB and measure the head, not the mixer), optionally in
    segments of `chunk_tokens` positions with the state carried (bounded activation memory). Returns
    (last logits [B, V], state)."""
    if not hasattr(model, "blocks"):
        logits, state = model.prefill(ids)
        return logits[:, -1], state
    logits, state = model.prefill(ids, state=state, chunk_tokens=chunk_tokens, last_only=True)
    return logits[:, -1], state


@torch.no_grad()
def bench_decode(model, device, ctx, batch, steps, warmup, vocab, bf16=True, prefill_reps=1, cuda_graphs=False,
                 prefill_chunk=None, static_kv=False):
    """Prefill `ctx` tokens for `batch` rows (median seconds over repeats), then greedy per-token decode
    latency (median ms over `steps`). Returns a dict."""
    model.eval()
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, vocab, (batch, ctx), generator=g).to(device)
    times, state, last = [], None, None
    for _ in range(max(1, prefill_reps)):
        state = last = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with _Timer(device) as t, _autocast(device, bf16):
            st0 = model.init_state(batch, device, max_len=ctx + warmup + steps + 4) if static_kv else None
            last, state = prefill(model, ids, prefill_chunk, st0)
        times.append(t.s)
    out = {"prefill_s": statistics.median(times), "prefill_tokens_per_s": batch * ctx / statistics.median(times),
           "state_bytes_per_seq": state_bytes(state) / batch}
    if hasattr(model, "state_numel"):
        out["state_numel_per_seq"] = int(model.state_numel(1, ctx))
    tok = last.argmax(-1)
    mode, reason = "eager", None
    step_fn = None
    if cuda_graphs and device.type == "cuda":
        try:
            with _autocast(device, bf16):
                gs = GraphStep(model, tok, state)
            step_fn, mode = gs, "cuda_graph"
        except Exception as e:  # noqa: BLE001  (recorded, eager fallback)
            reason = f"{type(e).__name__}: {str(e)[:300]}"
            torch.cuda.synchronize()
    elif cuda_graphs:
        reason = "CUDA graphs need a CUDA device"
    lat = []
    for i in range(warmup + steps):
        with _Timer(device) as t:
            if step_fn is not None:
                step_fn()
            else:
                with _autocast(device, bf16):
                    logits, state = model.step(tok, state)
                tok = logits.argmax(-1)
        if i >= warmup:
            lat.append(t.s)
    out["decode_ms_per_token"] = statistics.median(lat) * 1e3
    out["decode_tokens_per_s"] = batch / statistics.median(lat)
    out["decode_mode"] = mode
    if reason:
        out["cuda_graph_fallback"] = reason
    return out


# ---------------------------------------------------------------------------------------------------
def _err(e) -> str:
    if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
        return f"OOM: {str(e).splitlines()[0][:200]}"
    return f"{type(e).__name__}: {str(e)[:300]}"


def _cleanup(device):
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


GPU_TOKENS_PER_STEP = 32768  # issue 7's protocol
CPU_TOKENS_PER_STEP = 2048  # ours: a CPU smoke run of the harness, not a measurement to compare


def run(mixers, size="small", seq_lens=(2048, 8192, 32768), tokens_per_step=None, contexts=(1024, 4096, 16384, 65536),
        batches=(1, 16), steps=10, warmup=3, decode_steps=50, out="benchmarks/results", device=None,
        cuda_graphs=False, use_mlflow=False, peak_flops=None, vocab=VOCAB, prefill_reps=2, bf16=True, prefill_chunk=None,
        tracking_uri=None, verbose=True, fresh=False, compiled=None, static_kv=False, loss_impl=None,
        profile=False, overrides=(), tag=None):
    """Run the benchmark; writes model_<slug>.json after every mixer, PNG plots and model_<slug>.md.
    tokens_per_step None: GPU_TOKENS_PER_STEP on CUDA, CPU_TOKENS_PER_STEP on CPU. compiled None: the
    training default (model.compile=auto: compiled on CUDA, eager on CPU). loss_impl None: the model
    config's default (model.loss_impl); another value labels the rows `+<impl>-loss`. profile: one more
    training step per mixer at the first length under torch.profiler (rows `train_profile_ms`). Returns the
    result dict. overrides: more Hydra overrides for the platform's models (e.g. mixer.module_backend=torch),
    with `tag` appended to their labels (`<mixer>+<tag>`) so such rows stand beside the default ones."""
    from falcon_lab.training.callbacks import device_peak_flops

    mixers = parse_mixers(",".join(mixers) if isinstance(mixers, (list, tuple)) else mixers)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    from falcon_lab.models.loss import LOSS_IMPLS

    if loss_impl is not None and loss_impl not in LOSS_IMPLS:
        raise ValueError(f"--loss-impl: {loss_impl!r} is not one of {LOSS_IMPLS}")
    if compiled is None:
        from falcon_lab.training.api import resolve_compile

        compiled = resolve_compile("auto", device.type)
    default_loss = _default_loss_impl()
    loss_tag = loss_impl if loss_impl not in (None, default_loss) else None
    if overrides and not tag:
        raise ValueError("--override needs --tag (a label suffix for the rows it changes)")
    peak = device_peak_flops(peak_flops) if (device.type == "cuda" or peak_flops) else None
    if tokens_per_step is None:
        tokens_per_step = _default_tokens_per_step(device)
    res = _result_header(device, size, vocab, tokens_per_step, bf16, peak, cuda_graphs, prefill_chunk, compiled,
                         loss_impl or default_loss)
    slug = gpu_slug(device)
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    jpath = outdir / f"model_{slug}.json"
    graphs = bool(cuda_graphs and device.type == "cuda")  # rows labelled <mixer>+graph (CPU: eager anyway)

    def label(name):
        return _tagged(_label(name, graphs, compiled, static_kv, loss_tag), tag)

    if jpath.exists() and not fresh:
        res["rows"] = _previous_rows(jpath, res, {label(n) for n in mixers})
    for name in mixers:
        mrows = []
        try:
            model, cfg, labels = _build_for_bench(name, size, vocab, device, compiled, loss_impl, default_loss,
                                                  overrides, label(name))
        except RuntimeError as e:
            if str(e).startswith("not run:"):
                add = _row_adder({"mixer": label(name), "variant": None, "preset": None}, res["commit"],
                                 mrows, res["rows"])
                add(None, None, "not_run", None, None, error=str(e))
                _log(verbose, f"[bench model] {name}: {e}")
                continue
            raise
        add = _row_adder(labels, res["commit"], mrows, res["rows"])
        _log(verbose, f"[bench model] {name}: {labels['params'] / 1e6:.1f}M params on {device}")
        _train_rows(model, add, device, seq_lens, tokens_per_step, steps, warmup, vocab, bf16, peak, profile,
                    verbose)
        _decode_rows(model, add, device, contexts, batches, decode_steps, warmup, vocab, bf16, prefill_reps,
                     cuda_graphs, prefill_chunk, static_kv and name == "transformer", verbose)
        del model
        _cleanup(device)
        jpath.write_text(json.dumps(res, indent=1))
        if use_mlflow:
            try:
                log_mlflow(name, cfg, labels, mrows, res, size, tracking_uri)
            except Exception as e:  # noqa: BLE001
                _log(verbose, f"  mlflow logging failed: {_err(e)}")
    _write_results(res, jpath, outdir, slug, verbose)
    return res


def _default_tokens_per_step(device) -> int:
    """GPU_TOKENS_PER_STEP on CUDA, CPU_TOKENS_PER_STEP elsewhere (logged on CPU)."""
    tokens_per_step = GPU_TOKENS_PER_STEP if device.type == "cuda" else CPU_TOKENS_PER_STEP
    if device.type == "cpu":  # 32768 tokens x 50304 logits is 6.6 GB of fp32 logits alone
        log.info("CPU: %d tokens per step (the GPU default is %d; set --tokens-per-step to change)",
                 tokens_per_step, GPU_TOKENS_PER_STEP)
    return tokens_per_step


def _result_header(device, size, vocab, tokens_per_step, bf16, peak, cuda_graphs, prefill_chunk, compiled,
                   loss_impl) -> dict:
    """The result dict's run-wide fields (GPU, versions, commit, settings) with no rows yet."""
    try:
        import triton

        triton_v = triton.__version__
    except Exception:  # noqa: BLE001
        triton_v = None
    return {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton_v, "commit": _commit(), "size": size,
            "vocab": vocab, "tokens_per_step": tokens_per_step, "bf16_autocast": bool(bf16 and device.type == "cuda"),
            "peak_flops": peak, "cuda_graphs": bool(cuda_graphs), "prefill_chunk": prefill_chunk,
            "compile": bool(compiled), "loss_impl": loss_impl, "rows": []}


def _previous_rows(jpath: Path, res: dict, labelled: set) -> list:
    """Rows of an earlier result file to keep: all but those of the row labels measured now."""
    # ours: runs accumulate. Rows of mixers not measured now are kept (each row carries its commit),
    # so a long run split by --mixers, or an interrupted one re-run for the missing mixers, ends in
    # one file; a mixer measured again replaces its rows. Other sizes/devices/vocabularies are refused.
    try:
        old = json.loads(jpath.read_text())
    except ValueError as e:
        raise ValueError(f"--out: {jpath} is not valid JSON ({e}); use --fresh to overwrite it") from None
    for key in ("size", "vocab", "tokens_per_step", "gpu"):
        if old.get(key) != res[key]:
            raise ValueError(f"--out: {jpath} holds {key}={old.get(key)!r}, this run has {res[key]!r}; "
                             "use another --out or --fresh")
    return [r for r in old.get("rows", []) if r.get("mixer") not in labelled]


def _build_for_bench(name, size, vocab, device, compiled, loss_impl, default_loss, overrides, label):
    """(model on `device`, cfg or None for fla's model, row labels with "params") for one mixer; loss_impl
    None: `default_loss`. Raises RuntimeError("not run: ...") where the model cannot run here."""
    cfg = None
    labels = {"mixer": label, "variant": None, "preset": None}
    if name == FLA_DELTANET:
        # fla's model runs as fla ships it (eager, its own fused modules), with the platform's loss
        model = build_fla_deltanet(size, vocab, device)
        model.falcon_loss_impl = loss_impl or default_loss
    else:
        model, cfg = build(name, size, vocab, (f"model.compile={str(bool(compiled)).lower()}",)
                           + ((f"model.loss_impl={loss_impl}",) if loss_impl else ()) + tuple(overrides))
        labels = {**mixer_labels(name, cfg), "mixer": label}
        if overrides:
            labels["overrides"] = list(overrides)
    model = model.to(device)
    labels["params"] = int(sum(p.numel() for p in model.parameters()))
    return model, cfg, labels


def _row_adder(labels, commit, *sinks):
    """add(seq_len, batch, metric, value, unit, **extra): one result row, appended to every list in `sinks`."""
    def add(seq_len, batch, metric, value, unit, **extra):
        r = {**labels, "seq_len": seq_len, "batch": batch, "metric": metric, "value": value, "unit": unit,
             "commit": commit, **extra}
        for rows in sinks:
            rows.append(r)

    return add


def _train_rows(model, add, device, seq_lens, tokens_per_step, steps, warmup, vocab, bf16, peak, profile, verbose):
    """Training rows of one model, one sequence length at a time; an error is recorded as a row."""
    for T in seq_lens:
        B = max(1, tokens_per_step // T)
        try:
            prof = {} if (profile and T == seq_lens[0]) else None
            r = bench_train(model, device, T, tokens_per_step, steps, warmup, vocab, bf16, peak, prof)
            if prof:
                add(T, B, "train_profile_ms", prof["total_ms"], "ms", **prof)
                from falcon_lab.benchmarking.profile import top_kernels_lines

                _log(verbose, f"  profile T={T}: {prof['total_ms']:.1f} ms of CUDA kernels; the top ones:\n"
                     + "\n".join(top_kernels_lines(prof)))
            bk = {"backend": ",".join(model.backends_used())} if hasattr(model, "backends_used") else {}
            add(T, B, "train_tokens_per_s", r["tokens_per_s"], "tokens/s", step_s=r["step_s"], n_timed=r["n_timed"],
                **bk)
            if "peak_mem_bytes" in r:
                add(T, B, "train_peak_mem_bytes", r["peak_mem_bytes"], "bytes")
            if "mfu" in r:
                add(T, B, "train_mfu", r["mfu"], "fraction", flops_per_token_fwd=r["flops_per_token_fwd"],
                    peak_flops=peak)
            _log(verbose, f"  train T={T} B={B}: {r['tokens_per_s']:.0f} tok/s"
                 + (f", MFU {r['mfu']:.3f}" if "mfu" in r else "")
                 + (f", peak {r['peak_mem_bytes'] / 2**30:.1f} GiB" if "peak_mem_bytes" in r else ""))
        except Exception as e:  # noqa: BLE001  OOM or any error: recorded, continue
            add(T, B, "train_tokens_per_s", None, "tokens/s", error=_err(e))
            _log(verbose, f"  train T={T} B={B}: error {_err(e)}")
            if verbose and not isinstance(e, torch.OutOfMemoryError):
                traceback.print_exc()
        finally:
            model.zero_grad(set_to_none=True)
            _cleanup(device)


def _decode_rows(model, add, device, contexts, batches, decode_steps, warmup, vocab, bf16, prefill_reps,
                 cuda_graphs, prefill_chunk, static_kv, verbose):
    """Prefill/decode rows of one model for every (context, batch); an error is recorded as a row."""
    if not hasattr(model, "step"):
        for ctx in contexts:
            for b in batches:
                add(ctx, b, "decode_ms_per_token", None, "ms",
                    error="not run: the model has no init_state/step decode API (ours: platform models only)")
        return
    for ctx in contexts:
        for b in batches:
            try:
                r = bench_decode(model, device, ctx, b, decode_steps, warmup, vocab, bf16, prefill_reps,
                                 cuda_graphs, prefill_chunk, static_kv)
                extra = {"decode_mode": r["decode_mode"]}
                if prefill_chunk:
                    extra["prefill_chunk"] = int(prefill_chunk)
                if "cuda_graph_fallback" in r:
                    extra["cuda_graph_fallback"] = r["cuda_graph_fallback"]
                pc = {"prefill_chunk": int(prefill_chunk)} if prefill_chunk else {}
                add(ctx, b, "prefill_s", r["prefill_s"], "s", **pc)
                add(ctx, b, "prefill_tokens_per_s", r["prefill_tokens_per_s"], "tokens/s", **pc)
                add(ctx, b, "decode_ms_per_token", r["decode_ms_per_token"], "ms", **extra)
                add(ctx, b, "decode_tokens_per_s", r["decode_tokens_per_s"], "tokens/s", **extra)
                add(ctx, b, "state_bytes_per_seq", r["state_bytes_per_seq"], "bytes",
                    state_numel_per_seq=r.get("state_numel_per_seq"))
                _log(verbose, f"  decode ctx={ctx} B={b}: prefill {r['prefill_s'] * 1e3:.1f} ms, "
                     f"{r['decode_ms_per_token']:.2f} ms/token ({r['decode_mode']}), "
                     f"state {r['state_bytes_per_seq'] / 2**20:.2f} MiB/seq")
            except Exception as e:  # noqa: BLE001
                add(ctx, b, "decode_ms_per_token", None, "ms", error=_err(e))
                _log(verbose, f"  decode ctx={ctx} B={b}: error {_err(e)}")
            finally:
                _cleanup(device)


def _write_results(res, jpath: Path, outdir: Path, slug: str, verbose: bool):
    """The final model_<slug>.json, model_<slug>.md and plots (their paths go into res["plots"])."""
    jpath.write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (outdir / f"model_{slug}.md").write_text(md)
    res["plots"] = plot(res, outdir, slug)
    jpath.write_text(json.dumps(res, indent=1))
    if verbose:
        print(md)
        log.info("wrote %s", jpath)


def _log(verbose, msg):
    if verbose:
        print(msg, flush=True)


# ---- MLflow ---------------------------------------------------------------------------------------
def log_mlflow(name, cfg, labels, rows, res, size, tracking_uri=None):
    """One MLflow run per mixer in the training runs' experiment, tagged like them (mixer, variant,
    preset, model, git) plus benchmark=model; metrics `bench/<metric>/T<seq_len>_B<batch>`."""
    import mlflow

    from falcon_lab.training.mlflow import git_info, resolve_artifact_location, resolve_tracking_uri, run_tags

    from falcon_lab.training.config import compose

    if cfg is None:
        cfg = compose([f"model={size}"])
        tags = {"mixer": name, "model": size, **git_info()}
    else:
        tags = run_tags(cfg)
    tags.update({"benchmark": "model", "data": "random token ids (benchmark)", "gpu": res["gpu"], "torch": res["torch"], "triton": str(res["triton"])})
    uri = tracking_uri or resolve_tracking_uri(cfg.logger)
    client = mlflow.MlflowClient(uri)
    exp_name = str(cfg.logger.experiment_name)
    exp = client.get_experiment_by_name(exp_name)
    exp_id = exp.experiment_id if exp else client.create_experiment(
        exp_name, artifact_location=resolve_artifact_location(uri, cfg.logger))
    run = client.create_run(exp_id, tags=tags, run_name=f"bench-{name}-{size}")
    rid = run.info.run_id
    try:
        client.log_param(rid, "bench.tokens_per_step", res["tokens_per_step"])
        client.log_param(rid, "bench.cuda_graphs", res["cuda_graphs"])
        for r in rows:
            if r["value"] is None:
                continue
            key = f"bench/{r['metric']}/T{r['seq_len']}_B{r['batch']}"
            client.log_metric(rid, key, float(r["value"]))
        errs = [f"{r['metric']} T={r['seq_len']} B={r['batch']}: {r['error']}" for r in rows if r.get("error")]
        if errs:
            client.set_tag(rid, "bench_errors", "\n".join(errs)[:4900])
        client.log_text(rid, json.dumps(rows, indent=1), "bench_rows.json")
        client.set_terminated(rid, "FINISHED")
    except Exception:
        client.set_terminated(rid, "FAILED")
        raise
    return rid


# ---- tables and plots -------------------------------------------------------------------------------
def _fmt(v, unit):
    if v is None:
        return "—"
    if unit == "bytes":
        return f"{v / 2**20:.2f} MiB"
    if unit == "fraction":
        return f"{v:.3f}"
    if unit == "tokens/s":
        return f"{v / 1e3:.1f}k"
    if unit == "s":
        return f"{v * 1e3:.1f} ms"
    return f"{v:.3g}"


TABLES = [("train_tokens_per_s", "Training tokens/s (fwd+bwd+AdamW)"),
          ("train_mfu", "Training MFU"),
          ("train_peak_mem_bytes", "Training peak memory"),
          ("prefill_s", "Prefill time"),
          ("decode_ms_per_token", "Decode latency per token (ms)"),
          ("state_bytes_per_seq", "State / KV-cache bytes per sequence")]


def _commit_label(res) -> str:
    c = str(res.get("commit", ""))
    return c if " " in c else c[:12]  # a merged file lists every commit its rows came from


def markdown(res) -> str:
    lines = [f"# Whole-model benchmark ({res['gpu']}, torch {res['torch']}, triton {res['triton']}, "
             f"commit {_commit_label(res)}, size {res['size']})", ""]
    mixers = list(dict.fromkeys(r["mixer"] for r in res["rows"]))
    for metric, title in TABLES:
        rows = [r for r in res["rows"] if r["metric"] == metric]
        if not rows:
            continue
        cols = list(dict.fromkeys((r["seq_len"], r["batch"]) for r in rows))
        lines += [f"## {title}", "", "| mixer | " + " | ".join(f"T={t} B={b}" for t, b in cols) + " |",
                  "|---" * (len(cols) + 1) + "|"]
        for m in mixers:
            cell = {(r["seq_len"], r["batch"]): r for r in rows if r["mixer"] == m}
            if not cell:
                continue
            vals = []
            for c in cols:
                r = cell.get(c)
                vals.append("" if r is None else ("error" if r.get("error") else _fmt(r["value"], r["unit"])))
            lines.append(f"| {m} | " + " | ".join(vals) + " |")
        lines.append("")
    lines += ratios(res)
    lines += profile_table(res)
    errs = [r for r in res["rows"] if r.get("error")]
    if errs:
        lines += ["## Not run / errors", ""]
        lines += [f"- {r['mixer']} {r['metric']} T={r['seq_len']} B={r['batch']}: {r['error']}" for r in errs]
        lines.append("")
    fb = {(r["mixer"], r["cuda_graph_fallback"]) for r in res["rows"] if r.get("cuda_graph_fallback")}
    if fb:
        lines += ["## CUDA-graph fallbacks (eager used)", ""] + [f"- {m}: {why}" for m, why in sorted(fb)] + [""]
    return "\n".join(lines)


def profile_table(res) -> list[str]:
    """Share of one training step's CUDA kernel time per category (falcon_lab/benchmarking/profile.py)."""
    from falcon_lab.benchmarking.profile import CATEGORIES

    rows = [r for r in res["rows"] if r["metric"] == "train_profile_ms" and r.get("value")]
    if not rows:
        return []
    body = [(f"{r['mixer']} (T={r['seq_len']})",
             [f"{r['value']:.1f}"] + [f"{100 * r[f'{c}_share']:.0f} %" if r.get(f"{c}_share") is not None else ""
                                      for c in CATEGORIES]) for r in rows]
    return _table("Where one training step's CUDA time goes (torch.profiler)",
                  ["kernel ms"] + [c.replace("_", " ") for c in CATEGORIES], body)


def _table(title: str, cols: list[str], body: list[tuple[str, list[str]]]) -> list[str]:
    return ([f"## {title}", "", "| mixer | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
            + [f"| {m} | " + " | ".join(cells) + " |" for m, cells in body] + [""])


def _ratio(a, b, fmt="{:.2f}x") -> str:
    return fmt.format(a / b) if a and b else "—"


def ratios(res) -> list[str]:
    """The issue's target ratios, computed from this run's rows (no numbers from elsewhere)."""
    val = {(r["mixer"], r["metric"], r["seq_len"], r["batch"]): r["value"] for r in res["rows"]
           if r["value"] is not None}
    falcons = [m for m in dict.fromkeys(r["mixer"] for r in res["rows"]) if m.startswith("falcon-")]
    out = []
    tr = sorted({(r["seq_len"], r["batch"]) for r in res["rows"] if r["metric"] == "train_tokens_per_s"})
    # like against like (ours): a Transformer row is compared with Falcon rows of the same suffix (compile,
    # loss, tag), fla's model (its own eager modules) with Falcon rows of the same loss
    trained_labels = list(dict.fromkeys(r["mixer"] for r in res["rows"] if r["metric"] == "train_tokens_per_s"))
    refs = [m for m in trained_labels if m.split("+")[0] in ("transformer", FLA_DELTANET)
            and "statickv" not in m and not m.endswith("+graph")]

    def loss_of(label):
        return next((p for p in label.split("+") if p.endswith("-loss")), None)

    for ref in refs:
        if not any((ref, "train_tokens_per_s", t, b) in val for t, b in tr):
            continue
        base, suffix = ref.split("+")[0], ref[len(ref.split("+")[0]):]
        trained = [f for f in falcons if any((f, "train_tokens_per_s", t, b) in val for t, b in tr)
                   and (f[len(f.split("+")[0]):] == suffix if base == "transformer" else loss_of(f) == loss_of(ref))]
        if not trained:
            continue
        out += _table(f"Training tokens/s relative to {ref}", [f"T={t}" for t, _ in tr],
                      [(m, [_ratio(val.get((m, "train_tokens_per_s", t, b)), val.get((ref, "train_tokens_per_s", t, b)))
                            for t, b in tr]) for m in trained])
    dec = sorted({(r["seq_len"], r["batch"]) for r in res["rows"] if r["metric"] == "decode_ms_per_token"})
    decoders = list(dict.fromkeys(r["mixer"] for r in res["rows"] if r["metric"] == "decode_ms_per_token"))
    ctxs, bs = sorted({c for c, _ in dec}), sorted({b for _, b in dec})
    if len(ctxs) >= 2:
        lo, hi = ctxs[0], ctxs[-1]
        out += _table(f"Decode latency flatness: ms/token at context {hi} / at {lo}", [f"B={b}" for b in bs],
                      [(m, [_ratio(val.get((m, "decode_ms_per_token", hi, b)), val.get((m, "decode_ms_per_token", lo, b)),
                                   "{:.2f}") for b in bs]) for m in decoders])
    for ref, graph, title in (("transformer", False, "eager vs eager"),
                              ("transformer+statickv", False, "eager vs eager, static KV cache"),
                              ("transformer+statickv+graph", True, "CUDA graph vs CUDA graph")):
        # same execution mode on both sides: graph rows against a graph-captured Transformer only
        if not any((m, k) == (ref, "decode_ms_per_token") for m, k, _, _ in val):
            continue
        others = [m for m in decoders if not m.startswith("transformer") and m.endswith("+graph") == graph]
        out += _table(f"Decode speed-up over the Transformer's KV-cache decode ({title})",
                      [f"T={c} B={b}" for c, b in dec],
                      [(m, [_ratio(val.get((ref, "decode_ms_per_token", c, b)), val.get((m, "decode_ms_per_token", c, b)))
                            for c, b in dec]) for m in others])
    return out


def plot(res, outdir: Path, slug: str) -> list[str]:
    """One PNG per table: value vs sequence length / context, one line per mixer (one panel per decode
    batch size); Falcon variants solid, baselines dashed, one colour per mixer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixers = list(dict.fromkeys(r["mixer"] for r in res["rows"]))
    cmap = plt.get_cmap("tab20")
    color = {m: cmap(i % 20) for i, m in enumerate(mixers)}
    paths = []
    for metric, title in TABLES:
        rows = [r for r in res["rows"] if r["metric"] == metric and r["value"] is not None]
        if not rows:
            continue
        panels = [None] if metric.startswith("train") else sorted({r["batch"] for r in rows})
        fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels) + 2.2, 4.5), squeeze=False)
        for ax, b in zip(axes[0], panels):
            for m in mixers:
                pts = sorted((r["seq_len"], r["value"]) for r in rows if r["mixer"] == m and (b is None or r["batch"] == b))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color[m], label=m,
                            linestyle="-" if m.startswith("falcon-") else "--")
            ax.set_xscale("log", base=2)
            if metric in ("prefill_s", "state_bytes_per_seq", "decode_ms_per_token"):
                ax.set_yscale("log")
            ax.set_xlabel("sequence length" if metric.startswith("train") else "context length")
            ax.set_ylabel(f"{metric} ({rows[0]['unit']})")
            if b is not None:
                ax.set_title(f"batch {b}", fontsize=9)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.suptitle(f"{title} — {res['gpu']} · torch {res['torch']} · {_commit_label(res)} · {res['size']}",
                     fontsize=9)
        fig.tight_layout()
        p = outdir / f"model_{slug}_{metric}.png"
        fig.savefig(p, dpi=120, bbox_inches="tight")
        plt.close(fig)
        paths.append(str(p))
    return paths


def _cell(r) -> tuple:
    return (r.get("mixer"), r.get("metric"), r.get("seq_len"), r.get("batch"))


def merge_results(paths, out="benchmarks/results") -> dict:
    """Merge result files of runs split across calls or machines (same GPU kind, size, vocab, tokens per
    step): a later file's row replaces an earlier row of the same cell (mixer label, metric, seq_len,
    batch), so a call that re-measures one cell (say 64k x 16 with --prefill-chunk) keeps the rest; then
    the Markdown and plots are rewritten. The header's commit lists every row's commit."""
    if not paths:
        raise ValueError("--merge: no result files given")
    res = None
    for p in paths:
        try:
            new = json.loads(Path(p).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--merge: cannot read {p}: {e}") from None
        if res is None:
            res = new
            continue
        for key in ("size", "vocab", "tokens_per_step", "gpu"):
            if new.get(key) != res.get(key):
                raise ValueError(f"--merge: {p} has {key}={new.get(key)!r}, earlier files {res.get(key)!r}")
        cells = {_cell(r) for r in new["rows"]}
        rows = [r for r in res["rows"] if _cell(r) not in cells] + new["rows"]
        res = {**res, **{k: v for k, v in new.items() if k != "rows"}, "rows": rows}
    res.pop("plots", None)
    res["commit"] = " ".join(dict.fromkeys(str(r.get("commit")).split("-")[0][:7] for r in res["rows"]
                                          if r.get("commit")))  # every commit the rows came from
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    slug = name_slug(res["gpu"])
    jpath = outdir / f"model_{slug}.json"
    (outdir / f"model_{slug}.md").write_text(markdown(res))
    res["plots"] = plot(res, outdir, slug)
    jpath.write_text(json.dumps(res, indent=1))
    log.info("merged %d file(s), %d rows -> %s", len(paths), len(res["rows"]), jpath)
    return res


def _ints(s, flag):
    try:
        return [int(x) for x in str(s).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {s!r}") from None


def main(a):
    """Entry from falcon_lab.bench (argparse namespace)."""
    if a.merge:
        return merge_results(a.merge, a.out)
    if a.size not in ("tiny", "small", "medium"):
        raise ValueError(f"--size: unknown size {a.size!r}; choose from tiny, small, medium")
    if a.prefill_chunk is not None and a.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk: must be >= 1, got {a.prefill_chunk}")
    mixers = parse_mixers(a.mixers)
    seq_lens = _ints(a.seq_lens, "--seq-lens")
    contexts = _ints(a.contexts, "--contexts")
    batches = _ints(a.batches, "--batches")
    for flag, vals in (("--seq-lens", seq_lens), ("--contexts", contexts), ("--batches", batches)):
        if any(v <= 0 for v in vals):
            raise ValueError(f"{flag}: values must be positive, got {vals}")
    if a.device and a.device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu or cuda, got {a.device!r}")
    steps = a.steps if a.steps is not None else (2 if a.quick else 10)
    warmup = 1 if a.quick else 3
    decode_steps = a.decode_steps if a.decode_steps is not None else (3 if a.quick else 50)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.tokens_per_step is not None and a.tokens_per_step < 1:
        raise ValueError(f"--tokens-per-step: must be >= 1, got {a.tokens_per_step}")
    return run(mixers, size=a.size, seq_lens=seq_lens, tokens_per_step=a.tokens_per_step, contexts=contexts,
               batches=batches, steps=steps, warmup=warmup, decode_steps=decode_steps, out=a.out, device=a.device,
               cuda_graphs=a.cuda_graphs, use_mlflow=a.mlflow, peak_flops=a.peak_flops, vocab=a.vocab,
               prefill_reps=a.prefill_reps or (1 if a.quick else 3), fresh=a.fresh, prefill_chunk=a.prefill_chunk,
               compiled=a.compile, static_kv=a.static_kv, loss_impl=a.loss_impl, profile=a.profile,
               overrides=tuple(a.override), tag=a.tag)


def add_parser(sub):
    m = sub.add_parser("model", help="whole-model training throughput, MFU, memory, prefill and decode latency")
    m.add_argument("--size", default="small", help="model size preset: tiny | small | medium (default small)")
    m.add_argument("--mixers", default=None, help="comma-separated subset of " + ",".join(DEFAULT_MIXERS))
    m.add_argument("--seq-lens", default="2048,8192,32768", help="training sequence lengths")
    m.add_argument("--tokens-per-step", type=int, default=None,
                   help=f"batch = tokens_per_step // seq_len (default {GPU_TOKENS_PER_STEP} on CUDA, "
                        f"{CPU_TOKENS_PER_STEP} on CPU)")
    m.add_argument("--contexts", default="1024,4096,16384,65536", help="decode contexts (prefilled)")
    m.add_argument("--batches", default="1,16", help="decode batch sizes")
    m.add_argument("--steps", type=int, default=None, help="timed training steps (default 10; 2 with --quick)")
    m.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (default 50; 3 with --quick)")
    m.add_argument("--prefill-chunk", type=int, default=None,
                   help="prefill in segments of this many positions, state carried (default: whole context)")
    m.add_argument("--prefill-reps", type=int, default=None, help="prefill repeats, median (default 3; 1 with --quick)")
    m.add_argument("--out", default="benchmarks/results")
    m.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="measure nothing: merge these result files (later rows replace the same cell) into --out, redraw")
    m.add_argument("--fresh", action="store_true", help="overwrite model_<slug>.json instead of merging rows")
    m.add_argument("--quick", action="store_true", help="fewer warm-up/timed steps (smoke runs)")
    m.add_argument("--static-kv", action="store_true",
                   help="transformer: preallocated KV cache written in place (graph-capturable); rows transformer+statickv")
    m.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each block (default: on for CUDA, as model.compile=auto trains; "
                        "--no-compile for eager); compiled rows are labelled <mixer>+compile")
    m.add_argument("--loss-impl", default=None, help="LM loss: chunked | chunked_torch | materialized (default: model.loss_impl); "
                                                      "a non-default value labels rows <mixer>+<impl>-loss")
    m.add_argument("--override", action="append", default=[],
                   help="a Hydra override for the platform's models (repeatable), e.g. mixer.module_backend=torch")
    m.add_argument("--tag", default=None, help="label suffix for rows measured with --override: <mixer>+<tag>")
    m.add_argument("--profile", action="store_true",
                   help="one more training step per mixer at the first length under torch.profiler: CUDA time "
                        "in the Falcon op, fused modules, matmuls, loss, other (rows train_profile_ms)")
    m.add_argument("--cuda-graphs", action="store_true", help="capture one decode step per mixer in a CUDA graph")
    m.add_argument("--mlflow", action="store_true", help="one MLflow run per mixer (training runs' store/experiment)")
    m.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    m.add_argument("--peak-flops", type=float, default=None, help="override the dense bf16 peak for MFU (FLOP/s)")
    m.add_argument("--vocab", type=int, default=VOCAB, help=f"vocabulary size (default {VOCAB}, ours)")
    m.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return m
