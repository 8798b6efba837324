#!/usr/bin/env bash
# Multi-GPU / multi-node training with torchrun (one process per GPU). Every rank must write to the
# same run folder, so the Hydra run dir is pinned (never let each rank pick its own timestamp).
#
# One node, 4 GPUs:
#   experiments/launch/torchrun.sh experiment=paper_small_falcon_1a_3
# Two nodes (run on each node; NODE_RANK=0 on the master, MASTER_ADDR = the master's address):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 experiments/launch/torchrun.sh experiment=paper_small_falcon_1a_3
set -euo pipefail
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
GPUS="${GPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
RUN_DIR="${RUN_DIR:-outputs/torchrun/$(date +%Y-%m-%d_%H-%M-%S)}"   # set RUN_DIR identically on every node
exec torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  -m falcon_lab.fit trainer=ddp trainer.devices="$GPUS" trainer.num_nodes="$NNODES" \
  hydra.run.dir="$RUN_DIR" "$@"
