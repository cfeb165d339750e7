"""How long a training step is blocked by a checkpoint save, synchronous vs ``--async-save``, side by side.

A GPT-2-style model (DP ranks on gloo, the distributed optimizer, one Adam step so its state exists) is
saved through ``save_checkpoint`` twice: synchronously, then asynchronously. The blocked time of the
asynchronous save is what the training thread spends in it: the call (plan and host snapshot) plus the
finalization once every rank's writer has finished (``.metadata``, ``metadata.json``, the tracker);
the writing itself overlaps training. Both directories must hold the same bytes (DCP's per-save id in
``.metadata`` aside, see ``tests/unit_tests/dist_checkpointing/test_async_save.py``).

Host memory: each rank's peak resident memory above its level before the call (Linux ``VmHWM``, reset
through ``/proc/self/clear_refs``) while the optimizer state is made ready to write: the gather of the
whole state onto DP rank 0 that the save did before (``state_dict_by_param_name``, still what the legacy
format writes) against this rank's own slices (``sharded_state_to_save``, plus the async snapshot).

Usage: python benchmarks/bench_async_save.py [--dp 2] [--hidden 512] [--layers 4] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Callable, Dict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.dist_checkpointing.async_save import AsyncCallsQueue  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.training.checkpointing import CheckpointConfig, save_checkpoint  # noqa: E402
from tests.dist_harness import run_distributed  # noqa: E402
from tests.model_utils import batch, build_gpt, gpt2_style  # noqa: E402
from tests.unit_tests.dist_checkpointing.ckpt_utils import groups_for  # noqa: E402
from tests.unit_tests.dist_checkpointing.test_async_save import checkpoint_content  # noqa: E402


def peak_rss_growth(fn: Callable[[], object]) -> float:
    """MiB of resident memory ``fn`` added at its peak (VmHWM after a reset, minus VmRSS before)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field))

    before = status("VmRSS:")
    result = fn()
    growth = (status("VmHWM:") - before) / 1024.0
    del result
    return growth


def _build(hidden: int, layers: int, vocab: int):
    groups = groups_for(1)
    model = build_gpt(
        gpt2_style(hidden_size=hidden, num_layers=layers, num_attention_heads=8, vocab_size=vocab), groups, seed=1
    )
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model, pg_collection=groups
    )
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [ddp], pg_collection=groups)
    tokens, labels = batch(seed=groups.rank_in("dp"), b=1, vocab=vocab)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(tokens, None, None, labels=labels).float().mean().backward()
    finalize_model_grads([ddp], None, groups)
    opt.step()
    return groups, ddp, opt


def _body(rank: int, world: int, tmp: str, hidden: int, layers: int, vocab: int) -> Dict[str, float]:
    from megatron.core.dist_checkpointing.serialization import _snapshot
    from megatron.training.checkpoint_formats.torch_dist import optimizer_pieces

    groups, ddp, opt = _build(hidden, layers, vocab)
    out: Dict[str, float] = {"dp_rank": groups.rank_in("dp")}
    out["ours_mib"] = peak_rss_growth(lambda: optimizer_pieces([ddp], opt, groups))
    out["ours_async_mib"] = peak_rss_growth(
        lambda: [_snapshot(p) for p in optimizer_pieces([ddp], opt, groups)[0].values()]
    )
    out["gather_mib"] = peak_rss_growth(lambda: opt.state_dict_by_param_name([ddp]))
    torch.distributed.barrier()

    sync_cfg, async_cfg = (CheckpointConfig(save=os.path.join(tmp, m)) for m in ("sync", "async"))
    queue = AsyncCallsQueue()
    for iteration in (1, 2):  # the second save of each kind is timed: steady state, buffers reused
        start = time.perf_counter()
        save_checkpoint(iteration, [ddp], opt, None, sync_cfg, {}, {})
        out["sync_s"] = time.perf_counter() - start
        start = time.perf_counter()
        save_checkpoint(iteration, [ddp], opt, None, async_cfg, {}, {}, async_queue=queue)
        out["schedule_s"] = time.perf_counter() - start
        queue._pending[0].done.wait()  # training would run meanwhile; then every rank sees the writes done
        torch.distributed.barrier()
        start = time.perf_counter()
        assert queue.maybe_finalize_async_calls(blocking=False) == [iteration - 1]
        out["finalize_s"] = time.perf_counter() - start
    queue.close()
    if rank == 0:
        sync, asynchronous = (checkpoint_content(os.path.join(tmp, m, "iter_0000002")) for m in ("sync", "async"))
        out["same_bytes"] = float(sync == asynchronous)
        out["bytes"] = float(sum(len(v) for k, v in sync.items() if isinstance(v, bytes)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_body, args.dp, tmp, args.hidden, args.layers, args.vocab, timeout=900)
    first = results[0]
    same = bool(first["same_bytes"])
    print(f"checkpoint: {first['bytes'] / 2**20:.1f} MiB on disk, DP={args.dp}; identical bytes: {same}")
    print(f"{'rank':>4} {'sync save s':>12} {'async blocked s':>16} {'(call + finalize)':>20} {'blocked/sync':>13}")
    for rank, r in enumerate(results):
        blocked = r["schedule_s"] + r["finalize_s"]
        print(
            f"{rank:>4} {r['sync_s']:>12.3f} {blocked:>16.3f} "
            f"{r['schedule_s']:>9.3f} + {r['finalize_s']:<8.3f} {blocked / r['sync_s']:>13.1%}"
        )
    print("peak host memory added while the optimizer state is made ready to write (MiB):")
    heads = ("gather onto DP 0 (before)", "own slices (sync)", "+ snapshot (async)")
    print(f"{'rank':>4} {'DP rank':>8} {heads[0]:>26} {heads[1]:>18} {heads[2]:>19}")
    for rank, r in enumerate(results):
        print(
            f"{rank:>4} {int(r['dp_rank']):>8} {r['gather_mib']:>26.1f} {r['ours_mib']:>18.1f} "
            f"{r['ours_async_mib']:>19.1f}"
        )
    before = max(r["gather_mib"] for r in results)
    now = max(max(r["ours_mib"], r["ours_async_mib"]) for r in results)
    ratio = f"{now / before:.2f}; 1/DP = {1 / args.dp:.2f}"
    print(f"writing rank's peak: {now:.1f} MiB now vs {before:.1f} MiB before ({ratio})")


if __name__ == "__main__":
    main()
