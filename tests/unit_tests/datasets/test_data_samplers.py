"""Pretraining samplers: DP ranks get disjoint slices; consumed_samples resumes exactly."""

import itertools

import pytest
import torch

from megatron.core.datasets.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)


def sequential(total, consumed, mbs, dp, drop_last=True):
    return [list(MegatronPretrainingSampler(total, consumed, mbs, r, dp, drop_last)) for r in range(dp)]


def test_sequential_global_batches_are_split_in_order():
    per_rank = sequential(total=50, consumed=0, mbs=2, dp=3)
    assert per_rank[0][:2] == [[0, 1], [6, 7]] and per_rank[2][0] == [4, 5]
    for step in zip(*per_rank):  # one global step: consecutive indices, rank by rank
        flat = [i for batch in step for i in batch]
        assert flat == list(range(flat[0], flat[0] + 6))
    used = [i for batches in per_rank for b in batches for i in b]
    assert sorted(used) == list(range(48))  # 50 = 8 full steps of 6 + 2 dropped


def test_sequential_resume_and_tail():
    full = sequential(50, 0, 2, 3)
    resumed = sequential(50, 3 * 6, 2, 3)
    assert [r[3:] for r in full] == resumed
    tail = sequential(50, 0, 2, 3, drop_last=False)
    assert tail[0][-1] == [48, 49] and len(tail[1]) == len(full[1])


def random_epoch(total, consumed, mbs, dp, sharding, seed=0):
    return [
        list(MegatronPretrainingRandomSampler(None, total, consumed, mbs, r, dp, sharding, seed)) for r in range(dp)
    ]


@pytest.mark.parametrize("sharding", [True, False])
def test_random_sampler_disjoint_and_resumable(sharding):
    total, mbs, dp = 53, 2, 3
    per_rank = random_epoch(total, 0, mbs, dp, sharding)
    used = [i for batches in per_rank for b in batches for i in b]
    assert len(used) == len(set(used)) and all(0 <= i < total for i in used)
    assert len(used) == (total // (mbs * dp)) * mbs * dp
    resumed = random_epoch(total, 4 * mbs * dp, mbs, dp, sharding)
    assert [r[4:] for r in per_rank] == resumed
    next_epoch = random_epoch(total, total - total % (mbs * dp), mbs, dp, sharding)
    assert next_epoch != per_rank  # a new permutation every epoch
    assert random_epoch(total, 0, mbs, dp, sharding, seed=1) != per_rank


def test_data_loader_batches_dict_samples():
    data = [{"tokens": torch.full((4,), i)} for i in range(20)]
    loader = build_pretraining_data_loader(
        data, consumed_samples=8, micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2
    )
    first = next(iter(loader))
    assert first["tokens"][:, 0].tolist() == [10, 11]
    cyclic = build_pretraining_data_loader(data, 0, 2, 0, 2, dataloader_type="cyclic")
    assert sum(1 for _ in itertools.islice(cyclic, 100)) == 5
    assert build_pretraining_data_loader(None, 0, 1, 0, 1) is None
    with pytest.raises(ValueError, match="dataloader_type"):
        build_pretraining_data_loader(data, 0, 1, 0, 1, dataloader_type="external")
