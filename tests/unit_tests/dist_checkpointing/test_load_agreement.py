"""``load_checkpoint`` decides together: no rank leaves while the others wait in a collective.

Two ranks (TP=2) save iterations 10 and 20. Then rank 1 alone sees a different file system (a
shared file system after a requeue): an older tracker, no tracker, or a common state it cannot
read. Global rank 0 reads the tracker and detects the format, every rank takes its answer, and a
check that fails on one rank fails on all: both ranks load iteration 20, or both raise, within a
timeout far below the harness default (a rank that returned early would leave the other hanging).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron.core.dist_checkpointing import CheckpointingError
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.training import checkpoint_dirs
from megatron.training import checkpointing as ckpt
from megatron.training.checkpoint_formats import torch_dist
from megatron.training.checkpointing import CheckpointConfig, load_checkpoint, save_checkpoint
from tests.dist_harness import run_distributed
from tests.unit_tests.dist_checkpointing.ckpt_utils import (
    assert_same_weights,
    build_stage,
    full_weights_by_key,
    groups_for,
)

HANG_TIMEOUT_S = 150


def _model(groups, seed: int):
    return build_stage("gpt2", groups, seed)


def _stale_tracker(root):
    return 10, False


def _no_tracker(root):
    return None


def _unreadable(path, what):
    raise CheckpointingError(f"cannot read {what} {path}: injected on rank 1")


def _on_rank1(monkeypatch_pairs):
    """Apply ``(module, name, replacement)`` on rank 1 only; returns an undo function."""
    undo = []
    if dist.get_rank() == 1:
        for module, name, replacement in monkeypatch_pairs:
            undo.append((module, name, getattr(module, name)))
            setattr(module, name, replacement)

    def restore():
        for module, name, original in undo:
            setattr(module, name, original)

    return restore


def _body(rank: int, world_size: int, tmp: str):
    groups = groups_for(tp=2)
    model_parallel_cuda_manual_seed(123, tp_rank=groups.rank_in("tp"), ep_rank=0, etp_rank=0)
    cfg = CheckpointConfig(save=tmp, load=tmp)
    save_checkpoint(10, [_model(groups, 1)], None, None, cfg, {}, {})
    newest = _model(groups, 2)
    save_checkpoint(20, [newest], None, None, cfg, {}, {})
    expected = full_weights_by_key(newest, groups)
    seen = {}
    trackers = {"stale": _stale_tracker, "missing": _no_tracker}
    for what, fake in trackers.items():  # the tracker, as read by the old and the new code
        restore = _on_rank1([(ckpt, "read_tracker", fake), (checkpoint_dirs, "read_tracker", fake)])
        try:
            model = _model(groups, 3)
            seen[what] = load_checkpoint([model], None, None, cfg)[0]
        finally:
            restore()
        assert_same_weights(expected, full_weights_by_key(model, groups))
    restore = _on_rank1([(torch_dist, "read_json", _unreadable)])
    try:
        with pytest.raises(CheckpointingError, match="injected on rank 1"):
            load_checkpoint([_model(groups, 4)], None, None, cfg)
    finally:
        restore()
    return seen


def test_a_rank_with_a_stale_view_loads_what_rank_0_found_and_nobody_hangs(tmp_path):
    seen = run_distributed(_body, 2, str(tmp_path), timeout=HANG_TIMEOUT_S)
    assert seen == [{"stale": 20, "missing": 20}] * 2, seen
