"""The T5 dataset tests' corpus (BERT's, with 100 sentinels) and config helpers."""

from typing import Any, Dict, List, Optional

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
from tests.unit_tests.datasets.bert_corpus import write_bert_corpus

T5_FIELDS = ("text_enc", "text_dec", "labels", "loss_mask", "truncated", "enc_mask", "dec_mask")
SENTINELS = 100  # Megatron's T5 examples: --vocab-extra-ids 100

# Megatron's pretrain_t5.py settings (mask/short-seq probabilities are the flags' defaults).
PRETRAIN_T5 = dict(
    masking_probability=0.15, short_sequence_probability=0.1, masking_max_ngram=10, masking_do_full_word=True,
    masking_do_permutation=False, masking_use_longer_ngrams=False, masking_use_geometric_distribution=True,
)  # fmt: skip


def write_t5_corpus(directory: str, seed: int = 0, sentinels: int = SENTINELS) -> Dict[str, Any]:
    """BERT's test corpus; the tokenizer has ``sentinels`` ``<extra_id_N>`` tokens."""
    return write_bert_corpus(directory, seed=seed, vocab_extra_ids=sentinels)


def t5_settings(cache: str, **overrides: Any) -> Dict[str, Any]:
    """The test settings (64-token encoder, 32-token decoder, 80/20 split), ``overrides`` on top."""
    kwargs = dict(random_seed=1234, sequence_length=64, sequence_length_decoder=32, split="80,20,0")
    kwargs.update(PRETRAIN_T5, path_to_cache=cache)
    kwargs.update(overrides)
    return kwargs


def t5_config(tokenizer: Any, prefix: str, cache: str, **overrides: Any) -> T5MaskedWordPieceDatasetConfig:
    return T5MaskedWordPieceDatasetConfig(
        blend=([prefix], None), tokenizer=tokenizer, **t5_settings(cache, **overrides)
    )


def build_t5_datasets(config: T5MaskedWordPieceDatasetConfig, sizes: List[Optional[int]]) -> List[Any]:
    """Train, valid and test datasets through our BlendedMegatronDatasetBuilder."""
    return BlendedMegatronDatasetBuilder(T5MaskedWordPieceDataset, sizes, lambda: True, config).build()
