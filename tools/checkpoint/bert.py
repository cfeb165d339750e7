"""BERT in the converter: our post-LN ``BertModel`` <-> Hugging Face ``BertForPreTraining`` / ``BertForMaskedLM``.

BertForPreTraining becomes the model of ``pretrain_bert.py --bert-post-layernorm`` (pooler, binary
head, 2 token types); BertForMaskedLM the model of ``--bert-no-binary-head``, which has no token-type
embedding: Hugging Face adds token type 0's row to every position (``token_type_ids`` default to
zeros), so that row is folded into the position embeddings, exactly. Exporting such a model writes
zero token-type rows (``type_vocab_size`` 2), so the exported model computes the same for type 0.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

import torch

from megatron.core.dist_checkpointing.serialization import read_json
from megatron.core.models.bert import BertModel
from megatron.core.models.bert.bert_layer_specs import bert_layer_post_ln_spec
from megatron.core.models.bert.hf_state_dict import from_hf_bert, to_hf_bert
from megatron.core.models.gpt.hf_state_dict import StateDict
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from tools.checkpoint.hf_config import Args, ConversionError, gpt_model_kwargs

TYPES_KEY = "embedding.tokentype_embeddings.weight"
POSITIONS_KEY = "embedding.position_embeddings.weight"
BINARY_HEAD_KEY = "binary_head.weight"  # in a checkpoint: the model has the pooler and binary head
LM_HEAD_KEY = "lm_head.dense.weight"  # in a checkpoint: a BertModel
_MODEL_KWARGS = ("position_embedding_type", "rotary_base", "rotary_percent", "share_embeddings_and_output_weights")
_MODEL_KWARGS += ("vocab_size", "max_sequence_length")


def build_bert(args: Args, groups: ProcessGroupCollection) -> BertModel:
    """Our TP=1 post-LN BertModel for ``args`` (as ``pretrain_bert.py`` builds it; weights overwritten after)."""
    if not args.get("bert_post_layernorm"):
        raise ConversionError(
            "flag bert_post_layernorm is False: Hugging Face BERT is post-LN; only checkpoints trained with "
            "--bert-post-layernorm (or converted from Hugging Face) convert"
        )
    kwargs = gpt_model_kwargs(args)
    config = TransformerConfig(**{k: v for k, v in kwargs.items() if k not in _MODEL_KWARGS})
    binary = bool(args["bert_binary_head"])
    return BertModel(
        config=config,
        num_tokentypes=2 if binary else 0,
        transformer_layer_spec=bert_layer_post_ln_spec,
        vocab_size=kwargs["vocab_size"],
        max_sequence_length=kwargs["max_sequence_length"],
        share_embeddings_and_output_weights=kwargs["share_embeddings_and_output_weights"],
        add_binary_head=binary,
        pg_collection=groups,
    )


def bert_from_hf(hf_sd: StateDict, model: BertModel) -> StateDict:
    """Our state dict (unpadded vocabulary) from Hugging Face names; MLM-only: token type 0 folded in."""
    sd = from_hf_bert(
        hf_sd, model.config, binary_head=model.add_binary_head, tied=model.share_embeddings_and_output_weights
    )
    if not model.add_binary_head:
        types = sd.pop(TYPES_KEY)  # [type_vocab_size, h]
        sd[POSITIONS_KEY] = sd[POSITIONS_KEY] + types[0]
    return sd


def bert_to_hf(sd: StateDict, config: Any, binary_head: bool) -> StateDict:
    """Hugging Face names of our state dict; without the binary head, zero token-type rows are added."""
    sd = dict(sd)
    if not binary_head:
        sd[TYPES_KEY] = torch.zeros(2, sd[POSITIONS_KEY].shape[1], dtype=sd[POSITIONS_KEY].dtype)
    return to_hf_bert(sd, config, binary_head=binary_head)


def tokenizer_flags(hf_dir: str) -> List[str]:
    """``--tokenizer-type BertWordPiece(LowerCase|Case) --vocab-file`` when ``hf_dir`` holds a ``vocab.txt``."""
    vocab = os.path.join(hf_dir, "vocab.txt")
    if not os.path.isfile(vocab):
        return []
    settings = os.path.join(hf_dir, "tokenizer_config.json")
    lower = read_json(settings, "tokenizer config").get("do_lower_case", True) if os.path.isfile(settings) else True
    return ["--tokenizer-type", "BertWordPieceLowerCase" if lower else "BertWordPieceCase", "--vocab-file", vocab]


def wordpiece_vocab_size(args: Args) -> Optional[int]:
    """The unpadded vocabulary of a checkpoint trained with a BertWordPiece tokenizer: its vocab file's lines;
    with ``--vocab-extra-ids`` (T5) the tokenizer's whole vocabulary, the added [BOS]/[EOS] and sentinels included."""
    path = args.get("vocab_file")
    if not str(args.get("tokenizer_type")).startswith("BertWordPiece") or not path or not os.path.isfile(path):
        return None
    if args.get("vocab_extra_ids"):
        from megatron.core.tokenizers.build import build_tokenizer

        return build_tokenizer(
            args["tokenizer_type"], vocab_file=path, vocab_extra_ids=args["vocab_extra_ids"]
        ).vocab_size
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)
