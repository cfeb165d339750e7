"""Supervised fine-tuning data: JSON-lines conversations, loss on assistant tokens, packed rows.

``SFTLowLevelDataset`` reads a ``.jsonl`` file directly (no preprocessing step): one conversation a
line (``sft_format.conversation_messages``), formatted and tokenized once
(``sft_format.format_conversation``). A malformed line (not JSON, not a conversation, no assistant
turn, no token) is skipped, counted and named: a warning gives the count and the first lines with
their reason, and ``malformed`` lists them all; a file without one good line raises.

``SFTDataset`` (a ``MegatronDataset``: the builder's splitting and blending apply, a split being a
range of conversations) turns the conversations of its split into rows of ``sequence_length``
tokens. A conversation of ``n`` tokens gives ``n - 1`` inputs and labels (next-token prediction),
the loss mask being the label's "assistant" bit. Truncation: a conversation longer than
``sequence_length + 1`` tokens keeps its first ``sequence_length + 1`` (later turns are lost; counted
in ``truncated``). With ``sft_pack_sequences`` conversations, in a seeded shuffled order per epoch,
are packed end to end while they fit; otherwise one a row. Every sequence is padded to a multiple of
``sft_pad_to_multiple_of`` (2 x CP under context parallelism) and the rest of the row is one padding
sequence; padding has loss mask 0. Each sample carries ``cu_seqlens`` ``[sequence_length + 1]``:
the boundaries, the last one repeated to fill (``packed_batch`` turns a micro batch into one packed
row and its ``PackedSeqParams``). The rows are cached like the GPT dataset's indices (``--data-cache-path``,
else ``<data dir>/cache/SFTDataset_indices``), keyed by the description, which holds the file's SHA-256, the
tokenizer and the SFT settings; the conversations themselves are tokenized again at every start.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, index_cache_dir, special_token
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.sft_format import PROMPT_FORMATS, conversation_messages, format_conversation
from megatron.core.datasets.utils import Split, load_or_build_indices
from megatron.core.packed_seq_params import PackedSeqParams

IGNORE_INDEX = -100  # Megatron's label of untrained positions (here the loss mask carries it; labels stay ids)
MALFORMED_SHOWN = 5


@dataclass
class SFTDatasetConfig(GPTDatasetConfig):
    """GPT dataset settings plus the conversation format and packing."""

    sft_tokenizer_prompt_format: str = "chat_template"
    """``chat_template`` (the tokenizer's own) or the built-in ``chatml``."""

    sft_pack_sequences: bool = True
    """Pack several conversations per row (else one a row, padded)."""

    sft_pad_to_multiple_of: int = 1
    """Every packed sequence's length is a multiple of this (2 x context parallel size)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sft_tokenizer_prompt_format not in PROMPT_FORMATS:
            raise ValueError(
                f"sft_tokenizer_prompt_format={self.sft_tokenizer_prompt_format!r}: must be one of {PROMPT_FORMATS}"
            )
        if self.sft_pad_to_multiple_of < 1 or self.sequence_length % self.sft_pad_to_multiple_of:
            raise ValueError(
                f"sft_pad_to_multiple_of={self.sft_pad_to_multiple_of} must be >= 1 and divide "
                f"sequence_length={self.sequence_length}"
            )


class SFTLowLevelDataset:
    """The conversations of one JSON-lines file as ``(token ids [n], trained [n])`` pairs."""

    def __init__(self, path: str, tokenizer: Any, prompt_format: str) -> None:
        self.path = path
        self.malformed: List[Tuple[int, str]] = []  # (1-based line number, reason)
        self.conversations: List[Tuple[np.ndarray, np.ndarray]] = []
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                digest.update(raw)
                if not raw.strip():
                    continue
                try:
                    ids, trained = format_conversation(tokenizer, conversation_messages(json.loads(raw)), prompt_format)
                    if len(ids) < 2 or not any(trained[1:]):
                        raise ValueError("no assistant token to predict after formatting")
                except (ValueError, UnicodeDecodeError) as err:
                    self.malformed.append((number, str(err)))
                    continue
                self.conversations.append((np.asarray(ids, dtype=np.int64), np.asarray(trained, dtype=bool)))
        self.sha256 = digest.hexdigest()
        self._report()

    def _report(self) -> None:
        if not self.conversations:
            raise ValueError(f"{self.path}: no usable conversation ({len(self.malformed)} malformed lines)")
        if self.malformed:
            shown = "; ".join(f"line {n}: {why}" for n, why in self.malformed[:MALFORMED_SHOWN])
            warnings.warn(f"{self.path}: {len(self.malformed)} malformed lines skipped ({shown})", stacklevel=3)

    def __len__(self) -> int:
        return len(self.conversations)

    def identity(self) -> Dict[str, Any]:
        """What identifies the file's content in a dataset description."""
        return {"path": self.path, "sha256": self.sha256, "conversations": len(self), "malformed": len(self.malformed)}


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_rows(lengths: Iterable[int], seq_length: int, pack: bool, multiple: int) -> List[List[int]]:
    """Greedy packing: the positions (into ``lengths``) of the sequences of each row, in order.

    Every length (at most ``seq_length``) is first padded up to ``multiple``.
    """
    rows: List[List[int]] = []
    used = seq_length
    for i, n in enumerate(lengths):
        size = _padded(n, multiple)
        if not pack or used + size > seq_length:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += size
    return rows


class SFTDataset(MegatronDataset):
    """Rows of packed (or padded) conversations of one split; see the module docstring."""

    def __init__(
        self,
        dataset: SFTLowLevelDataset,
        dataset_path: Optional[str],
        indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: SFTDatasetConfig,
    ) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        self.pad_id = special_token(config.tokenizer, "pad") or special_token(config.tokenizer, "eod") or 0
        self.truncated = sum(len(dataset.conversations[i][0]) > config.sequence_length + 1 for i in self.indices)
        self.path_to_cache = index_cache_dir(config, dataset_path, type(self).__name__)
        stem = f"{self.unique_description_hash}-{type(self).__name__}-{index_split.name}"
        arrays = load_or_build_indices(
            self.path_to_cache, stem, self.unique_description, ("row_offsets", "row_conversations"), self._row_arrays
        )
        offsets, conversations = arrays["row_offsets"], arrays["row_conversations"]
        self.rows = [conversations[offsets[i] : offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]

    @staticmethod
    def _key_config_attributes() -> Iterable[str]:
        return [
            *MegatronDataset._key_config_attributes(),
            "sft_tokenizer_prompt_format",
            "sft_pack_sequences",
            "sft_pad_to_multiple_of",
        ]

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: SFTDatasetConfig) -> SFTLowLevelDataset:
        return SFTLowLevelDataset(dataset_path, config.tokenizer, config.sft_tokenizer_prompt_format)

    def _build_rows(self) -> List[List[int]]:
        """Rows of conversation ids: epochs of the split in seeded shuffled orders until ``num_samples``."""
        c = self.config
        rng = np.random.RandomState(c.random_seed)
        rows: List[List[int]] = []
        while not rows or (self.num_samples is not None and len(rows) < self.num_samples):
            order = rng.permutation(self.indices) if c.sft_pack_sequences else self.indices
            lengths = [min(len(self.dataset.conversations[i][0]), c.sequence_length + 1) - 1 for i in order]
            rows += [
                [int(order[j]) for j in row]
                for row in pack_rows(lengths, c.sequence_length, c.sft_pack_sequences, c.sft_pad_to_multiple_of)
            ]
        return rows[: self.num_samples] if self.num_samples is not None else rows

    def _row_arrays(self) -> Dict[str, np.ndarray]:
        """The rows as ``row_offsets`` ``[rows + 1]`` into ``row_conversations`` (cached like GPT's indices)."""
        rows = self._build_rows()
        offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
        return {"row_offsets": offsets, "row_conversations": np.asarray(sum(rows, []), dtype=np.int64)}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        """``tokens``, ``labels``, ``loss_mask``, ``position_ids`` ``[s]`` and ``cu_seqlens`` ``[s + 1]``."""
        s, multiple = self.config.sequence_length, self.config.sft_pad_to_multiple_of
        tokens = np.full(s, self.pad_id, dtype=np.int64)
        labels = np.full(s, self.pad_id, dtype=np.int64)
        loss_mask = np.zeros(s, dtype=np.float32)
        positions = np.zeros(s, dtype=np.int64)
        bounds = [0]
        for conv in self.rows[idx]:
            ids, trained = (x[: s + 1] for x in self.dataset.conversations[conv])
            start, n = bounds[-1], len(ids) - 1
            tokens[start : start + n], labels[start : start + n] = ids[:-1], ids[1:]
            loss_mask[start : start + n] = trained[1:]
            size = _padded(n, multiple)
            positions[start : start + size] = np.arange(size)
            bounds.append(start + size)
        if bounds[-1] < s:  # the rest of the row: one padding sequence
            positions[bounds[-1] :] = np.arange(s - bounds[-1])
            bounds.append(s)
        cu = np.full(s + 1, s, dtype=np.int32)
        cu[: len(bounds)] = bounds
        arrays = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": positions}
        return {**{k: torch.from_numpy(v) for k, v in arrays.items()}, "cu_seqlens": torch.from_numpy(cu)}


def packed_batch(batch: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], PackedSeqParams]:
    """A micro batch of ``b`` SFT rows -> one packed row ``[1, b*s]`` and its ``PackedSeqParams``."""
    b, s = batch["tokens"].shape
    cu = batch["cu_seqlens"].long()  # [b, s + 1]
    bounds = [0]
    for row in range(b):
        ends = torch.unique_consecutive(cu[row])[1:]  # this row's sequence ends
        bounds += (ends + row * s).tolist()
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=cu.device)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    flat = {k: v.reshape(1, b * s) for k, v in batch.items() if k != "cu_seqlens"}
    return flat, params
