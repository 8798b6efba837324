"""FSDP2 (`trainer.strategy=fsdp2`): torch's `fully_shard` through Lightning's ModelParallelStrategy.

- pure data parallelism: one mesh dimension over all ranks (data_parallel = world size, no tensor parallelism);
- one FSDP unit per decoder block, then the root (tied embedding, final norm): `shard_decoder` in
  `falcon_lab.models.parallelize`, applied by `LitLM.configure_model`;
- checkpoints are one file with the full (unsharded) state dict, gathered on rank 0
  (`save_distributed_checkpoint=False`), so they resume on any number of processes and load with
  `load_checkpoint` like any other checkpoint.

Unlike Lightning's FSDPStrategy (FSDP1, `trainer.strategy=fsdp`), this also runs on CPU with the gloo backend
(`trainer=fsdp_cpu`). In Lightning 2.6 / torch 2.13, FSDP1 refuses CPU twice: Lightning's accelerator connector
rejects `strategy=fsdp` with `accelerator=cpu`, and torch's FullyShardedDataParallel raises "FSDP needs a
non-CPU accelerator device" for the `device_id=None` that Lightning passes on CPU.
"""
from __future__ import annotations

from lightning.pytorch.strategies import ModelParallelStrategy


class FSDP2Strategy(ModelParallelStrategy):
    """ModelParallelStrategy with data_parallel = world size and tensor_parallel = 1, whatever
    `trainer.devices` and `trainer.num_nodes` are; full-state-dict single-file checkpoints."""

    def __init__(self, **kwargs):
        kwargs.setdefault("save_distributed_checkpoint", False)
        super().__init__(**kwargs)

    def setup_environment(self) -> None:
        # the world size is known only now (devices may be "auto"); "auto" in the parent would mean
        # data_parallel = num_nodes and tensor_parallel = processes per node
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()
