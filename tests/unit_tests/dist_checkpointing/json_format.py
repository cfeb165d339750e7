"""A tiny checkpoint format, for the test that a new format is one module registered with the interface.

Every rank writes ``json_rank_{rank:05d}.json`` (model and optimizer state, common state, RNG, all
``plain_data``); rank 0 writes ``json_complete`` last. Loads only under the world size that saved it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch.distributed as dist

from megatron.core.dist_checkpointing import CheckpointingError, plain_data
from megatron.core.dist_checkpointing.state_dict import model_state_to_save
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.utils import unwrap_model
from megatron.training.checkpoint_formats.base import CheckpointFormat, Loaded, LoadRequest, SaveRequest
from megatron.training.checkpoint_formats.common import agreed_read, agreed_write
from megatron.training.checkpoint_formats.registry import register

NAME = "test_json"
COMPLETE = "json_complete"


def rank_file(iter_dir: str, rank: int) -> str:
    """This format's file of ``rank``."""
    return os.path.join(iter_dir, f"json_rank_{rank:05d}.json")


class JsonFormat(CheckpointFormat):
    """Per-rank JSON files; refuses expert parallelism (to exercise ``validate``)."""

    name = NAME
    marker = COMPLETE

    def detect(self, names: Sequence[str]) -> bool:
        return COMPLETE in names

    def validate(self, groups: ProcessGroupCollection) -> None:
        if groups.size_of("ep") > 1:
            raise CheckpointingError(f"--ckpt-format {NAME}: no expert parallelism")

    def save(self, request: SaveRequest) -> None:
        chunks, optimizer, iter_dir = request.model_chunks, request.optimizer, request.iter_dir
        state = {
            "common": request.common,
            "models": [plain_data.encode(model_state_to_save(unwrap_model(c)), "model") for c in chunks],
            "optimizer": None if optimizer is None else plain_data.encode(optimizer.state_dict_by_param_name(chunks)),
            "rng": request.rng_state,
        }
        rank = dist.get_rank()
        agreed_write(lambda: _write(rank_file(iter_dir, rank), state), iter_dir, writer=True)
        agreed_write(lambda: _write(os.path.join(iter_dir, COMPLETE), {}), iter_dir)

    def load(self, request: LoadRequest) -> Loaded:
        state = agreed_read(lambda: _read(rank_file(request.iter_dir, dist.get_rank())))
        for chunk, saved in zip(request.model_chunks, state["models"]):
            unwrap_model(chunk).load_state_dict(plain_data.decode(saved), strict=True)
        if request.optimizer is not None:
            request.optimizer.load_state_dict_by_param_name(request.model_chunks, plain_data.decode(state["optimizer"]))
        return state["common"], state["rng"] if request.load_rng else None

    def saved_args(self, iter_dir: str) -> Any:
        return _read(rank_file(iter_dir, 0))["common"]["args"]


def _write(path: str, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f)


def _read(path: str) -> Any:
    if not os.path.isfile(path):
        raise CheckpointingError(
            f"{path} not found ({NAME} checkpoints load only under the world size that saved them)"
        )
    with open(path) as f:
        return json.load(f)


FORMAT = register(JsonFormat())
