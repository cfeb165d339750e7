# Shared by the example launch scripts; sourced from the repository root, not run.
#
# megatron_launch ENTRY FLAGS...   start ENTRY (pretrain_gpt.py, ...) on every GPU of the job:
#   - outside Slurm: torchrun with GPUS_PER_NODE processes on this node; for several nodes run the script on each
#     node with NUM_NODES, NODE_RANK and MASTER_ADDR set;
#   - inside a Slurm job (sbatch or salloc: SLURM_JOB_ID is set) or with LAUNCHER=srun: srun starts one task per GPU
#     (the job's --ntasks-per-node) and each task reads its rank from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID
#     and the master from the first host of SLURM_NODELIST (megatron/training/initialize.py).
# requeue_if_unfinished CKPT   inside a Slurm job: requeue it when the run saved in CKPT stopped short of its
#   last iteration (a --signal made --exit-signal-handler save and exit 0); the requeued job resumes with --load.
# set_data_args PREFIX FLAGS...   DATA_ARGS=(--data-path PREFIX FLAGS...), or mock data when PREFIX is MOCK.
#
# Environment: PYTHON (default: .venv/bin/python when the repository has one, else python3), TORCHRUN (default
# "$PYTHON -m torch.distributed.run"), LAUNCHER (torchrun or srun), SRUN_ARGS, GPUS_PER_NODE (8), NUM_NODES (1),
# NODE_RANK (0), MASTER_ADDR (localhost; under srun: the first host of SLURM_NODELIST), MASTER_PORT (6000),
# VOCAB_SIZE (mock data).

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python3; fi
fi
TORCHRUN=${TORCHRUN:-$PYTHON -m torch.distributed.run}

launcher() {
  if [ -n "${LAUNCHER:-}" ]; then
    echo "$LAUNCHER"
  elif [ -n "${SLURM_JOB_ID:-}" ]; then
    echo srun
  else
    echo torchrun
  fi
}

megatron_launch() {
  local entry=$1
  shift
  case $(launcher) in
    srun)
      export MASTER_PORT=${MASTER_PORT:-6000}
      # shellcheck disable=SC2086  # SRUN_ARGS is a list of flags
      srun --kill-on-bad-exit=1 ${SRUN_ARGS:-} "$PYTHON" "$entry" "$@"
      ;;
    torchrun)
      # shellcheck disable=SC2086  # TORCHRUN is a command with its arguments
      $TORCHRUN --nproc_per_node "${GPUS_PER_NODE:-8}" --nnodes "${NUM_NODES:-1}" --node_rank "${NODE_RANK:-0}" \
        --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}" "$entry" "$@"
      ;;
    *)
      echo "LAUNCHER=$LAUNCHER: use torchrun or srun" >&2
      return 2
      ;;
  esac
}

requeue_if_unfinished() {
  local ckpt=$1 status=0
  [ -n "${SLURM_JOB_ID:-}" ] || return 0
  "$PYTHON" -m megatron.training.run_progress "$ckpt" || status=$?
  case $status in
    0) return 0 ;;
    1)
      echo "requeue_if_unfinished: requeueing job $SLURM_JOB_ID; it resumes from $ckpt"
      scontrol requeue "$SLURM_JOB_ID"
      ;;
    *) return "$status" ;;
  esac
}

set_data_args() {
  local prefix=$1
  shift
  if [ "$prefix" = MOCK ]; then
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:?set VOCAB_SIZE for mock data}")
  else
    DATA_ARGS=(--data-path "$prefix" "$@")
  fi
}
