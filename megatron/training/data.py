"""Train/valid/test data iterators for the training loop, from a dataset provider and the flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence

from megatron.core.datasets.data_samplers import build_pretraining_data_loader
from megatron.core.datasets.utils import get_num_samples
from megatron.core.datasets.vocab_check import check_token_ids_in_vocabulary
from megatron.core.parallel_state import ProcessGroupCollection

DatasetProvider = Callable[[List[int]], Sequence[Any]]


@dataclass
class DataIterators:
    """One iterator per model chunk for each split (None where a split has no data)."""

    train: Optional[List[Iterator]]
    valid: Optional[List[Iterator]]
    test: Optional[List[Iterator]]


def samples_per_split(args: argparse.Namespace) -> List[int]:
    """Samples the run will draw from train, valid and test (Megatron's accounting)."""
    if args.train_samples is not None:
        train_iters = args.train_samples // args.global_batch_size
        sizes = get_num_samples(train_iters, args.global_batch_size, args.eval_interval, args.eval_iters)
        sizes[0] = args.train_samples
        return sizes
    return get_num_samples(args.train_iters, args.global_batch_size, args.eval_interval, args.eval_iters)


def _forever(loader: Any) -> Iterator:
    while True:
        yield from loader


def _iterators(
    dataset: Any, consumed: int, args: argparse.Namespace, groups: ProcessGroupCollection, num_chunks: int, cyclic: bool
) -> Optional[List[Iterator]]:
    """``num_chunks`` identical iterators (each chunk of a virtual pipeline reads its own)."""
    if dataset is None or len(dataset) == 0:
        return None
    out = []
    for _ in range(num_chunks):
        loader = build_pretraining_data_loader(
            dataset,
            consumed % len(dataset) if cyclic else consumed,
            args.micro_batch_size,
            groups.rank_in("dp"),
            groups.size_of("dp"),
            args.dataloader_type or "single",
            args.num_workers,
            seed=args.seed,
        )
        # Evaluation restarts its split when it runs out, as Megatron's cyclic iterator does.
        out.append(_forever(loader) if cyclic else iter(loader))
    return out


def check_data_vocabulary(datasets: Sequence[Any], args: argparse.Namespace) -> None:
    """Stop (on every rank) if a data prefix holds token ids the padded vocabulary lacks; not for mock data."""
    if getattr(args, "mock_data", False):
        return
    origin = (
        f"--tokenizer-type {args.tokenizer_type}"
        + (f" --vocab-size {args.vocab_size}" if getattr(args, "vocab_size", None) else "")
        + f", padded to a multiple of --make-vocab-size-divisible-by {args.make_vocab_size_divisible_by}"
        f" x --tensor-model-parallel-size {args.tensor_model_parallel_size}"
    )
    check_token_ids_in_vocabulary(datasets, args.padded_vocab_size, origin)


def build_data_iterators(
    provider: DatasetProvider,
    args: argparse.Namespace,
    groups: ProcessGroupCollection,
    num_chunks: int,
    consumed_train: int,
    consumed_valid: int,
) -> DataIterators:
    """Call ``provider(samples_per_split)``, check the token ids against the vocabulary, and wrap
    each split in per-DP-rank iterators."""
    train_ds, valid_ds, test_ds = provider(samples_per_split(args))
    check_data_vocabulary([train_ds, valid_ds, test_ds], args)
    return DataIterators(
        train=_iterators(train_ds, consumed_train, args, groups, num_chunks, cyclic=False),
        valid=_iterators(valid_ds, consumed_valid, args, groups, num_chunks, cyclic=True),
        test=_iterators(test_ds, 0, args, groups, num_chunks, cyclic=True),
    )
