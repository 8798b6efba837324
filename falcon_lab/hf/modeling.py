"""`FalconLabForCausalLM`: the platform's decoder as a Hugging Face `PreTrainedModel` + `GenerationMixin`.

One implementation: the module is `self.model`, the platform's own `falcon_lab.models.Decoder` built by
`build_model` from the config, so its parameter names are the checkpoint's (`model.embed.weight`,
`model.blocks.0.mixer.q_proj.weight`, ...) and its numbers are the platform's:

- `forward(input_ids)` without a cache is `Decoder.forward` (the parallel / chunked form);
- with a cache (`generate`, or `use_cache=True`), the first call is `Decoder.prefill` (the chunked form,
  returning every layer's state: FalconState + short-conv cache for recurrent mixers, the KV cache for
  attention) and each later single-token call is `Decoder.step` (the recurrent step,
  `fused_recurrent_falcon`), exactly the platform's `Decoder.generate` path; the states live in a
  `FalconLabCache` (falcon_lab/hf/cache.py).

Padding: `attention_mask` rows must hold one contiguous block of tokens (left or right padding). A
padded batch is run row by row on each row's own tokens (padded positions get zero logits), so pad
tokens never enter a recurrent state.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from falcon_lab.hf.cache import FalconLabCache
from falcon_lab.hf.configuration import FalconLabConfig
from falcon_lab.hf.state import contiguous_span


def _on_meta(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


class FalconLabPreTrainedModel(PreTrainedModel):
    config_class = FalconLabConfig
    config: FalconLabConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _is_stateful = True
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
        """Called by transformers only for what a checkpoint did not provide: non-persistent buffers (RetNet's
        per-head decay) and missing weights. They get the values of a freshly built platform module (the mixer
        of that layer, or the whole decoder for modules outside a mixer); never a generic re-initialisation of
        the platform's weights."""
        from transformers import initialization as init

        bufs = [n for n, b in module.named_buffers(recurse=False)
                if b is not None and n in module._non_persistent_buffers_set]
        params = [n for n, p in module.named_parameters(recurse=False) if not getattr(p, "_is_hf_initialized", False)]
        if not bufs and not params:
            return
        twin = self._fresh_twin(module)
        if twin is None:
            return
        for n in bufs:
            init.copy_(module._buffers[n], twin._buffers[n].to(module._buffers[n].dtype))
        for n in params:
            init.copy_(getattr(module, n), getattr(twin, n).to(getattr(module, n).dtype))

    def _fresh_twin(self, module):
        """A CPU copy of `module` with the platform's own construction-time values."""
        from falcon_lab.models.decoder import build_model
        from falcon_lab.layers.registry import build_mixer

        path = next((name for name, m in self.named_modules() if m is module), None)
        if path is None:
            return None
        parts = path.split(".")
        cfg = self.config
        with torch.device("cpu"):
            if "blocks" in parts and "mixer" in parts and parts.index("mixer") == parts.index("blocks") + 2:
                i = parts.index("blocks")
                mixer = build_mixer(cfg.mixer, cfg.d_model, cfg.n_heads, cfg.head_dim, int(parts[i + 1]))
                rel = ".".join(parts[i + 3:])
                return mixer.get_submodule(rel) if rel else mixer
            dec = build_model(cfg.model_cfg(), cfg.mixer, cfg.vocab_size, logit_scale=cfg.logit_scale)
            rel = ".".join(parts[parts.index(self.base_model_prefix) + 1:]) if self.base_model_prefix in parts else ""
            return dec.get_submodule(rel) if rel else dec


class FalconLabForCausalLM(FalconLabPreTrainedModel, GenerationMixin):
    def __init__(self, config: FalconLabConfig):
        super().__init__(config)
        from falcon_lab.models.decoder import build_model

        self.model = build_model(config.model_cfg(), config.mixer, config.vocab_size, logit_scale=config.logit_scale)
        if not _on_meta(self.model):
            # built for real (not by from_pretrained on the meta device): the Decoder already initialised its
            # weights the platform's way; mark them so post_init does not re-initialise them generically
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                t._is_hf_initialized = True
            for m in self.model.modules():
                m._is_hf_initialized = True
        self.post_init()

    # -- transformers plumbing ---------------------------------------------------------------------
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward makes its own FalconLabCache (mixer states, not keys/values)

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return None  # the logits use the input embedding (tied by construction, no separate head)

    @property
    def decoder(self):
        """The platform's Decoder (falcon_lab.models.Decoder): init_state / prefill / step / generate."""
        return self.model

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, cache=None, inputs_embeds=None, labels=None,
                use_cache=None, output_hidden_states=None, return_dict=None, logits_to_keep=0, **kwargs):
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        for k in ("position_ids", "cache_position", "output_attentions", "token_type_ids"):
            kwargs.pop(k, None)  # positions live in the mixers' states; no attention maps are returned
        if kwargs:
            raise TypeError(f"FalconLabForCausalLM.forward: unexpected arguments {sorted(kwargs)}")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        x = input_ids if input_ids is not None else inputs_embeds
        B, T = x.shape[:2]
        use_cache = bool(use_cache) or cache is not None
        hidden = [] if output_hidden_states else None
        mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError("attention_mask: a [batch, length] 0/1 padding mask is expected")
            if not bool(attention_mask.bool().all()):
                mask = attention_mask.bool()
                if output_hidden_states:
                    raise ValueError("output_hidden_states with a padded batch (attention_mask with zeros) is not "
                                     "supported: padded rows run one by one")
        if use_cache:
            if cache is not None and not isinstance(cache, FalconLabCache):
                if cache.get_seq_length() > 0:
                    raise TypeError(f"FalconLabForCausalLM needs a FalconLabCache, got a filled "
                                    f"{type(cache).__name__}")
                cache = None
            if cache is None:
                cache = FalconLabCache(self.config.n_layers)
            last_only = labels is None and hidden is None and isinstance(logits_to_keep, int) and logits_to_keep == 1
            logits = self._forward_cached(x, mask, cache, hidden, last_only)
            cache.seen_tokens += T
        elif mask is not None:
            logits = self._per_row(x, mask, lambda xr, r: self._run(xr, None, False, None)[0])
        else:
            logits, _ = self._run(x, None, False, hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        logits = _keep(logits, logits_to_keep)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None,
                                     hidden_states=tuple(hidden) if hidden is not None else None)
        return out if return_dict is not False else out.to_tuple()

    def _forward_cached(self, x, mask, cache: FalconLabCache, hidden, last_only):
        B, T = x.shape[:2]
        if cache.is_empty:  # prefill: the chunked form, returning every layer's state
            if mask is None:
                logits, states = self._run(x, None, False, hidden, last_only=last_only, want_state=True)
                if last_only:  # [B, 1, V] -> [B, T, V] view for _keep (only the last position is read)
                    logits = logits.expand(B, T, logits.shape[-1])
                cache.set_states(states)
                return logits
            rows = [None] * B

            def run_row(xr, r):
                lg, st = self._run(xr, None, False, None, want_state=True)
                rows[r] = st
                return lg
            logits = self._per_row(x, mask, run_row)
            if any(r is None for r in rows):
                raise ValueError("attention_mask: a row without any token cannot start a cached decode")
            cache.set_row_states(rows)
            return logits
        if mask is not None and not bool(mask[:, -T:].all()):
            raise ValueError("attention_mask: padding inside the new tokens of a continued sequence is not supported")
        decode = T == 1  # a single new token: the recurrent step (Decoder.step); more: the chunked form with state
        if not cache.per_row:
            logits, states = self._run(x, cache.states(), decode, hidden)
            cache.set_states(states)
            return logits
        outs, rows = [], []
        for r in range(B):
            lg, st = self._run(x[r:r + 1], cache.row_states(r), decode, None)
            outs.append(lg)
            rows.append(st)
        cache.set_row_states(rows)
        return torch.cat(outs, dim=0)

    def _per_row(self, x, mask, fn):
        """Run `fn(x_row[1, n], row)` on each row's own tokens; padded positions get zero logits."""
        B, T = x.shape[:2]
        out = None
        for r in range(B):
            s, e = contiguous_span(mask[r])
            if e == s:
                continue
            lg = fn(x[r:r + 1, s:e], r)
            if out is None:
                out = lg.new_zeros(B, T, lg.shape[-1])
            out[r, s:e] = lg[0]
        if out is None:
            raise ValueError("attention_mask: every row is padding")
        return out

    def _run(self, x, states, decode, hidden, last_only=False, want_state=False):
        """Through the platform's Decoder. x: input ids [B, T] or embeddings [B, T, D]; states: the layers'
        states to continue from (None: a fresh sequence); want_state: return the new states (a cache is in
        use); decode: one token per row, the recurrent step. Returns (logits, new states or None)."""
        dec = self.model
        want_state = want_state or states is not None
        ids = not x.is_floating_point()
        if ids and hidden is None:
            if not want_state:
                return dec(x), None  # Decoder.forward: the parallel (chunked) form
            if decode and states is not None:
                lg, st = dec.step(x[:, 0], states)  # Decoder.step: the recurrent step
                return lg[:, None], st
            return dec.prefill(x, state=states, last_only=last_only)  # Decoder.prefill: chunked, with state
        # embeddings given or hidden states requested: the same blocks, looped as Decoder.prefill/step do
        h = dec.embed(x) if ids else x
        if hidden is not None:
            hidden.append(h)
        cur = states if states is not None else (dec.init_state(h.shape[0], h.device) if want_state else None)
        new = [] if want_state else None
        for i, blk in enumerate(dec.blocks):
            h, st = blk(h, state=cur[i] if cur is not None else None, return_state=want_state,
                        decode=bool(decode and states is not None))
            if new is not None:
                new.append(st)
            if hidden is not None:
                hidden.append(h)
        return dec.logits(h), new


def _keep(logits, logits_to_keep):
    if isinstance(logits_to_keep, int):
        return logits[:, -logits_to_keep:] if logits_to_keep > 0 else logits
    return logits[:, logits_to_keep]
