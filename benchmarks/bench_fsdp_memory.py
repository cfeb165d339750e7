"""Parameter + gradient + optimizer bytes per rank under each Megatron-FSDP sharding strategy and FSDP2.

A GPT with bf16 parameters, bf16 gradients (no ``grad_reduce_in_fp32``) and Adam with fp32 main
weights trains one step on d = 2 and 4 gloo ranks under plain DDP, the distributed optimizer and
the three sharded strategies. Bytes are measured after the step (what a rank keeps between steps)
by summing the distinct tensor storages it holds: parameters (a freed storage counts 0) and their
shards, the gradient buffer and its shard, fp32 main weights, Adam moments; divided by the number
of parameters and printed beside the formula (bytes per parameter):

    no_shard (DDP)          2 + 2 + 4 + 8          = 16
    optim (dist. optimizer) 2 + 2 + (4 + 8) / d
    optim_grads             2 + (2 + 4 + 8) / d
    optim_grads_params      (2 + 2 + 4 + 8) / d    = 16 / d
    torch_fsdp2             (4 + 4 + 0 + 8) / d    = 16 / d

Hybrid sharding (``--num-distributed-optimizer-instances N``, rows ``N=2``) shards within an instance of
d / N ranks: the same formulas with d replaced by d / N (for every d divisible by N with d / N > 1).

``torch_fsdp2`` (``--use-torch-fsdp2``; the same GPT, untied) keeps the fp32 master values in its
parameter shards (gathered as bf16 for compute) and reduces into fp32 gradient shards, so it needs no
separate main weights: the same 16 / d bytes as Megatron's bf16 shards + bf16 gradients + fp32 copies.

Usage: python benchmarks/bench_fsdp_memory.py [--dp 2 4] [--instances 2] [--strategies optim torch_fsdp2]

Measured on the shared 2-core CPU machine (2026-12-02), 4 layers, hidden 256, vocabulary 1024
(3.43M parameters), measured / formula:
    d=2: no_shard 16.000 / 16.000, optim 10.000 / 10.000, optim_grads 9.000 / 9.000,
         optim_grads_params 8.000 / 8.000
    d=4: no_shard 16.000 / 16.000, optim 7.000 / 7.000, optim_grads 5.500 / 5.500,
         optim_grads_params 4.000 / 4.000 (every row +0.00%)
    d=4, N=2: optim 10.000 / 10.000, optim_grads 9.000 / 9.000, optim_grads_params 8.000 / 8.000 (+0.00%)
    torch_fsdp2 (untied: 3.69M parameters), d=4: params 1.000, grads 1.000, main 0.000, adam 2.000,
         total 4.000 / 4.000 (+0.00%), beside optim 7.000 / 7.000 in the same command
         (``--dp 4 --strategies optim torch_fsdp2``)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Iterable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed.torch_fully_sharded_data_parallel import (  # noqa: E402
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from tests.dist_harness import run_distributed  # noqa: E402
from tests.model_utils import batch, build_gpt, gpt2_style  # noqa: E402

MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=1024, max_sequence_length=64)
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params", "torch_fsdp2")
HYBRID_STRATEGIES = ("optim", "optim_grads", "optim_grads_params")  # with --num-distributed-optimizer-instances


def formula(strategy: str, d: int) -> float:
    """Bytes per parameter: bf16 parameters and gradients, fp32 main weights, two fp32 Adam moments."""
    param, grad, optim = 2, 2, 4 + 8
    return {
        "no_shard": param + grad + optim,
        "optim": param + grad + optim / d,
        "optim_grads": param + (grad + optim) / d,
        "optim_grads_params": (param + grad + optim) / d,
        "torch_fsdp2": (4 + 4 + 8) / d,  # fp32 parameter and gradient shards (the main weights), Adam
    }[strategy]


def _storage_bytes(tensors: Iterable) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped; a freed storage is 0 bytes)."""
    seen: Dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[id(storage) if storage.nbytes() == 0 else storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _measure_fsdp2(groups, bf16: Dict) -> Dict[str, float]:
    """The same step under FSDP2: bytes of the local shards of every DTensor parameter and gradient."""
    model = build_gpt(gpt2_style(**MODEL, **bf16, share_embeddings_and_output_weights=False), groups)
    n_params = sum(p.numel() for p in model.parameters())
    wrapped = TorchFullyShardedDataParallel(
        model.config, TorchFullyShardedDataParallelConfig(), model, pg_collection=groups
    )
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-4, **bf16), [wrapped], pg_collection=groups)
    tokens, labels = batch(b=2, s=64, vocab=MODEL["vocab_size"])
    wrapped.zero_grad_buffer()
    wrapped(tokens, None, None, labels=labels).mean().backward()
    assert opt.step()[0]
    parts = {
        "params": _storage_bytes(p.to_local() for p in model.parameters()),
        "grads": _storage_bytes(p.grad.to_local() for p in model.parameters()),
        "main": _storage_bytes(link.main for link in opt.links if link.is_copy),
        "adam": _storage_bytes(v for s in opt.state.values() for v in s.values() if v.dim() > 0),
    }
    return {k: v / n_params for k, v in parts.items()}


def _measure(rank: int, world_size: int, strategy: str, instances: int = 1) -> Dict[str, float]:
    groups = ps.initialize_model_parallel(num_distributed_optimizer_instances=instances)
    bf16 = {"params_dtype": torch.bfloat16, "bf16": True}
    if strategy == "torch_fsdp2":
        return _measure_fsdp2(groups, bf16)
    model = build_gpt(gpt2_style(**MODEL, **bf16), groups)
    n_params = sum(p.numel() for p in model.parameters())
    distributed = strategy != "no_shard"
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed,
        use_megatron_fsdp=distributed,
        data_parallel_sharding_strategy=strategy,
        num_distributed_optimizer_instances=instances,
    )
    ddp = DistributedDataParallel(model.config, ddp_config, model, pg_collection=groups)
    opt_config = OptimizerConfig(lr=1e-4, use_distributed_optimizer=distributed, **bf16)
    opt = get_megatron_optimizer(opt_config, [ddp], pg_collection=groups)
    tokens, labels = batch(b=2, s=64, vocab=MODEL["vocab_size"])
    ddp.zero_grad_buffer()
    ddp(tokens, None, None, labels=labels).mean().backward()
    ddp.finish_grad_sync()
    assert opt.step()[0]
    buffers = ddp.all_buffers
    parts = {
        "params": _storage_bytes([p.data for p in model.parameters()] + [b.param_shard for b in buffers]),
        "grads": _storage_bytes([b.grad_data for b in buffers] + [b.grad_shard for b in buffers]),
        "main": _storage_bytes(link.main for link in opt.links if link.is_copy),
        "adam": _storage_bytes(v for s in opt.state.values() for v in s.values() if v.dim() > 0),
    }
    return {k: v / n_params for k, v in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--instances", type=int, nargs="*", default=[2], help="hybrid rows: N instances")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    args = parser.parse_args()
    print("bytes/param per rank after a step (bf16 params and grads, fp32 main weights, Adam): measured vs formula")
    print(
        f"{'d':>2} {'N':>2} {'strategy':>19} {'params':>7} {'grads':>6} {'main':>6} {'adam':>6} {'total':>7} "
        f"{'formula':>8}"
    )
    for d in args.dp:
        rows = [(1, s) for s in args.strategies]
        hybrid = [s for s in args.strategies if s in HYBRID_STRATEGIES]  # sharded by the distributed optimizer
        rows += [(n, s) for n in args.instances if d % n == 0 and d // n > 1 for s in hybrid]
        for instances, strategy in rows:
            m = run_distributed(_measure, d, strategy, instances, timeout=600)[0]
            total, want = sum(m.values()), formula(strategy, d // instances)
            print(
                f"{d:>2} {instances:>2} {strategy:>19} {m['params']:7.3f} {m['grads']:6.3f} {m['main']:6.3f} "
                f"{m['adam']:6.3f} {total:7.3f} {want:8.3f}  ({100 * (total / want - 1):+.2f}%)",
                flush=True,
            )


if __name__ == "__main__":
    main()
