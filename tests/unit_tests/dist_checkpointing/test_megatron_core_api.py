"""Megatron-core's sharded-state-dict vocabulary, used as its callers use it, on 2 gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import (
    CheckpointingError,
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, apply_factories
from tests.dist_harness import run_distributed

COMMON = {"iteration": 7, "args": {"lr": 0.5, "name": "run"}}


def _split_build(key, data, replica_id, flattened_range):
    """A factory's build_fn: store the tensor as two halves under their own keys."""
    rank = torch.distributed.get_rank()
    half = data.numel() // 2
    return {
        "a": ShardedTensor.from_rank_offsets(f"{key}.a", data[:half], (0, rank, 2), replica_id=replica_id),
        "b": ShardedTensor.from_rank_offsets(f"{key}.b", data[half:], (0, rank, 2), replica_id=replica_id),
    }


def _state(rank: int, fill: float = None) -> ShardedStateDict:
    """Every leaf kind; ``fill`` replaces the tensor values (a load target)."""

    def value(t):
        return t if fill is None else torch.full_like(t, fill)

    return {
        "model": {
            "w": ShardedTensor.from_rank_offsets("w", value(torch.full((2, 3), float(rank))), (0, rank, 2)),
            "stack": [
                ShardedTensor.from_rank_offsets(
                    "layers.w", value(torch.arange(3.0) + 10 * rank), (0, rank, 2), prepend_axis_num=1
                )
            ],
            "bias": ShardedTensor.from_rank_offsets("bias", value(torch.ones(4)), replica_id=(0, rank)),
        },
        "rng": ShardedObject("rng", {"rank": rank, "state": torch.tensor([rank, 1])}, (2,), (rank,)),
        "fac": ShardedTensorFactory(
            "fac", value(torch.arange(4.0) + rank), _split_build, lambda d: torch.cat([d["a"], d["b"]])
        ),
        "local": LocalNonpersistentObject(f"mine-{rank}"),
        **COMMON,
    }


def _round_trip(rank: int, world_size: int, checkpoint_dir: str):
    dist_checkpointing.save(_state(rank), checkpoint_dir)
    loaded = dist_checkpointing.load(_state(rank, fill=-1.0), checkpoint_dir)
    expected = _state(rank)
    plain = dist_checkpointing.load_plain_tensors(checkpoint_dir)
    factories = {"f": ShardedTensorFactory("fac", torch.zeros(4), _split_build, sum)}
    apply_factories(factories)
    return {
        "tensor": torch.equal(loaded["model"]["w"], expected["model"]["w"].data),
        "prepended_axis_dropped": torch.equal(loaded["model"]["stack"][0], torch.arange(3.0) + 10 * rank),
        "replicated": torch.equal(loaded["model"]["bias"], torch.ones(4)),
        "object": loaded["rng"]["rank"] == rank and torch.equal(loaded["rng"]["state"], torch.tensor([rank, 1])),
        "factory_merged": torch.equal(loaded["fac"], torch.arange(4.0) + rank),
        "local_kept": loaded["local"] == f"mine-{rank}",
        "common_merged": loaded["iteration"] == 7 and loaded["args"] == COMMON["args"],
        "common_api": dist_checkpointing.load_common_state_dict(checkpoint_dir) == COMMON,
        "plain_whole": torch.equal(plain["w"], torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2))
        and tuple(plain["layers.w"].shape) == (2, 3)
        and tuple(plain["fac.a"].shape) == (4,),
        "apply_factories": set(factories["f"]) == {"a", "b"} and factories["f"]["a"].key == "fac.a",
        "tensors_metadata": dist_checkpointing.load_tensors_metadata(checkpoint_dir)["w"].global_shape == (4, 3),
    }


def _refusals(rank: int, world_size: int, checkpoint_dir: str):
    errors = {}
    bad_object = {"o": ShardedObject("o", object() if rank == 1 else 1, (2,), (rank,))}
    with pytest.raises(CheckpointingError, match="cannot be stored as plain data"):
        dist_checkpointing.save(bad_object, checkpoint_dir)  # one rank's bad value raises on both
    errors["plain_only"] = True
    with pytest.raises(CheckpointingError, match="not a safe relative path"):
        dist_checkpointing.save({"o": ShardedObject("../o", 1, (2,), (rank,))}, checkpoint_dir)
    errors["safe_keys"] = True
    with pytest.raises(CheckpointingError, match="sharded_strategy=.*not supported yet"):
        dist_checkpointing.save({}, checkpoint_dir, sharded_strategy=("zarr", 1))
    errors["strategy"] = True
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, rank, 2))}, checkpoint_dir)
    with pytest.raises(CheckpointingError, match="sharded object"):
        dist_checkpointing.load({"missing": ShardedObject("missing", None, (2,), (rank,))}, checkpoint_dir)
    errors["missing_object"] = True
    return errors


def test_nested_state_dict_round_trip(tmp_path):
    results = run_distributed(_round_trip, 2, str(tmp_path / "ckpt"))
    for checks in results:
        assert checks == dict.fromkeys(checks, True), checks
    assert (tmp_path / "ckpt" / "common_state.json").exists()
    assert (tmp_path / "ckpt" / "rng" / "shard_1_2.json").exists()
    assert dist_checkpointing.check_is_distributed_checkpoint(str(tmp_path / "ckpt"))
    assert not dist_checkpointing.check_is_distributed_checkpoint(str(tmp_path))


def test_refusals_agree_across_ranks(tmp_path):
    for checks in run_distributed(_refusals, 2, str(tmp_path / "ckpt")):
        assert all(checks.values()) and len(checks) == 4


def test_from_rank_offsets_geometry():
    t = ShardedTensor.from_rank_offsets("k", torch.zeros(2, 5), (1, 3, 4), replica_id=(0, 1))
    assert t.global_shape == (2, 20) and t.global_offset == (0, 15) and t.replica_id != 0
    stacked = ShardedTensor.from_rank_offsets("s", torch.zeros(5), (0, 1, 3), prepend_axis_num=1)
    assert stacked.global_shape == (3, 5) and stacked.global_offset == (1, 0) and stacked.data_shape == (5,)
    with pytest.raises(ValueError, match="rank offset"):
        ShardedTensor.from_rank_offsets("k", torch.zeros(2), (0, 2, 2))
    with pytest.raises(NotImplementedError, match="flattened_range"):
        ShardedTensor.from_rank_offsets("k", torch.zeros(2), flattened_range=slice(0, 1))
    with pytest.raises(ValueError, match="outside shape"):
        ShardedObject("o", 1, (2,), (2,))
    assert os.path.basename(ShardedObject("a/b", 1, (2, 3), (1, 2)).unique_key) == "shard_1.2_2.3"
