"""Records of the data, dataloader and tokenizer flags."""

from __future__ import annotations

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig as DS
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as GDS
from megatron.core.datasets.masked_dataset import MaskedWordPieceDatasetConfig as MDS
from megatron.core.datasets.sft_dataset import SFTDatasetConfig as SFT
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDatasetConfig as T5DS
from megatron.training.flags import reasons
from megatron.training.flags.derive import blend, blend_per_split, create_attention_mask, split
from megatron.training.flags.record import (
    CHECKED,
    FILLED,
    IMPLEMENTED,
    TAKEN,
    Flag,
    ProjectFlag,
    always,
    at_least,
    between,
    no_op,
    not_yet,
    same,
    to,
)
from megatron.training.theoretical_memory_params import LanguageModelShape as LMS
from megatron.training.training_config import TrainingConfig as TRAIN
from megatron.training.training_log import FlopsConfig as FL

RECORDS = (
    Flag(
        "data_path",
        IMPLEMENTED,
        help="Dataset prefixes, optionally weighted: [W1] P1 [W2] P2 ...",
        fills=(to(DS, "blend", blend),),
        data_prefixes=True,
    ),
    Flag("phase_transition_iterations", not_yet(None)),
    Flag(
        "split",
        IMPLEMENTED,
        help="Train/valid/test proportions; default '969, 30, 1' with --data-path.",
        fills=(to(DS, "split", split),),
    ),
    Flag("train_data_path", IMPLEMENTED, fills=(to(DS, "blend_per_split", blend_per_split),), data_prefixes=True),
    Flag("valid_data_path", IMPLEMENTED, data_prefixes=True),
    Flag("test_data_path", IMPLEMENTED, data_prefixes=True),
    Flag("data_args_path", not_yet(None)),
    Flag("per_split_data_args_path", not_yet(None)),
    Flag("per_dataset_sequences_path", not_yet(None)),
    Flag("dataloader_fast_cache_load", no_op(reasons.CHECKPOINT_IO)),
    Flag("dataloader_defer_npy_index_mmap", no_op(reasons.CHECKPOINT_IO)),
    Flag("data_cache_path", IMPLEMENTED, fills=(to(DS, "path_to_cache"),)),
    Flag("mmap_bin_files", IMPLEMENTED, fills=same(DS)),
    Flag("mock_data", IMPLEMENTED, help="Synthetic data instead of --data-path.", fills=(to(DS, "mock"),)),
    Flag(
        "seq_length",
        IMPLEMENTED,
        help="Tokens per training sample.",
        type=int,
        fills=(*same(FL, TRAIN), to(DS, "sequence_length")),
        bounds=at_least(1),
        from_checkpoint=FILLED,
        required=True,
    ),
    Flag(
        "encoder_seq_length",
        IMPLEMENTED,
        help="T5: encoder tokens per sample; stands for --seq-length (give one of the two).",
        type=int,
        stands_for="seq_length",
    ),
    Flag(
        "decoder_seq_length",
        IMPLEMENTED,
        help="T5: decoder tokens per sample ([BOS], sentinels and masked spans).",
        type=int,
        fills=(to(T5DS, "sequence_length_decoder"), *same(TRAIN)),
    ),
    Flag("sample_rate", not_yet(1.0)),
    Flag(
        "mask_prob",
        IMPLEMENTED,
        help="BERT: probability that a token is masked ([MASK] 8 times in 10, else a random token or itself).",
        fills=(to(MDS, "masking_probability"),),
        bounds=between(0, 1),
    ),
    Flag(
        "short_seq_prob",
        IMPLEMENTED,
        help="BERT: probability that a sample is cut to a random length shorter than --seq-length.",
        fills=(to(MDS, "short_sequence_probability"),),
        bounds=between(0, 1),
    ),
    Flag("num_workers", IMPLEMENTED, fills=same(TRAIN), bounds=at_least(0)),
    Flag("reset_position_ids", IMPLEMENTED, fills=same(GDS)),
    Flag(
        "reset_attention_mask",
        IMPLEMENTED,
        fills=(*same(GDS), to(GDS, "create_attention_mask", create_attention_mask)),
    ),
    Flag("eod_mask_loss", IMPLEMENTED, fills=same(GDS)),
    Flag("create_attention_mask_in_dataloader", no_op(reasons.MEMORY)),
    Flag("num_dataset_builder_threads", IMPLEMENTED, fills=same(DS)),
    Flag("object_storage_cache_path", not_yet(None)),
    Flag("mid_level_dataset_surplus", IMPLEMENTED, fills=same(DS)),
    Flag("allow_ambiguous_pad_tokens", not_yet(False)),
    Flag("fim_data", not_yet(False)),
    Flag("fim_rate", no_op(reasons.UNDER_REFUSED)),
    Flag("fim_spm_rate", no_op(reasons.UNDER_REFUSED)),
    Flag("fim_split_sample", no_op(reasons.UNDER_REFUSED), type=int),
    Flag("fim_fragment_rate", no_op(reasons.UNDER_REFUSED), type=float),
    Flag("fim_no_prefix", no_op(reasons.UNDER_REFUSED)),
    Flag("fim_prefix_token", no_op(reasons.UNDER_REFUSED)),
    Flag("fim_middle_token", no_op(reasons.UNDER_REFUSED)),
    Flag("fim_suffix_token", no_op(reasons.UNDER_REFUSED)),
    Flag("fim_pad_token", no_op(reasons.UNDER_REFUSED)),
    Flag("fim_eod_token", no_op(reasons.UNDER_REFUSED)),
    Flag("vocab_size", IMPLEMENTED, type=int, bounds=at_least(1)),
    Flag(
        "padded_vocab_size",
        IMPLEMENTED,
        type=int,
        fills=(*same(FL), to(LMS, "vocab_size")),
        architecture=always,
        from_checkpoint=CHECKED,
        label="padded vocabulary size (tokenizer vocabulary, --make-vocab-size-divisible-by, "
        "--tensor-model-parallel-size)",
    ),
    Flag("vocab_file", IMPLEMENTED),
    Flag("merge_file", IMPLEMENTED),
    Flag("vocab_extra_ids", IMPLEMENTED),
    Flag(
        "tokenizer_type",
        IMPLEMENTED,
        help="Tokenizer; default GPT2BPETokenizer (GPT) or BertWordPieceLowerCase (BERT, T5).",
        architecture=always,
    ),
    Flag("tokenizer_model", IMPLEMENTED),
    Flag("tokenizer_metadata", not_yet(None)),
    Flag("tokenizer_special_tokens", not_yet(None)),
    Flag("legacy_tokenizer", not_yet(False)),
    Flag("tiktoken_pattern", IMPLEMENTED, from_checkpoint=TAKEN),
    Flag("tiktoken_num_special_tokens", IMPLEMENTED),
    Flag("tiktoken_special_tokens", IMPLEMENTED),
    Flag("tokenizer_sentencepiece_legacy", not_yet(False)),
    Flag("tokenizer_hf_use_fast", not_yet(False)),
    Flag("tokenizer_hf_include_special_tokens", not_yet(False)),
    Flag("trust_remote_code", IMPLEMENTED),
    # Supervised fine-tuning (Megatron-LM's newer --sft and --sft-tokenizer-prompt-format; not in the table).
    Flag(
        "sft",
        IMPLEMENTED,
        help="Supervised fine-tuning: --data-path files are JSON-lines conversations (SFTDataset), "
        "packed rows, loss on assistant tokens only.",
        project=ProjectFlag(group="data and dataloader", option_strings=("--sft",), default=False, action="storetrue"),
    ),
    Flag(
        "sft_tokenizer_prompt_format",
        IMPLEMENTED,
        help="--sft: 'chat_template' (the tokenizer's own) or the built-in 'chatml'.",
        fills=same(SFT),
        project=ProjectFlag(
            group="data and dataloader",
            option_strings=("--sft-tokenizer-prompt-format",),
            default="chat_template",
            action="store",
        ),
    ),
    Flag(
        "sft_pack_sequences",
        IMPLEMENTED,
        help="--sft: one conversation per row, padded, instead of packing several per row.",
        fills=same(SFT),
        project=ProjectFlag(
            group="data and dataloader",
            option_strings=("--no-sft-pack-sequences",),
            default=True,
            action="storefalse",
        ),
    ),
)
