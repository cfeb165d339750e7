"""Train/valid/test data iterators for the training loop, from a dataset provider and the ``TrainingConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence

from megatron.core.datasets.data_samplers import build_pretraining_data_loader
from megatron.core.datasets.utils import get_num_samples
from megatron.core.datasets.vocab_check import check_token_ids_in_vocabulary
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.training.training_config import TrainingConfig

DatasetProvider = Callable[[List[int]], Sequence[Any]]


@dataclass
class DataIterators:
    """One iterator per model chunk for each split (None where a split has no data)."""

    train: Optional[List[Iterator]]
    valid: Optional[List[Iterator]]
    test: Optional[List[Iterator]]


@dataclass(frozen=True)
class VocabularyCheck:
    """The padded vocabulary every token id of the data must fit, and how it was sized (named in the error)."""

    padded_vocab_size: int
    origin: str  # the flags that sized it: tokenizer, --vocab-size, padding

    def __call__(self, datasets: Sequence[Any]) -> None:
        """Stop (on every rank) if a dataset holds token ids the padded vocabulary lacks."""
        check_token_ids_in_vocabulary(datasets, self.padded_vocab_size, self.origin)


def samples_per_split(cfg: TrainingConfig) -> List[int]:
    """Samples the run will draw from train, valid and test (Megatron's accounting)."""
    if cfg.train_samples is not None:
        train_iters = cfg.train_samples // cfg.global_batch_size
        sizes = get_num_samples(train_iters, cfg.global_batch_size, cfg.eval_interval, cfg.eval_iters)
        sizes[0] = cfg.train_samples
        return sizes
    return get_num_samples(cfg.train_iters, cfg.global_batch_size, cfg.eval_interval, cfg.eval_iters)


def _forever(loader: Any) -> Iterator:
    while True:
        yield from loader


def _iterators(
    dataset: Any, consumed: int, cfg: TrainingConfig, groups: ProcessGroupCollection, num_chunks: int, cyclic: bool
) -> Optional[List[Iterator]]:
    """``num_chunks`` identical iterators (each chunk of a virtual pipeline reads its own)."""
    if dataset is None or len(dataset) == 0:
        return None
    out = []
    for _ in range(num_chunks):
        loader = build_pretraining_data_loader(
            dataset,
            consumed % len(dataset) if cyclic else consumed,
            cfg.micro_batch_size,
            groups.rank_in("dp"),
            groups.size_of("dp"),
            cfg.dataloader_type or "single",
            cfg.num_workers,
            seed=cfg.seed,
        )
        # Evaluation restarts its split when it runs out, as Megatron's cyclic iterator does.
        out.append(_forever(loader) if cyclic else iter(loader))
    return out


def build_data_iterators(
    provider: DatasetProvider,
    cfg: TrainingConfig,
    groups: ProcessGroupCollection,
    num_chunks: int,
    consumed_train: int,
    consumed_valid: int,
    vocabulary: Optional[VocabularyCheck] = None,
) -> DataIterators:
    """Call ``provider(samples_per_split)``, check the token ids against the vocabulary (unless
    ``vocabulary`` is None: mock data), and wrap each split in per-DP-rank iterators."""
    train_ds, valid_ds, test_ds = provider(samples_per_split(cfg))
    if vocabulary is not None:
        vocabulary([train_ds, valid_ds, test_ds])
    return DataIterators(
        train=_iterators(train_ds, consumed_train, cfg, groups, num_chunks, cyclic=False),
        valid=_iterators(valid_ds, consumed_valid, cfg, groups, num_chunks, cyclic=True),
        test=_iterators(test_ds, 0, cfg, groups, num_chunks, cyclic=True),
    )
