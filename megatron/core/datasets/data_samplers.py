"""Micro-batch samplers for pretraining: each data-parallel rank gets its slice of every global step.

``consumed_samples`` (samples of all DP ranks already trained on) lets a resumed run continue
exactly where the saved one stopped.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional

import torch


def _check_common(
    total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int
) -> None:
    if total_samples <= 0:
        raise ValueError(f"total_samples={total_samples}: no sample to draw")
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples={consumed_samples}: must be >= 0")
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size={micro_batch_size}: must be positive")
    if data_parallel_size <= 0:
        raise ValueError(f"data_parallel_size={data_parallel_size}: must be positive")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data_parallel_rank={data_parallel_rank}: must lie in [0, {data_parallel_size})")


class MegatronPretrainingSampler:
    """Sequential batches: each step takes the next ``micro_batch_size * dp`` indices, in order,
    and DP rank r gets the r-th run of ``micro_batch_size`` of them.

    Args:
        total_samples: length of the dataset.
        consumed_samples: indices already used (by all ranks); iteration starts there.
        micro_batch_size: samples per micro batch per rank.
        data_parallel_rank: this rank's position in the data-parallel group.
        data_parallel_size: number of data-parallel ranks.
        drop_last: drop a last incomplete step; otherwise yield this rank's part of it.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        _check_common(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        if consumed_samples >= total_samples:
            raise ValueError(f"consumed_samples={consumed_samples}: no samples left of {total_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.step = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _mine(self, batch: List[int]) -> List[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start : start + self.micro_batch_size]

    def __iter__(self) -> Iterator[List[int]]:
        for start in range(self.consumed_samples, self.total_samples - self.step + 1, self.step):
            yield self._mine(list(range(start, start + self.step)))
        left = (self.total_samples - self.consumed_samples) % self.step
        if left and not self.drop_last:
            tail = self._mine(list(range(self.total_samples - left, self.total_samples)))
            if tail:
                yield tail


class MegatronPretrainingRandomSampler:
    """Shuffled batches, a new permutation per epoch (seeded with ``seed + epoch``).

    With ``data_sharding`` each DP rank owns a contiguous bucket of the dataset and shuffles
    within it; otherwise one permutation of the dataset is dealt round-robin to the ranks.
    A last incomplete step of each epoch is dropped.

    Args:
        dataset: the dataset (only its length is used).
        total_samples: samples per epoch (normally ``len(dataset)``).
        consumed_samples: samples already used by all ranks, over all epochs.
        micro_batch_size, data_parallel_rank, data_parallel_size: as for the sequential sampler.
        data_sharding: shuffle within per-rank buckets.
        seed: base seed of the per-epoch permutations.
    """

    def __init__(
        self,
        dataset: Any,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool = True,
        seed: int = 0,
    ) -> None:
        _check_common(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.step = micro_batch_size * data_parallel_size
        if total_samples < self.step:
            raise ValueError(f"total_samples={total_samples}: fewer than one global step of {self.step}")
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.seed = seed
        self.last_batch_size = total_samples % self.step

    def __len__(self) -> int:
        return self.total_samples

    def _epoch_indices(self, epoch: int, done_in_epoch: int) -> List[int]:
        """This rank's remaining indices of ``epoch`` after ``done_in_epoch`` samples (all ranks)."""
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        if self.data_sharding:
            bucket = (self.total_samples // self.step) * self.micro_batch_size
            order = torch.randperm(bucket, generator=g).tolist()
            first = self.data_parallel_rank * bucket
            return [first + x for x in order[done_in_epoch // self.data_parallel_size :]]
        # Whole global steps only, so every rank gets the same number of micro batches.
        full = (self.total_samples // self.step) * self.step
        order = torch.randperm(full, generator=g).tolist()[done_in_epoch:]
        return order[self.data_parallel_rank :: self.data_parallel_size]

    def __iter__(self) -> Iterator[List[int]]:
        active = self.total_samples - self.last_batch_size
        epoch, done = divmod(self.consumed_samples, active)
        if done % self.step:
            raise RuntimeError(
                f"consumed_samples={self.consumed_samples} is not a whole number of steps of {self.step}"
            )
        batch: List[int] = []
        for idx in self._epoch_indices(epoch, done):
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.step
                yield batch
                batch = []


def build_pretraining_data_loader(
    dataset: Any,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    dataloader_type: str = "single",
    num_workers: int = 0,
    data_sharding: bool = True,
    seed: int = 0,
    drop_last: bool = True,
) -> Optional[torch.utils.data.DataLoader]:
    """A DataLoader yielding this DP rank's micro batches (None when ``dataset`` is None).

    ``dataloader_type`` is Megatron's ``--dataloader-type``: ``single`` (sequential) or
    ``cyclic`` (reshuffled every epoch).
    """
    if dataset is None:
        return None
    if dataloader_type == "single":
        sampler: Any = MegatronPretrainingSampler(
            len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size, drop_last
        )
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(
            dataset,
            len(dataset),
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
            data_sharding,
            seed,
        )
    else:
        raise ValueError(f"dataloader_type={dataloader_type!r}: expected 'single' or 'cyclic'")
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=False, persistent_workers=num_workers > 0
    )
