"""Shared scoring machinery for every suite: one batched teacher-forced scorer and one batched
greedy decoder, written against a small model protocol so any model can be evaluated.

Model protocol (what falcon_lab's decoder provides; hand-built models in tests provide it too):

- ``model(input_ids[B, T]) -> logits[B, T, V]`` (causal: position t sees tokens <= t);
- optionally ``model.init_state(batch) -> state`` and ``model.step(tokens[B], state) ->
  (logits[B, V], state)``: O(1)-per-token recurrent decoding (a KV cache for attention). Without
  them the decoder falls back to re-running the full forward each token.

Tokenizer protocol: ``encode(str) -> list[int]`` (no special tokens), ``decode(list[int]) -> str``
and the special ids; :func:`as_tokenizer` accepts the common spellings of those names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


# ---------------------------------------------------------------------------------------------
# tokenizer adapter
# ---------------------------------------------------------------------------------------------
def _first_attr(obj, names, default=None):
    for n in names:
        v = getattr(obj, n, None)
        if v is not None:
            return v
    return default


class TokenizerAdapter:
    """Uniform view of a tokenizer: ``encode``/``decode`` without specials, ``bos_id``, ``eos_id``,
    ``pad_id`` and ``vocab_size``."""

    def __init__(self, tok):
        if isinstance(tok, TokenizerAdapter):
            tok = tok.tok
        self.tok = tok
        self.bos_id = _first_attr(tok, ("bos_id", "bos_token_id", "BOS", "bos"))
        self.eos_id = _first_attr(tok, ("eos_id", "eos_token_id", "EOS", "eos"))
        self.pad_id = _first_attr(tok, ("pad_id", "pad_token_id", "PAD", "pad"), self.eos_id)
        self.vocab_size = _first_attr(tok, ("vocab_size", "n_vocab"))
        if self.eos_id is None:
            raise ValueError(f"tokenizer {type(tok).__name__} exposes no EOS id (eos_id / eos_token_id)")
        if self.bos_id is None:
            self.bos_id = self.eos_id

    def encode(self, text: str) -> list[int]:
        try:
            ids = self.tok.encode(text, add_special_tokens=False)
        except TypeError:
            try:
                ids = self.tok.encode(text, bos=False, eos=False)
            except TypeError:
                ids = self.tok.encode(text)
        return list(ids.tolist() if hasattr(ids, "tolist") else ids)

    def decode(self, ids: Sequence[int]) -> str:
        specials = {self.bos_id, self.eos_id, self.pad_id}
        return self.tok.decode([int(i) for i in ids if int(i) not in specials])


def as_tokenizer(tok) -> TokenizerAdapter:
    return tok if isinstance(tok, TokenizerAdapter) else TokenizerAdapter(tok)


def model_device(model) -> torch.device:
    for p in getattr(model, "parameters", lambda: iter(()))():
        return p.device
    return torch.device("cpu")


def has_recurrent_step(model) -> bool:
    return callable(getattr(model, "step", None)) and callable(getattr(model, "init_state", None))


# ---------------------------------------------------------------------------------------------
# teacher-forced scoring
# ---------------------------------------------------------------------------------------------
@dataclass
class ContinuationScore:
    logprob: float        # summed log-probability of the continuation tokens (fp32 log-softmax)
    is_greedy: bool       # every continuation token is the argmax given the gold prefix
    n_tokens: int
    n_correct: int        # continuation tokens that are the argmax
    token_logprobs: list[float]


def is_recurrent(model, probe_len: int = 1 << 16) -> bool:
    """True for a model whose decode state has a fixed size whatever the context (Falcon and the other
    non-attention mixers): it has ``init_state``/``step`` and ``state_numel(1, T)`` does not grow with
    T. Attention (a KV cache that grows), hybrids and models without ``state_numel`` are not."""
    fn = getattr(model, "state_numel", None)
    if not has_recurrent_step(model) or not callable(fn):
        return False
    try:
        return int(fn(1, 16)) == int(fn(1, probe_len))
    except Exception:
        return False


def _prefill(model, ids, state):
    """(logits [B, T, V], state) after ``ids`` [B, T] from ``state``: ``model.prefill`` when the model
    has it (the parallel/chunked forward), else one ``step`` per position."""
    fn = getattr(model, "prefill", None)
    if callable(fn):
        return fn(ids, state)
    outs = []
    for t in range(ids.shape[1]):
        lg, state = model.step(ids[:, t], state)
        outs.append(lg)
    return torch.stack(outs, dim=1), state


def _finish(pairs, idx, nc, lp):
    """ContinuationScore of pair ``idx`` from the log-softmax rows ``lp`` [nc, V] of its continuation."""
    gold = torch.tensor(pairs[idx][1][-nc:] if nc else [], dtype=torch.long, device=lp.device)
    tok_lp = lp.gather(-1, gold[:, None])[:, 0]
    correct = (lp.argmax(-1) == gold)
    return ContinuationScore(float(tok_lp.double().sum()), bool(correct.all()), nc, int(correct.sum()),
                             tok_lp.tolist())


def _window_pieces(ctx, cont, max_length):
    """A continuation longer than the window, scored as consecutive pieces of at most ``max_length``
    tokens, each after the ``max_length`` tokens before it (lm-eval's rolling windows): [(inp, n)]."""
    full, out = ctx + cont, []
    for a in range(0, len(cont), max_length):
        b = min(a + max_length, len(cont))
        end = len(ctx) + b
        out.append((full[:end - 1][-max_length:], b - a))
    return out


@torch.no_grad()
def score_continuations(model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                        batch_size: int = 16, max_length: int | None = None, pad_id: int = 0,
                        progress: bool = False, desc: str = "scoring",
                        carry_state: bool = False) -> list[ContinuationScore]:
    """Teacher-forced scoring of ``continuation`` after ``context`` for each (context, continuation)
    token-id pair (context must be non-empty). The input is ``(context + continuation)[:-1]``; the last
    ``len(continuation)`` positions are scored. Batches are right-padded (causal models ignore what
    follows) and sorted by length to waste little.

    Inputs longer than ``max_length``:

    - ``carry_state`` (recurrent models, :func:`is_recurrent`): the whole input is read in segments of
      ``max_length`` positions, the state carried from one to the next (``model.prefill``, else
      ``model.step``): no context limit, the exact full-context score;
    - else (attention) the context is left-truncated to fit (lm-eval's HF model does the same); a
      continuation longer than ``max_length`` is scored in consecutive windows of ``max_length``
      inputs (each piece after the tokens just before it), instead of failing."""
    device = model_device(model)
    items, long_rows, pieces = [], [], {}
    for i, (ctx, cont) in enumerate(pairs):
        ctx, cont = list(ctx), list(cont)
        if not ctx:
            raise ValueError("score_continuations: empty context (prefix a BOS/EOS token)")
        if not cont:
            items.append((i, [], 0))
            continue
        inp = (ctx + cont)[:-1]
        if max_length is not None and len(inp) > max_length:
            if carry_state:
                long_rows.append((i, inp, len(cont)))
                continue
            if len(cont) > max_length:
                ps = _window_pieces(ctx, cont, max_length)
                pieces[i] = []
                for inp_k, n_k in ps:
                    pieces[i].append(len(items))
                    items.append((i, inp_k, n_k))
                continue
            inp = inp[-max_length:]
        items.append((i, inp, len(cont)))
    lps: list = [None] * len(items)     # log-softmax rows of each item's scored positions
    out: list[ContinuationScore | None] = [None] * len(pairs)
    order = sorted(range(len(items)), key=lambda j: -len(items[j][1]))
    batches = [("window", order[s:s + batch_size]) for s in range(0, len(order), batch_size)]
    lorder = sorted(range(len(long_rows)), key=lambda j: -len(long_rows[j][1]))
    batches += [("carry", lorder[s:s + batch_size]) for s in range(0, len(lorder), batch_size)]
    it = batches
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(batches, desc=desc, leave=False)
    for kind, b in it:
        if kind == "carry":
            rows = [long_rows[j] for j in b]
            for (idx, _, nc), lp in zip(rows, _score_carried(model, rows, max_length, pad_id, device)):
                out[idx] = _finish(pairs, idx, nc, lp)
            continue
        rows = [(j, items[j]) for j in b if items[j][2] > 0]
        for j in b:
            if items[j][2] == 0:
                lps[j] = ()
        if not rows:
            continue
        T = max(len(r[1][1]) for r in rows)
        ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
        for r, (_, (_, inp, _)) in enumerate(rows):
            ids[r, :len(inp)] = torch.tensor(inp, dtype=torch.long)
        logits = model(ids.to(device))
        for r, (j, (_, inp, nc)) in enumerate(rows):
            L = len(inp)
            lps[j] = torch.log_softmax(logits[r, L - nc:L].float(), dim=-1)
    for j, (idx, inp, nc) in enumerate(items):
        if idx in pieces or out[idx] is not None:
            continue
        out[idx] = ContinuationScore(0.0, True, 0, 0, []) if nc == 0 else _finish(pairs, idx, nc, lps[j])
    for idx, js in pieces.items():
        out[idx] = _finish(pairs, idx, len(pairs[idx][1]), torch.cat([lps[j] for j in js], dim=0))
    return out  # type: ignore[return-value]


def _score_carried(model, rows, seg, pad_id, device):
    """Log-softmax rows of each row's scored positions, reading the inputs ``seg`` positions at a time
    and carrying the recurrent state (right padding only follows a row's own positions)."""
    B, T = len(rows), max(len(r[1]) for r in rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    for r, (_, inp, _) in enumerate(rows):
        ids[r, :len(inp)] = torch.tensor(inp, dtype=torch.long)
    ids = ids.to(device)
    state = _init_state(model, B, device)
    got: list[list] = [[] for _ in rows]
    for t0 in range(0, T, seg):
        logits, state = _prefill(model, ids[:, t0:t0 + seg], state)
        for r, (_, inp, nc) in enumerate(rows):
            lo, hi = max(len(inp) - nc, t0), min(len(inp), t0 + seg)
            if lo < hi:
                got[r].append(torch.log_softmax(logits[r, lo - t0:hi - t0].float(), dim=-1))
    return [torch.cat(g, dim=0) for g in got]


# ---------------------------------------------------------------------------------------------
# greedy decoding
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    eos_id: int | None = None, stop: Callable[[list[int]], bool] | None = None,
                    batch_size: int = 16, max_length: int | None = None, pad_id: int = 0,
                    use_recurrent: bool | None = None) -> list[list[int]]:
    """Greedy continuation of each prompt, at most ``max_new_tokens`` tokens, ending early at
    ``eos_id`` (not included) or when ``stop(generated_ids)`` is true.

    With ``model.step`` (recurrent mixers: O(1) state; attention: KV cache) the batch advances in
    lock step without padding: a row still inside its prompt is fed its next prompt token and its
    logits are ignored; a row past its prompt is fed its last generated token. So rows of different
    prompt lengths share one batch exactly. Without ``step``, the full forward is re-run per token.
    """
    if use_recurrent is None:
        use_recurrent = has_recurrent_step(model)
    results: list[list[int]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        ps = [list(prompts[i]) for i in idx]
        if max_length is not None:
            ps = [p[-max_length:] for p in ps]
        if any(len(p) == 0 for p in ps):
            raise ValueError("greedy_generate: empty prompt (prefix a BOS/EOS token)")
        gens = (_decode_recurrent if use_recurrent else _decode_full)(
            model, ps, max_new_tokens, eos_id, stop, pad_id)
        for i, g in zip(idx, gens):
            results[i] = g
    return results


def _finished(g, eos_id, stop, max_new):
    if len(g) >= max_new:
        return True
    if g and eos_id is not None and g[-1] == eos_id:
        return True
    return bool(stop is not None and g and stop(g))


def _strip_eos(g, eos_id):
    return g[:-1] if (g and eos_id is not None and g[-1] == eos_id) else g


def _init_state(model, batch, device):
    try:
        return model.init_state(batch, device)
    except TypeError:
        return model.init_state(batch)


def _decode_recurrent(model, ps, max_new, eos_id, stop, pad_id):
    device = model_device(model)
    B = len(ps)
    gens: list[list[int]] = [[] for _ in range(B)]
    done = [max_new <= 0] * B
    lens = [len(p) for p in ps]
    m = min(lens)
    prefill = getattr(model, "prefill", None)
    if callable(prefill) and m > 1:
        # the prompt part every row shares in length goes through the parallel (chunked) forward
        ids = torch.tensor([p[:m] for p in ps], dtype=torch.long, device=device)
        logits, state = prefill(ids, _init_state(model, B, device))
        t, logits = m, logits[:, -1]
    else:
        state = _init_state(model, B, device)
        logits, t = None, 0
    while True:
        if logits is not None:
            nxt = logits.float().argmax(-1).tolist()
            for r in range(B):
                if done[r] or t < lens[r]:
                    continue
                gens[r].append(int(nxt[r]))
                done[r] = _finished(gens[r], eos_id, stop, max_new)
        if all(done):
            break
        feed = []
        for r in range(B):
            if t < lens[r]:
                feed.append(ps[r][t])
            elif gens[r]:
                feed.append(gens[r][-1])
            else:
                feed.append(pad_id)
        logits, state = model.step(torch.tensor(feed, dtype=torch.long, device=device), state)
        t += 1
    return [_strip_eos(g, eos_id) for g in gens]


def _decode_full(model, ps, max_new, eos_id, stop, pad_id):
    device = model_device(model)
    gens: list[list[int]] = [[] for _ in ps]
    done = [max_new <= 0] * len(ps)
    while not all(done):
        live = [r for r in range(len(ps)) if not done[r]]
        seqs = [ps[r] + gens[r] for r in live]
        T = max(len(x) for x in seqs)
        ids = torch.full((len(live), T), pad_id, dtype=torch.long)
        for j, x in enumerate(seqs):
            ids[j, :len(x)] = torch.tensor(x)
        logits = model(ids.to(device))
        for j, r in enumerate(live):
            gens[r].append(int(logits[j, len(seqs[j]) - 1].float().argmax()))
            done[r] = _finished(gens[r], eos_id, stop, max_new)
    return [_strip_eos(g, eos_id) for g in gens]


def save_accuracy_plot(fig, ax, path: str, xlabel: str, title: str) -> str:
    """Finish an accuracy-vs-x figure (addition, MQAR): labels, y in % from -2 to 102, legend; saved as a
    120-dpi image at `path`, closed. Returns `path`."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def safe_exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")
