"""Launch-environment parsing, backend choice, and start-up on two gloo ranks."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
from megatron.training import initialize as init
from tests.dist_harness import run_distributed
from tests.ports import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NODELIST": "gpu[07-09,12]"}


def test_torchrun_environment():
    env = init.read_launch_env(TORCHRUN)
    assert env == init.LaunchEnv(3, 8, 1, "10.0.0.1", 29500, "torchrun")


def test_torchrun_wins_over_slurm():
    assert init.read_launch_env({**SLURM, **TORCHRUN}).source == "torchrun"


def test_slurm_environment_first_host_and_default_port():
    env = init.read_launch_env(SLURM)
    assert env == init.LaunchEnv(5, 16, 1, "gpu07", 6000, "slurm")
    env = init.read_launch_env({**SLURM, "MASTER_PORT": "7777", "SLURM_NODELIST": "login,gpu[1-2]"})
    assert (env.master_addr, env.master_port) == ("login", 7777)
    assert init.read_launch_env({**SLURM, "MASTER_ADDR": "head"}).master_addr == "head"
    job = {k: v for k, v in SLURM.items() if k != "SLURM_NODELIST"}
    assert init.read_launch_env({**job, "SLURM_JOB_NODELIST": "n[3-4]"}).master_addr == "n3"


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[8-11],b", ["a8", "a9", "a10", "a11", "b"]),
        ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
        ("x[001,010-011].cluster,y", ["x001.cluster", "x010.cluster", "x011.cluster", "y"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert init.expand_nodelist(nodelist) == hosts
    assert init.first_host(nodelist) == hosts[0]


# The forms issue 18 names, as `scontrol show hostnames` expands them (tests/functional_tests/test_slurm_cluster.py
# compares with scontrol itself where a cluster runs).
SLURM_FORMS = {
    "a": ["a"],
    "a,b": ["a", "b"],
    "node[1-3]": ["node1", "node2", "node3"],
    "node[01-04,07]": ["node01", "node02", "node03", "node04", "node07"],
    "rack[1-2]-node[1-2]": ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"],
}


@pytest.mark.parametrize("nodelist", sorted(SLURM_FORMS))
def test_slurm_nodelist_forms_rendezvous_at_the_first_host(nodelist):
    assert init.expand_nodelist(nodelist) == SLURM_FORMS[nodelist]
    job = {k: v for k, v in SLURM.items() if k != "SLURM_NODELIST"}
    assert init.read_launch_env({**job, "SLURM_NODELIST": nodelist}).master_addr == SLURM_FORMS[nodelist][0]


@pytest.mark.parametrize(
    "nodelist, problem",
    [
        ("node[1-3", "never closed"),
        ("node]1[", "unbalanced"),
        ("node[3-1]", "runs backwards"),
        ("node[a-b]", "not a number or a range"),
        ("node[]", "not a number or a range"),
        ("", "empty Slurm node list"),
    ],
)
def test_malformed_nodelist_is_refused_by_name(nodelist, problem):
    with pytest.raises(init.LaunchEnvError, match=re.escape(problem)):
        init.first_host(nodelist)


def test_incomplete_environment_names_missing_variables():
    with pytest.raises(init.LaunchEnvError) as err:
        init.read_launch_env({"RANK": "0", "WORLD_SIZE": "2"})
    msg = str(err.value)
    assert "MASTER_ADDR" in msg and "MASTER_PORT" in msg and "SLURM_PROCID" in msg and "torchrun" in msg
    with pytest.raises(init.LaunchEnvError, match="SLURM_NODELIST"):
        init.read_launch_env({k: v for k, v in SLURM.items() if k != "SLURM_NODELIST"})
    with pytest.raises(init.LaunchEnvError, match="not an integer"):
        init.read_launch_env({**TORCHRUN, "RANK": "x"})
    with pytest.raises(init.LaunchEnvError, match="outside world size"):
        init.read_launch_env({**TORCHRUN, "RANK": "8"})


def test_backend_choice():
    assert init.choose_backend("nccl", cuda_available=False) == "gloo"
    assert init.choose_backend("gloo", cuda_available=True) == "gloo"
    assert init.choose_backend("nccl", cuda_available=True) == "nccl"
    assert init.choose_backend(None, cuda_available=True) == "nccl"


# ----------------------------------------------------------------------------------
# Start-up on real processes.
# ----------------------------------------------------------------------------------
BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--micro-batch-size",
    "1",
    "--seq-length",
    "8",
    "--train-iters",
    "2",
    "--lr",
    "1e-3",
    "--seed",
    "77",
]


def _layout_and_seeds(rank, world_size):
    from megatron.core import parallel_state
    from megatron.training.arguments import parse_args, validate_args

    out = {}
    for name, extra in (
        ("pp", ["--pipeline-model-parallel-size", "2"]),
        ("tp", ["--tensor-model-parallel-size", "2"]),
        ("dp", ["--data-parallel-random-init"]),
    ):
        args = validate_args(parse_args(BASE + extra), world_size)
        groups = init.initialize_distributed(args)
        used = init.set_random_seed(args.seed, args.data_parallel_random_init, groups, tracker=CudaRNGStatesTracker())
        out[name] = dict(
            seed=used,
            torch=torch.rand(3).tolist(),
            numpy=np.random.rand(2).tolist(),
            tp=groups.size_of("tp"),
            pp=groups.size_of("pp"),
            dp=groups.size_of("dp"),
            rank=args.rank,
            world=args.world_size,
        )
        init.shutdown_distributed()  # forgets the groups, keeps the harness's own process group
        out[name]["after"] = (torch.distributed.is_initialized(), parallel_state.model_parallel_is_initialized())
    return out


def test_initialize_on_two_ranks():
    results = run_distributed(_layout_and_seeds, 2, timeout=120)
    for rank, res in enumerate(results):
        assert res["pp"]["seed"] == 77 + 100 * rank  # PP rank == global rank with TP=1, PP=2
        assert (res["pp"]["pp"], res["tp"]["tp"], res["dp"]["dp"]) == (2, 2, 2)
        assert res["tp"]["seed"] == 77
        assert all(res[name]["after"] == (True, False) for name in ("pp", "tp", "dp"))
        assert res["dp"]["seed"] == 77 + 10 * rank
        assert res["tp"]["rank"] == rank and res["tp"]["world"] == 2
        gen = torch.Generator().manual_seed(res["pp"]["seed"])
        assert res["pp"]["torch"] == torch.rand(3, generator=gen).tolist()
        assert res["dp"]["numpy"] == np.random.RandomState(res["dp"]["seed"]).rand(2).tolist()
    # TP ranks draw the same default stream; PP stages different ones.
    assert results[0]["tp"]["torch"] == results[1]["tp"]["torch"]
    assert results[0]["pp"]["torch"] != results[1]["pp"]["torch"]


def test_initialize_megatron_creates_process_group_from_torchrun_env():
    port = free_port()
    code = (
        "import torch.distributed as dist\n"
        "from megatron.core import parallel_state\n"
        "from megatron.training.initialize import initialize_megatron, shutdown_distributed\n"
        "from megatron.core.num_microbatches_calculator import get_num_microbatches\n"
        f"args = initialize_megatron({BASE!r} + ['--global-batch-size', '4'])\n"
        "print(dist.get_backend(), dist.get_world_size(), args.data_parallel_size, get_num_microbatches())\n"
        "shutdown_distributed()\n"
        "print(dist.is_initialized(), parallel_state.model_parallel_is_initialized())\n"
    )
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "CUDA_VISIBLE_DEVICES": "",
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # The group it started is destroyed again, so no gloo thread outlives the interpreter.
    lines = out.stdout.splitlines()
    assert sum("host allocator:" in line for line in lines) == 1  # a CPU run says what it did to the host heap
    assert sum(line.startswith(" > enabled: fp32 | TP=1 PP=1") for line in lines) == 1  # what the flags switch on
    end = lines.index("-------------------- end of arguments ---------------------")  # Megatron's argument dump
    rest = " ".join(line for line in lines[end + 1 :] if "host allocator:" not in line and "> enabled:" not in line)
    assert rest.split() == ["gloo", "1", "1", str(4 // 1), "False", "False"]


def test_fake_launch_env_reads_rank_and_world_size_only():
    assert init.read_fake_launch_env({"RANK": "5", "WORLD_SIZE": "64"}) == init.LaunchEnv(5, 64, 0, "", 0, "fake")
    assert init.read_fake_launch_env({}) == init.LaunchEnv(0, 1, 0, "", 0, "fake")
    with pytest.raises(init.LaunchEnvError, match="RANK=8 is outside WORLD_SIZE=8"):
        init.read_fake_launch_env({"RANK": "8", "WORLD_SIZE": "8"})


def test_fake_process_group_plays_one_rank_of_a_large_world():
    """--fake-process-group: rank 5 of 8 (TP2 x PP2 x DP2) in one process, no rendezvous, no peers."""
    code = (
        "import torch.distributed as dist\n"
        "from megatron.core import parallel_state as ps\n"
        "from megatron.training.initialize import initialize_megatron, shutdown_distributed\n"
        f"args = initialize_megatron({BASE!r} + ['--tensor-model-parallel-size', '2', "
        "'--pipeline-model-parallel-size', '2', '--fake-process-group'])\n"
        "print(dist.get_backend(), dist.get_rank(), dist.get_world_size(), ps.get_tensor_model_parallel_rank(),\n"
        "      ps.get_pipeline_model_parallel_rank(), args.data_parallel_size)\n"
        "shutdown_distributed()\n"
        "print(dist.is_initialized())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(RANK="5", WORLD_SIZE="8", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["fake", "5", "8", "1", "1", "2", "False"]
