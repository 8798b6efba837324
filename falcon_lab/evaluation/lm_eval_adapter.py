"""lm-evaluation-harness adapter: registers the model type ``falcon_lab``.

    import falcon_lab.evaluation            # registers "falcon_lab" with lm-eval
    lm_eval.simple_evaluate(model="falcon_lab", model_args="checkpoint=PATH", tasks=[...])

or wrap an in-memory model: ``FalconLabLM(model=m, tokenizer=tok)``. This module is imported by
``falcon_lab.evaluation`` (never by ``import falcon_lab``).

- Context length. A recurrent model (fixed-size state: Falcon and the other non-attention mixers,
  :func:`is_recurrent`; ``carry_state=`` overrides) has no context limit: inputs longer than
  ``max_length`` are read in segments of ``max_length`` with the state carried across them (as
  ``Decoder.prefill`` does), so every score is the full-context one. Other models (attention) get the
  context left-truncated to ``max_length`` as lm-eval's HF model does (the continuation kept whole
  where it fits, else scored in consecutive windows).
- ``loglikelihood``: lm-eval's context/continuation split (TemplateLM; contexts start with BOS
  like every training document, ours), then one batched
  teacher-forced pass per batch (:func:`score_continuations`); empty contexts are conditioned on
  BOS (``prefix_token_id``; ours).
- ``loglikelihood_rolling``: every token of the document predicted once, from BOS: the whole
  document with the state carried (recurrent), else in windows of ``max_length`` (:func:`rolling_pairs`).
- ``generate_until``: greedy, batched, recurrent O(1)-per-token decoding through ``model.step``
  when the model has it (KV cache for attention), stopping at EOS, at any ``until`` string (the
  output is cut before it) or at ``max_gen_toks``; the prompt is whole for a recurrent model, else
  left-truncated to ``max_length - max_gen_toks``. Sampling is not supported (a clear error).
"""
from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from falcon_lab.evaluation.common import as_tokenizer, greedy_generate, is_recurrent, score_continuations
from falcon_lab.evaluation.perplexity import rolling_pairs


@register_model("falcon_lab")
class FalconLabLM(TemplateLM):
    def __init__(self, checkpoint: str | None = None, model=None, tokenizer=None,
                 batch_size: int | str | None = 8, max_length: int | None = None,
                 max_gen_toks: int = 256, device: str | None = None, dtype: str | None = None,
                 max_batch_size: Any = None, carry_state: bool | str | None = None, **kwargs):
        super().__init__()
        if kwargs:
            raise ValueError(f"falcon_lab lm-eval model: unknown model_args {sorted(kwargs)}; known: "
                             "checkpoint, batch_size, max_length, max_gen_toks, device, dtype, carry_state")
        if (checkpoint is None) == (model is None):
            raise ValueError("falcon_lab lm-eval model: give exactly one of checkpoint=PATH or model=")
        cfg = None
        if checkpoint is not None:
            from falcon_lab.training import load_checkpoint
            model, tokenizer, cfg = load_checkpoint(checkpoint)
        if tokenizer is None:
            raise ValueError("falcon_lab lm-eval model: tokenizer= is required with model=")
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = model.to(dev)
        if dtype:
            if not hasattr(torch, str(dtype)):
                raise ValueError(f"falcon_lab lm-eval model: dtype={dtype!r} is not a torch dtype")
            model = model.to(getattr(torch, str(dtype)))
        model.eval()
        self.model, self.tok, self.cfg = model, as_tokenizer(tokenizer), cfg
        self._device = dev
        self.batch_size = 8 if batch_size in (None, "auto") else int(str(batch_size).split(":")[0])
        self.max_length = int(max_length or _cfg_max_length(cfg) or getattr(model, "max_length", 0) or 2048)
        self.max_gen_toks = int(max_gen_toks)
        if isinstance(carry_state, str):  # from a model_args string
            carry_state = {"true": True, "false": False, "auto": None, "none": None}.get(carry_state.lower(), carry_state)
        if carry_state not in (None, True, False):
            raise ValueError(f"falcon_lab lm-eval model: carry_state={carry_state!r}: true, false or auto")
        # None: a model whose state does not grow with the context carries it across segments
        self.carry_state = is_recurrent(model) if carry_state is None else bool(carry_state)

    # -- TemplateLM interface -------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # BOS first, as every training document starts (ours); lm-eval passes False for the
        # continuation of an empty context, which is then conditioned on prefix_token_id = BOS
        ids = self.tok.encode(string)
        return ids if add_special_tokens is False else [self.tok.bos_id] + ids

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        scores = score_continuations(self.model, pairs, batch_size=self.batch_size,
                                     max_length=self.max_length, pad_id=self.tok.pad_id,
                                     progress=not disable_tqdm, desc="loglikelihood",
                                     carry_state=self.carry_state)
        out = []
        for (key, _, _), s in zip(requests, scores):
            res = (s.logprob, s.is_greedy)
            out.append(res)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        all_pairs, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            ids = self.tok.encode(text)
            if self.carry_state:  # the whole document at once, state carried across segments
                ps = [([self.tok.bos_id], ids)] if ids else []
            else:
                ps = rolling_pairs(ids, self.tok.bos_id, self.max_length)
            all_pairs.extend(ps)
            owner.extend([i] * len(ps))
        scores = score_continuations(self.model, all_pairs, batch_size=self.batch_size,
                                     max_length=self.max_length, pad_id=self.tok.pad_id,
                                     progress=not disable_tqdm, desc="loglikelihood_rolling",
                                     carry_state=self.carry_state)
        totals = [0.0] * len(requests)
        for i, s in zip(owner, scores):
            totals[i] += s.logprob
        for req, t in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, t)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        # group by generation settings so each group is one batched decode
        groups: dict[tuple, list[int]] = {}
        parsed = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            gk = dict(gen_kwargs or {})
            until = gk.pop("until", None)
            if isinstance(until, str):
                until = [until]
            until = tuple(until or ())
            max_gen = int(gk.pop("max_gen_toks", self.max_gen_toks))
            if gk.pop("do_sample", False) or float(gk.pop("temperature", 0.0) or 0.0) > 0:
                raise ValueError("falcon_lab lm-eval model: only greedy generation is supported "
                                 "(do_sample=False, temperature=0)")
            gk.pop("top_p", None), gk.pop("top_k", None)
            parsed.append((context, until, max_gen))
            groups.setdefault((until, max_gen), []).append(i)
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
        for (until, max_gen), idx in groups.items():
            prompts = []
            for i in idx:
                ids = [self.tok.bos_id] + self.tok.encode(parsed[i][0])
                prompts.append(ids if self.carry_state else ids[-max(1, self.max_length - max_gen):])

            def stop(gen, _until=until):
                if not _until:
                    return False
                tail = self.tok.decode(gen[-64:])  # stop strings are short; check the recent text
                return any(u in tail for u in _until)

            gens = greedy_generate(self.model, prompts, max_new_tokens=max_gen, eos_id=self.tok.eos_id,
                                   stop=stop, batch_size=self.batch_size, pad_id=self.tok.pad_id)
            for i, g in zip(idx, gens):
                text = self.tok.decode(g)
                for u in until:
                    if u and u in text:
                        text = text.split(u, 1)[0]
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(1)
        bar.close()
        return out  # type: ignore[return-value]


def _cfg_max_length(cfg):
    if cfg is None:
        return None
    for path in (("data", "seq_len"), ("model", "max_seq_len"), ("data", "max_length"), ("seq_len",)):
        node = cfg
        try:
            for p in path:
                node = node[p]
            return int(node)
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return None
