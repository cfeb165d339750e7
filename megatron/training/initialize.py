"""Process start-up: torch.distributed from the launcher's environment, groups, seeds.

``read_launch_env`` is a pure function of the environment: torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) win; without
them, Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the first host of
SLURM_NODELIST as master) describe a job started by ``srun`` directly.
``initialize_distributed`` then creates the default process group (unless one
exists already), sets the CUDA device from the local rank, and builds the model
parallel groups from the validated args. ``initialize_run`` returns them with the
other per-run objects (``RunState``) that the training loop holds and passes on.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fusions.jit import set_jit_fuser_enabled
from megatron.core.num_microbatches_calculator import NumMicroBatchesCalculator, init_num_microbatches_calculator
from megatron.core.tensor_parallel.random import (
    CudaRNGStatesTracker,
    model_parallel_cuda_manual_seed,
    seed_rng_tracker,
)
from megatron.core.transformer.moe.moe_utils import AuxLossTracker
from megatron.training.cuda_env import set_device_max_connections
from megatron.training.flags.derive import global_batch_size
from megatron.training.host_allocator import retain_freed_host_memory
from megatron.training.preflight import check_inputs, check_port_free
from megatron.training.run_report import print_arguments, print_enabled_summary
from megatron.training.training_validation import validate_training_args

# True once initialize_distributed started torch.distributed itself; only then
# does shutdown_distributed tear it down (a harness's own group is left alone).
_OWNS_PROCESS_GROUP = False

logger = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 6000
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
SLURM_NODELIST_VARS = ("SLURM_NODELIST", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST")


class LaunchEnvError(RuntimeError):
    """The environment does not describe a torchrun or Slurm launch completely."""


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, and where to rendezvous."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "fake" (--fake-process-group)


# ----------------------------------------------------------------------------------
# Slurm host lists: "node[01-04,07],login1" -> node01 node02 node03 node04 node07 login1
# (the order of `scontrol show hostnames`; several bracket groups multiply, the first varying slowest).
# ----------------------------------------------------------------------------------
def _split_top_level(text: str) -> List[str]:
    """Split on commas that are not inside brackets; unbalanced brackets are an error."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise LaunchEnvError(f"Slurm node list {text!r}: unbalanced or nested brackets at character {i}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise LaunchEnvError(f"Slurm node list {text!r}: a '[' is never closed")
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_range(spec: str, nodelist: str) -> List[str]:
    """'01-03' -> ['01', '02', '03'] keeping zero padding; '7' -> ['7']."""
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", spec)
    if match is None:
        raise LaunchEnvError(f"Slurm node list {nodelist!r}: {spec!r} in brackets is not a number or a range N-M")
    lo, hi = match.group(1), match.group(2) or match.group(1)
    if int(hi) < int(lo):
        raise LaunchEnvError(f"Slurm node list {nodelist!r}: range {spec!r} runs backwards")
    return [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]


def expand_nodelist(nodelist: str) -> List[str]:
    """All host names of a Slurm node list (``SLURM_NODELIST``), in order.

    Raises:
        LaunchEnvError: the list is malformed (unbalanced brackets, a bracket item that is not N or N-M).
    """
    hosts: List[str] = []
    for item in _split_top_level(nodelist):
        match = re.search(r"\[([^\]]*)\]", item)
        if match is None:
            hosts.append(item)
            continue
        head, tail = item[: match.start()], item[match.end() :]
        for spec in match.group(1).split(","):
            for number in _expand_range(spec.strip(), nodelist):
                hosts.extend(expand_nodelist(head + number + tail))
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: the rendezvous host of a job started by ``srun``."""
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise LaunchEnvError(f"empty Slurm node list {nodelist!r}")
    return hosts[0]


# ----------------------------------------------------------------------------------
# Launch environment.
# ----------------------------------------------------------------------------------
def _int_var(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise LaunchEnvError(f"{name}={environ[name]!r} is not an integer") from None


def _from_torchrun(environ: Mapping[str, str]) -> LaunchEnv:
    return LaunchEnv(
        rank=_int_var(environ, "RANK"),
        world_size=_int_var(environ, "WORLD_SIZE"),
        local_rank=_int_var(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0,
        master_addr=environ["MASTER_ADDR"],
        master_port=_int_var(environ, "MASTER_PORT"),
        source="torchrun",
    )


def _from_slurm(environ: Mapping[str, str], nodelist_var: Optional[str]) -> LaunchEnv:
    addr = environ.get("MASTER_ADDR") or first_host(environ[nodelist_var])
    port = _int_var(environ, "MASTER_PORT") if "MASTER_PORT" in environ else DEFAULT_MASTER_PORT
    return LaunchEnv(
        rank=_int_var(environ, "SLURM_PROCID"),
        world_size=_int_var(environ, "SLURM_NTASKS"),
        local_rank=_int_var(environ, "SLURM_LOCALID"),
        master_addr=addr,
        master_port=port,
        source="slurm",
    )


def read_launch_env(environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """This process's rank and rendezvous point from torchrun's or Slurm's variables.

    Raises:
        LaunchEnvError: neither set of variables is complete; the message lists what is missing.
    """
    environ = os.environ if environ is None else environ
    missing_torchrun = [v for v in TORCHRUN_VARS if v not in environ]
    if not missing_torchrun:
        env = _from_torchrun(environ)
    else:
        missing_slurm = [v for v in SLURM_VARS if v not in environ]
        nodelist_var = next((v for v in SLURM_NODELIST_VARS if v in environ), None)
        if nodelist_var is None and "MASTER_ADDR" not in environ:
            missing_slurm.append("SLURM_NODELIST")
        if missing_slurm:
            raise LaunchEnvError(
                "cannot tell this process's rank: start it with torchrun (missing "
                f"{', '.join(missing_torchrun)}) or with srun (missing {', '.join(missing_slurm)}); "
                "for one process: torchrun --nproc-per-node 1 ..."
            )
        env = _from_slurm(environ, nodelist_var)
    if not 0 <= env.rank < env.world_size:
        raise LaunchEnvError(f"rank {env.rank} is outside world size {env.world_size} ({env.source})")
    return env


def read_fake_launch_env(environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """``--fake-process-group``: this process plays rank RANK of WORLD_SIZE (default 0 of 1); no rendezvous."""
    environ = os.environ if environ is None else environ
    rank = _int_var(environ, "RANK") if "RANK" in environ else 0
    world_size = _int_var(environ, "WORLD_SIZE") if "WORLD_SIZE" in environ else 1
    local_rank = _int_var(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0
    if not 0 <= rank < world_size:
        raise LaunchEnvError(f"--fake-process-group: RANK={rank} is outside WORLD_SIZE={world_size}")
    return LaunchEnv(
        rank=rank, world_size=world_size, local_rank=local_rank, master_addr="", master_port=0, source="fake"
    )


def launch_env_for(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """The launch environment: torchrun's or Slurm's, or the planned rank with ``--fake-process-group``."""
    if getattr(args, "fake_process_group", False):
        return read_fake_launch_env(environ)
    return read_launch_env(environ)


def choose_backend(requested: Optional[str], cuda_available: bool) -> str:
    """nccl with GPUs, gloo without; nccl cannot run without GPUs, so it falls back."""
    if not cuda_available:
        if requested not in (None, "nccl", "gloo"):
            raise ValueError(f"--distributed-backend {requested}: only gloo works without CUDA")
        return "gloo"
    return requested or "nccl"


# ----------------------------------------------------------------------------------
# Distributed start-up.
# ----------------------------------------------------------------------------------
def _restart_store(
    host: str, port: int, world_size: int, timeout: timedelta, environ: Optional[Mapping[str, str]]
) -> Optional[dist.Store]:
    """torchrun's restart N > 0 (``--max-restarts``, an in-job restart after a failed rank): the agent's
    store under an ``attempt_N/`` prefix. The agent keeps one store for every attempt, and the process
    group's keys of the failed attempt (the dead ranks' gloo addresses) would otherwise be read again."""
    environ = os.environ if environ is None else environ
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent_store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"megatron/attempt_{attempt}/", agent_store)


def _start_process_group(args: argparse.Namespace, environ: Optional[Mapping[str, str]]) -> None:
    env = launch_env_for(args, environ)
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() > 0:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    if env.source == "fake":  # collectives move no data: a one-process planning run of any rank
        try:  # torch's own test utility: present in every build so far, but private
            from torch.testing._internal.distributed.fake_pg import FakeStore
        except ImportError as e:
            raise RuntimeError(
                f"--fake-process-group needs torch's fake process group, which this torch "
                f"{torch.__version__} does not provide: {e}"
            ) from e

        backend = "fake"
        dist.init_process_group(backend, store=FakeStore(), rank=env.rank, world_size=env.world_size, timeout=timeout)
    else:
        backend = choose_backend(getattr(args, "distributed_backend", None), cuda)
        check_port_free(env.master_addr, env.master_port, env.rank, environ)
        store = _restart_store(env.master_addr, env.master_port, env.world_size, timeout, environ)
        dist.init_process_group(
            backend=backend,
            init_method=None if store is not None else f"tcp://{env.master_addr}:{env.master_port}",
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )
    global _OWNS_PROCESS_GROUP
    _OWNS_PROCESS_GROUP = True
    args.local_rank = env.local_rank
    logger.info("torch.distributed up: rank %d of %d (%s, %s)", env.rank, env.world_size, env.source, backend)


def initialize_distributed(
    args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None
) -> parallel_state.ProcessGroupCollection:
    """Create the default process group if needed, then the model-parallel groups from ``args``.

    A process group created beforehand (e.g. by a test harness) is kept as is.
    Returns the process-group collection, also installed as the default.
    """
    if not dist.is_initialized():
        _start_process_group(args, environ)
    elif torch.cuda.is_available() and torch.cuda.device_count() > 0:
        local = int((environ or os.environ).get("LOCAL_RANK", dist.get_rank()))
        torch.cuda.set_device(local % torch.cuda.device_count())
    args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
    if parallel_state.model_parallel_is_initialized():
        warnings.warn("model parallel groups are already initialized; keeping them", stacklevel=2)
        return parallel_state.ProcessGroupCollection.use_mpu_process_groups()  # built by the caller
    return parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None),
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=getattr(args, "hierarchical_context_parallel_sizes", None),
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        order="tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp",
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        create_gloo_process_groups=getattr(args, "enable_gloo_process_groups", True),
        num_distributed_optimizer_instances=getattr(args, "num_distributed_optimizer_instances", 1),
    )


def shutdown_distributed() -> None:
    """Destroy the process groups this process started, before the interpreter exits.

    Left to interpreter teardown, gloo's worker threads can outlive Python and the
    process dies with SIGABRT ("terminate called without an active exception")
    after training already finished; NCCL warns and may leave peers waiting.
    """
    global _OWNS_PROCESS_GROUP
    parallel_state.destroy_model_parallel()
    if _OWNS_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWNS_PROCESS_GROUP = False


def _rank_seed(seed: int, data_parallel_random_init: bool, groups: parallel_state.ProcessGroupCollection) -> int:
    """This rank's seed by Megatron's rule (see ``set_random_seed``); a seed that is not positive raises."""
    if seed is None or seed <= 0:
        raise ValueError(f"--seed={seed}: must be a positive integer")
    seed = seed + 100 * groups.rank_in("pp")
    return seed + 10 * groups.rank_in("dp") if data_parallel_random_init else seed


def _set_random_seed(
    seed_: int,
    data_parallel_random_init: bool = False,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
) -> None:
    """Megatron's ``_set_random_seed``: seed python, numpy, torch and ``get_cuda_rng_tracker()`` for this rank.

    For library users and tests written against Megatron-LM: the ranks come from the groups
    ``initialize_model_parallel`` built (the run itself seeds its own tracker with ``set_random_seed``).
    The same per-rank rule as ``set_random_seed``; the tracker options go to ``model_parallel_cuda_manual_seed``.
    """
    groups = parallel_state.ProcessGroupCollection.use_mpu_process_groups()
    seed = _rank_seed(seed_, data_parallel_random_init, groups)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(
        seed,
        te_rng_tracker,
        inference_rng_tracker,
        use_cudagraphable_rng,
        tp_rank=groups.rank_in("tp"),
        ep_rank=groups.rank_in("ep"),
        etp_rank=groups.rank_in("expt_tp"),
    )


def set_random_seed(
    seed: int,
    data_parallel_random_init: bool,
    groups: parallel_state.ProcessGroupCollection,
    *,
    tracker: CudaRNGStatesTracker,
) -> int:
    """Seed python, numpy, torch and the run's model-parallel ``tracker``; returns the seed this rank used.

    Megatron's rule: pipeline stages get different streams (seed + 100 x pp rank),
    data-parallel replicas the same one unless ``data_parallel_random_init``
    (then + 10 x dp rank). Tensor-parallel ranks share the default stream and
    differ only inside the tracked model-parallel stream.
    """
    seed = _rank_seed(seed, data_parallel_random_init, groups)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # the CPU generator, and every CUDA device's
    seed_rng_tracker(tracker, seed, groups.rank_in("tp"), groups.rank_in("ep"), groups.rank_in("expt_tp"))
    return seed


@dataclass
class RunState:
    """The per-run objects the training loop holds and hands to what uses them.

    ``groups`` and ``microbatches`` are also installed as the defaults behind Megatron's
    module-level accessors (``parallel_state.get_*``, ``get_num_microbatches()``) for
    library users and entry points; the loop itself never reads those accessors.
    ``aux_losses`` is the run's own MoE aux-loss state; ``pretrain`` binds the routers to it.
    ``rng_tracker`` holds the run's named model-parallel RNG streams; ``pretrain`` installs it
    (``use_rng_tracker``) behind Megatron's ``get_cuda_rng_tracker()`` for the run's duration and
    hands it to checkpoint save/load explicitly.
    """

    groups: parallel_state.ProcessGroupCollection
    microbatches: NumMicroBatchesCalculator
    aux_losses: AuxLossTracker
    rng_tracker: CudaRNGStatesTracker


def initialize_megatron(
    argv: Optional[Sequence[str]] = None,
    extra_args_provider: Optional[Callable[[argparse.ArgumentParser], Any]] = None,
    args_defaults: Optional[Mapping[str, Any]] = None,
    entry_point: str = "gpt",
    environ: Optional[Mapping[str, str]] = None,
) -> argparse.Namespace:
    """Parse and validate flags, start torch.distributed, build groups, seed, set up microbatches."""
    return initialize_run(argv, extra_args_provider, args_defaults, entry_point, environ)[0]


def initialize_run(
    argv: Optional[Sequence[str]] = None,
    extra_args_provider: Optional[Callable[[argparse.ArgumentParser], Any]] = None,
    args_defaults: Optional[Mapping[str, Any]] = None,
    entry_point: str = "gpt",
    environ: Optional[Mapping[str, str]] = None,
    training: bool = False,
) -> Tuple[argparse.Namespace, RunState]:
    """``initialize_megatron``, also returning the run's groups and microbatch calculator.

    Flags are validated before torch.distributed starts, what they name (data, tokenizer files,
    ``--load``, output directories) right after, before anything is built (``preflight``). ``training``
    (``pretrain``): also the rules of a training run (``training_validation``), which serving does not need.
    """
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(argv, extra_args_provider, defaults=args_defaults, entry_point=entry_point)
    args.use_checkpoint_args = args.use_checkpoint_args or bool((args_defaults or {}).get("use_checkpoint_args"))
    if args.use_checkpoint_args:
        from megatron.training.checkpointing import load_args_from_checkpoint

        load_args_from_checkpoint(args)  # the model flags come from --load's checkpoint, before validation
    world_size = dist.get_world_size() if dist.is_initialized() else launch_env_for(args, environ).world_size
    validate_args(args, world_size)  # once, before any process group exists
    if training:
        validate_training_args(args)  # layouts that serve but do not train
    connections = set_device_max_connections(args)  # before CUDA starts (initialize_distributed picks the GPU)
    if connections and (dist.get_rank() if dist.is_initialized() else launch_env_for(args, environ).rank) == 0:
        print(f" > {connections}", flush=True)
    groups = initialize_distributed(args, environ)
    check_inputs(args)  # files, directories, checkpoint and ports, before anything is built
    print_arguments(args)
    print_enabled_summary(args)
    set_jit_fuser_enabled(not args.disable_jit_fuser)  # the fused regions: compiled, or eager
    if not torch.cuda.is_available():  # CPU training: its tensors live in the host heap
        report = retain_freed_host_memory(environ)
        if dist.get_rank() == 0:
            print(f" > {report}", flush=True)
    rng_tracker = CudaRNGStatesTracker()
    set_random_seed(args.seed, args.data_parallel_random_init, groups, tracker=rng_tracker)
    microbatches = init_num_microbatches_calculator(
        args.rank,
        args.rampup_batch_size,
        global_batch_size(args),  # --global-batch-size, or micro batch x DP
        args.micro_batch_size,
        args.data_parallel_size,
        args.decrease_batch_size_if_needed,
    )
    return args, RunState(groups, microbatches, AuxLossTracker(), rng_tracker)
