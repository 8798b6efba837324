"""The training-time transforms of a built Decoder, in one place and in torchtitan's order
(activation checkpointing, then compile each block, then FSDP: one unit per block, then the root).

`build_model` builds the plain model only; whoever trains or benchmarks it calls

    parallelize(model, compile=..., activation_checkpointing=..., mesh=...)

(the Lightning module from its `configure_model`, with the device mesh of `trainer.strategy=fsdp2`; the
benchmark right after building). Each transform keeps parameter names, so checkpoints load either way.
"""
from __future__ import annotations

from typing import Optional


def compile_blocks(model):
    """torch.compile each decoder block in place (nn.Module.compile: parameter names and checkpoints are
    unchanged). Inductor fuses the mixers' elementwise PyTorch work (norms, gates, NLMS prep); the
    Triton chunk kernels and fused modules are custom operators (torch.library), traced without a graph
    break; so is the PyTorch chunk core under compile (kernels/chunk_torch.py: traced, its tile loops made
    Falcon-2's graph too large to compile). Ours."""
    for blk in model.blocks:
        blk.compile()
    return model


def shard_decoder(model, mesh) -> None:
    """fully_shard each decoder block, then the whole decoder (embedding and final norm). Idempotent."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(model, FSDPModule):
        return
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)


def parallelize(model, *, compile: bool = False, activation_checkpointing: Optional[bool] = None, mesh=None):
    """Apply the transforms a run asks for (model.compile resolved to a bool, model.activation_checkpointing,
    the FSDP2 data-parallel mesh or None) and return the model. Calling it again does nothing new."""
    if getattr(model, "_falcon_parallelized", False):
        return model
    if activation_checkpointing is not None:
        model.activation_checkpointing = bool(activation_checkpointing)  # each block recomputed in backward
    if compile is True:
        compile_blocks(model)
    if mesh is not None:
        shard_decoder(model, mesh)
    model._falcon_parallelized = True
    return model
