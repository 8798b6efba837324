#!/usr/bin/env bash
# Multi-GPU / multi-node training with torchrun (one process per GPU), in the project's environment (.venv,
# made by ./lab install). Every rank on every node must write to the same run folder, so the run dir is given,
# never stamped from each node's own clock.
#
# One node, 4 GPUs (the run dir may be stamped here: one node, one clock):
#   experiments/launch/torchrun.sh experiment=paper_small_falcon_1a_3
# Two nodes: the same RUN_ID (or RUN_DIR) on every node, e.g. the scheduler's job id; NODE_RANK=0 on the master,
# MASTER_ADDR = the master's address. The global batch stays data.global_batch_size: the accumulation is derived
# from it and the world size (a global batch the ranks do not divide is refused at start-up).
#   RUN_ID=pss-1a3 NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 experiments/launch/torchrun.sh experiment=paper_small_falcon_1a_3 data.batch_size=12
#   RUN_ID=pss-1a3 NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 experiments/launch/torchrun.sh experiment=paper_small_falcon_1a_3 data.batch_size=12
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${FALCON_PYTHON:-$ROOT/.venv/bin/python}"
if [ ! -x "$PY" ]; then
  echo "torchrun.sh: no project environment at $PY (run ./lab install, or set FALCON_PYTHON)" >&2
  exit 2
fi
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
GPUS="${GPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [ -z "${RUN_DIR:-}" ]; then
  if [ -n "${RUN_ID:-}" ]; then
    RUN_DIR="outputs/torchrun/${RUN_ID}"           # shared: derived from a value every node is given
  elif [ "$NNODES" -gt 1 ]; then
    echo "torchrun.sh: NNODES=$NNODES needs one run dir shared by all nodes: set RUN_ID (e.g. a job id) or" \
         "RUN_DIR to the same value on every node" >&2
    exit 2
  else
    RUN_DIR="outputs/torchrun/$(date +%Y-%m-%d_%H-%M-%S)"   # one node: its own clock is the only one
  fi
fi
echo "torchrun.sh: node $NODE_RANK of $NNODES, $GPUS GPUs, run dir $RUN_DIR" >&2
exec "$PY" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  -m falcon_lab.fit trainer=ddp trainer.devices="$GPUS" trainer.num_nodes="$NNODES" \
  hydra.run.dir="$RUN_DIR" "$@"
