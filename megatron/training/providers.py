"""What the entry points' providers share: the language model's keyword arguments and the dataset build.

``pretrain_gpt.py``, ``pretrain_bert.py`` and ``pretrain_t5.py`` each wire a model provider and a
dataset provider into ``pretrain``; the parts that are the same for every model family live here once.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Sequence

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.transformer.transformer_config import TransformerConfig


def language_model_kwargs(
    args: argparse.Namespace, pre_process: bool, post_process: bool, pg_collection: Any = None
) -> Dict[str, Any]:
    """Keyword arguments every language model (``GPTModel``, ``BertModel``, ``T5Model``) takes from the flags:
    vocabulary and positions, this stage's ends, the output layer and its tying, and the process groups."""
    return dict(
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        pg_collection=pg_collection,
    )


def refuse_experts(config: TransformerConfig, family: str) -> None:
    """A model family whose layers are dense refuses ``--num-experts``."""
    if config.num_moe_experts:
        raise ValueError(f"not supported yet: --num-experts={config.num_moe_experts} ({family} layers are dense)")


def build_datasets(
    num_samples: Sequence[int], args: argparse.Namespace, config: Any, dataset_class: type, mock_class: type
) -> List:
    """[train, valid, test] datasets of ``dataset_class`` (``mock_class`` with ``--mock-data``) configured by
    ``config`` (the entry point's dataset config, filled from the data flags)."""
    cls = mock_class if args.mock_data else dataset_class
    return BlendedMegatronDatasetBuilder(cls, num_samples, lambda: True, config).build()
