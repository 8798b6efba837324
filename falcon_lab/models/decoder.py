"""One LLaMA-style decoder with a mixer slot: pre-norm RMSNorm, SwiGLU MLP, tied embeddings, no biases.

Decoding: `init_state(B)`, `step(tokens[B], state) -> (logits[B, V], state)` (O(1) state for recurrent
mixers, a KV cache for attention), `generate(input_ids, max_new_tokens, ...)`.
"""
from __future__ import annotations

import math

import torch
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F

from falcon_lab.models.graph_step import GraphStep
from falcon_lab.models.loss import LOSS_IMPLS, lm_nll
from falcon_lab.modules import RMSNorm
from falcon_lab.layers.registry import build_mixer


def swiglu_hidden(d_model: int, mult: float = 8 / 3, multiple_of: int = 64) -> int:
    h = int(mult * d_model)
    return (h + multiple_of - 1) // multiple_of * multiple_of


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, head_dim, mixer_cfg, ffn_hidden, norm_eps, layer_idx):
        super().__init__()
        # the residual-stream norms stay on the torch path: compiled, Inductor fuses each with the
        # residual add beside it, which a separate norm kernel would prevent (ours)
        self.norm1 = RMSNorm(d_model, eps=norm_eps, backend="torch")
        self.mixer = build_mixer(mixer_cfg, d_model, n_heads, head_dim, layer_idx)
        self.norm2 = RMSNorm(d_model, eps=norm_eps, backend="torch")
        self.mlp = SwiGLU(d_model, ffn_hidden)

    def forward(self, x, cu_seqlens=None, state=None, return_state=False, decode=False):
        y, state = self.mixer(self.norm1(x), cu_seqlens=cu_seqlens, state=state, return_state=return_state,
                              decode=decode)
        x = x + y
        return x + self.mlp(self.norm2(x)), state


class Decoder(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, head_dim: int,
                 mixer: dict, ffn_mult: float = 8 / 3, norm_eps: float = 1e-6, init_std: float = 0.02,
                 logit_scale: float = 1.0, activation_checkpointing: bool = False, loss_impl: str = "chunked"):
        super().__init__()
        if loss_impl not in LOSS_IMPLS:
            raise ValueError(f"model.loss_impl: {loss_impl!r} is not one of {LOSS_IMPLS}")
        self.loss_impl = loss_impl
        self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers
        # recompute each block's activations in backward instead of keeping them (training only)
        self.activation_checkpointing = bool(activation_checkpointing)
        self.n_heads, self.head_dim = n_heads, head_dim
        self.logit_scale = float(logit_scale)  # muP output multiplier (1 / width_mult), ours
        self.embed = nn.Embedding(vocab_size, d_model)
        hidden = swiglu_hidden(d_model, ffn_mult)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, head_dim, mixer, hidden, norm_eps, i) for i in range(n_layers))
        self.norm = RMSNorm(d_model, eps=norm_eps, backend="torch")
        self._init(init_std)

    def _init(self, std):
        """Ours (GPT-2/nanoGPT style): N(0, std) everywhere, output projections scaled by 1/sqrt(2L)."""
        for name, p in self.named_parameters():
            if p.dim() == 2 and "gate_proj" not in name and "lam_proj" not in name:
                s = std / math.sqrt(2 * self.n_layers) if name.endswith(("o_proj.weight", "w_down.weight")) else std
                nn.init.normal_(p, 0.0, s)

    def logits(self, h):
        return F.linear(self.norm(h), self.embed.weight) * self.logit_scale  # tied embeddings

    def forward(self, input_ids, cu_seqlens=None, labels=None):
        """logits [B, T, vocab]; with `labels`, (summed next-token NLL in fp32, counted tokens) through
        `model.loss_impl` instead (falcon_lab/models/loss.py: "chunked" never holds all the logits).
        One entry point for both, so FSDP's root hooks see every use of the embedding."""
        x = self.embed(input_ids)
        ckpt = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for blk in self.blocks:
            if ckpt:
                x, _ = torch.utils.checkpoint.checkpoint(blk, x, cu_seqlens, use_reentrant=False)
            else:
                x, _ = blk(x, cu_seqlens=cu_seqlens)
        if labels is not None:
            return lm_nll(self.norm(x), self.embed.weight, labels, impl=self.loss_impl, scale=self.logit_scale)
        return self.logits(x)

    # ---- decoding ------------------------------------------------------------------------------
    def init_state(self, batch_size: int, device=None, max_len: int | None = None):
        """Per-block decode state. max_len: preallocate attention's KV cache for that many positions
        (a static cache: updated in place, so a decode step can be captured in a CUDA graph); recurrent
        states have a fixed size anyway."""
        return [blk.mixer.init_state(batch_size, device, max_len=max_len) for blk in self.blocks]

    def prefill(self, input_ids, state=None, chunk_tokens: int | None = None, last_only: bool = False):
        """Run a prompt [B, T] and return (logits [B, T, V], state after it).

        chunk_tokens: consume the prompt in segments of at most this many positions, carrying the state
        from one segment to the next (every mixer continues exactly: recurrent state / KV cache), so the
        activations held at once are bounded by B·chunk_tokens instead of B·T (ours: serving engines'
        chunked prefill). last_only: return only the last position's logits ([B, 1, V]); at long
        contexts the full [B, T, V] logits dominate memory."""
        B, T = input_ids.shape
        if chunk_tokens is not None and int(chunk_tokens) < 1:
            raise ValueError(f"prefill: chunk_tokens must be >= 1, got {chunk_tokens}")
        state = state if state is not None else self.init_state(B, input_ids.device)
        step = T if not chunk_tokens else int(chunk_tokens)
        outs = []
        for t0 in range(0, T, step):
            x = self.embed(input_ids[:, t0:t0 + step])
            new = []
            for blk, st in zip(self.blocks, state):
                x, st = blk(x, state=st, return_state=True)
                new.append(st)
            state = new
            if not last_only:
                outs.append(self.logits(x))
            elif t0 + step >= T:
                outs.append(self.logits(x[:, -1:]))
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), state

    def step(self, tokens, state):
        """One token per row: tokens [B] -> (logits [B, V], new state)."""
        x = self.embed(tokens)[:, None]
        new = []
        for blk, st in zip(self.blocks, state):
            x, st = blk(x, state=st, return_state=True, decode=True)
            new.append(st)
        return self.logits(x)[:, 0], new

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 eos_id: int | None = None, generator: torch.Generator | None = None, prefill: bool = True,
                 cuda_graph: bool = False):
        """Greedy (temperature 0) or sampled continuation. The prompt is consumed with the parallel
        (chunked) forward when `prefill`, else token by token; then one `step` per new token.
        cuda_graph: replay one captured decode step per token (CUDA only; recurrent mixers only, since a
        KV cache grows; the capture is checked against an eager step), ~8x faster per token on an H200."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        B = input_ids.shape[0]
        if cuda_graph and input_ids.device.type != "cuda":
            raise ValueError(f"generate: cuda_graph=True needs CUDA tensors, got device {input_ids.device}")
        # a CUDA graph needs fixed-shape state: attention then gets a static KV cache of the final length
        max_len = input_ids.shape[1] + max_new_tokens if cuda_graph else None
        if prefill:
            logits, state = self.prefill(input_ids, state=self.init_state(B, input_ids.device, max_len=max_len))
            last = logits[:, -1]
        else:
            state = self.init_state(B, input_ids.device, max_len=max_len)
            for t in range(input_ids.shape[1]):
                last, state = self.step(input_ids[:, t], state)
        out = [input_ids]
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        graph = None
        for _ in range(max_new_tokens):
            if temperature <= 0:
                nxt = last.argmax(-1)
            else:
                lg = last.float() / temperature
                if top_k:
                    kth = lg.topk(min(top_k, lg.shape[-1]), dim=-1).values[:, -1:]
                    lg = lg.masked_fill(lg < kth, float("-inf"))
                nxt = torch.multinomial(lg.softmax(-1), 1, generator=generator)[:, 0]
            if eos_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
                done |= nxt == eos_id
            out.append(nxt[:, None])
            if eos_id is not None and bool(done.all()):
                break
            if not cuda_graph:
                last, state = self.step(nxt, state)
            elif graph is None:
                try:
                    graph = GraphStep(self, nxt, state)  # consumes nxt
                except RuntimeError as e:
                    raise ValueError(f"generate: cuda_graph=True cannot capture this model's decode step: {e}; "
                                     "use cuda_graph=False") from e
                last = graph.logits
            else:
                last = graph.feed(nxt)
        return torch.cat(out, dim=1)

    # ---- accounting ------------------------------------------------------------------------------
    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        """Analytic forward FLOPs per token (mixers + SwiGLU + LM head)."""
        mlp = self.blocks[0].mlp
        per_mlp = 2 * 3 * self.d_model * mlp.w_up.out_features
        mix = sum(b.mixer.flops_per_token(seq_len) for b in self.blocks)
        return float(mix + self.n_layers * per_mlp + 2 * self.d_model * self.vocab_size)

    def state_numel(self, batch_size: int, seq_len: int) -> int:
        return int(sum(b.mixer.state_numel(batch_size, seq_len) for b in self.blocks))

    def backends_used(self) -> list[str]:
        return sorted({getattr(b.mixer, "backend_used", "?") for b in self.blocks})


SIZE_PRESETS = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=2, head_dim=32),
    "small": dict(d_model=768, n_layers=12, n_heads=6, head_dim=128),
    "medium": dict(d_model=1024, n_layers=24, n_heads=8, head_dim=128),
}


def build_model(model_cfg, mixer_cfg, vocab_size: int, logit_scale: float = 1.0) -> Decoder:
    m = dict(model_cfg)
    m.pop("name", None)
    for key in ("d_model", "n_layers", "n_heads", "head_dim"):
        if key not in m:
            raise ValueError(f"model.{key} is missing")
    model = Decoder(vocab_size=vocab_size, d_model=int(m["d_model"]), n_layers=int(m["n_layers"]),
                   n_heads=int(m["n_heads"]), head_dim=int(m["head_dim"]), mixer=dict(mixer_cfg),
                   ffn_mult=float(m.get("ffn_mult", 8 / 3)), norm_eps=float(m.get("norm_eps", 1e-6)),
                   init_std=float(m.get("init_std", 0.02)), logit_scale=logit_scale,
                   loss_impl=str(m.get("loss_impl", "chunked")))
    # model.compile and model.activation_checkpointing are applied by falcon_lab.models.parallelize (the
    # trainer's configure_model, the benchmark), not here: build_model gives the plain model
    return model


def compile_blocks(model: Decoder) -> Decoder:
    """Deprecated location: see falcon_lab.models.parallelize.compile_blocks."""
    from falcon_lab.models.parallelize import compile_blocks as _compile_blocks

    return _compile_blocks(model)
