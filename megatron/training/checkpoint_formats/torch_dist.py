"""``--ckpt-format torch_dist`` (the default): sharded ``torch.distributed.checkpoint`` files plus plain JSON.

```
iter_0001000/.metadata, __{rank}_0.distcp   model and optimizer tensors (DCP); loads under any TP/PP/DP layout
iter_0001000/common.json                     iteration, train state, scheduler, args, optimizer scalars
iter_0001000/rng/rank_{rank:05d}.json        each rank's RNG states
iter_0001000/metadata.json                   written last: the directory is complete; size and SHA-256 of each file
```
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import CheckpointingError, plain_data
from megatron.core.dist_checkpointing.serialization import read_json, stage_save, write_json_atomic
from megatron.core.dist_checkpointing.validation import apply_strictness, parse_strictness
from megatron.core.dist_checkpointing.write_errors import WRITE_FAILURES, describe_write_failure
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.transformer.fp8_utils import drop_fp8_checkpoint_values, load_fp8_checkpoint_values
from megatron.core.utils import named_model_params
from megatron.training.checkpoint_formats.base import (
    TORCH_DIST,
    CheckpointFormat,
    Loaded,
    LoadRequest,
    SaveRequest,
    StagedWrite,
)
from megatron.training.checkpoint_formats.common import (
    COMMON_FILE,
    RNG_DIR,
    agreed_read,
    agreed_write,
    rng_path,
    same_layout,
)


class TorchDistFormat(CheckpointFormat):
    """Sharded: every rank writes its shards; a load reshards to this run's layout."""

    name = TORCH_DIST
    marker = dc.METADATA_FILE

    def detect(self, names: Sequence[str]) -> bool:
        """``metadata.json`` is written last: its presence means the save completed."""
        return dc.METADATA_FILE in names

    supports_async = True

    def save(self, request: SaveRequest) -> None:
        """``common.json`` and RNG files first, then the DCP files, checksums and ``metadata.json``."""
        staged = _plan(request, None)
        iter_dir, common, rng_state = request.iter_dir, request.common, request.rng_state
        agreed_write(lambda: _write_common_and_rng(iter_dir, common, rng_state), iter_dir, writer=True)
        staged.write()
        staged.finalize()

    def stage(self, request: SaveRequest, staging: Dict[Any, Any]) -> StagedWrite:
        """Plan and snapshot now; the writer writes ``common.json``, the RNG and DCP files, each rank its own."""
        staged = _plan(request, staging)

        def write() -> None:
            try:
                _write_common_and_rng(request.iter_dir, request.common, request.rng_state)
            except WRITE_FAILURES as e:
                raise CheckpointingError(describe_write_failure(e, request.iter_dir)) from e
            staged.write()

        return StagedWrite(write, staged.finalize)

    def load(self, request: LoadRequest) -> Loaded:
        """Checksums, header checks and strictness on every rank before the one collective DCP load."""
        iter_dir, model_chunks = request.iter_dir, request.model_chunks
        optimizer, groups = request.optimizer, request.groups
        if request.verify_checkpoint:
            dc.verify_checksums(iter_dir)  # collective: every rank raises on a mismatch
        # Each rank reads the files; whatever one of them finds wrong stops all before the collective load.
        common, metadata = agreed_read(lambda: _header(iter_dir, optimizer is not None, request.check_args))
        per_param, template = None, {}
        if optimizer is not None:
            template, per_param = _optimizer_template(model_chunks, optimizer, groups, metadata)
        # Last: an FP8 weight's entry is the tensor its latest state_dict handed out, filled by the load.
        sharded = dc.model_sharded_state_dict(model_chunks, pg_collection=groups)
        sharded.update(template)
        # Optimizer state left unread on purpose (--no-load-optim, --finetune, release) is not a mismatch.
        sharded, _ = apply_strictness(
            sharded,
            metadata.state_dict_metadata,
            parse_strictness(request.strictness),
            iter_dir,
            () if optimizer is not None else (dc.OPTIMIZER_STATE_PREFIX,),
        )
        dc.load(sharded, iter_dir)
        _restore_after_load(model_chunks, sharded, groups)
        if optimizer is not None:
            state: Dict[str, Any] = dict(plain_data.decode(common.get("optimizer") or {}))
            state.update(per_param)
            optimizer.load_state_dict_by_param_name(model_chunks, state)
        rng = None
        if request.load_rng and same_layout(common, groups, iter_dir):
            rng = agreed_read(
                lambda: read_json(
                    rng_path(iter_dir, dist.get_rank()),
                    "RNG state (saved with --no-save-rng? load with --no-load-rng)",
                )
            )
        return common, rng

    def saved_args(self, iter_dir: str) -> Any:
        """``common.json``'s ``args``."""
        return read_json(os.path.join(iter_dir, COMMON_FILE), "checkpoint common state").get("args")


def _plan(request: SaveRequest, staging: Optional[Dict[Any, torch.Tensor]]) -> dc.StagedSave:
    """The model's and optimizer's pieces, planned (collective); snapshotted into ``staging`` unless None."""
    model_chunks, optimizer, groups = request.model_chunks, request.optimizer, request.groups
    sharded = dc.model_sharded_state_dict(model_chunks, pg_collection=groups)
    request.common["optimizer"] = None
    if optimizer is not None:
        pieces, scalars = optimizer_pieces(model_chunks, optimizer, groups)
        sharded.update(pieces)
        request.common["optimizer"] = plain_data.encode(scalars, "optimizer")
    staged = stage_save(sharded, request.iter_dir, snapshot=staging is not None, buffers=staging)
    drop_fp8_checkpoint_values(model_chunks)
    return staged


def optimizer_pieces(
    model_chunks: Sequence[torch.nn.Module], optimizer: Any, groups: ProcessGroupCollection
) -> Tuple[dc.ShardedStateDict, Dict[str, Any]]:
    """The optimizer state as checkpoint pieces, and its scalars. The distributed optimizer's DP ranks each
    give their own slices (no gather: every rank writes 1/DP); the others give whole per-parameter tensors."""
    if hasattr(optimizer, "sharded_state_to_save"):
        return optimizer.sharded_state_to_save(
            model_chunks, dc.sharded_tensors_by_param_name(model_chunks, groups, dp_replicas=False)
        )
    specs = dc.sharded_tensors_by_param_name(model_chunks, groups)
    per_param, scalars = dc.split_optimizer_state(optimizer.state_dict_by_param_name(model_chunks), specs)
    return dc.optimizer_sharded_state_dict(per_param, specs), scalars


def _write_common_and_rng(iter_dir: str, common: Dict[str, Any], rng_state: Optional[Dict[str, Any]]) -> None:
    """Rank 0 writes ``common.json``; every rank its RNG file (unless ``--no-save-rng``)."""
    if dist.get_rank() == 0:
        write_json_atomic(os.path.join(iter_dir, COMMON_FILE), common)
    if rng_state is not None:
        os.makedirs(os.path.join(iter_dir, RNG_DIR), exist_ok=True)
        write_json_atomic(rng_path(iter_dir, dist.get_rank()), rng_state)


def _restore_after_load(
    model_chunks: Sequence[torch.nn.Module], sharded: dc.ShardedStateDict, groups: ProcessGroupCollection
) -> None:
    """FP8 weights take the loaded high-precision values before anything calls state_dict() again
    (its hook would put fresh copies of the current weights in their place); extra states go back."""
    load_fp8_checkpoint_values(model_chunks)
    for chunk in model_chunks:  # parameters were read in place; extra states (TE's FP8 state) go back here
        dc.load_extra_states(chunk, sharded, groups)
        dc.load_sharded_parameters(chunk, sharded, groups)  # FSDP2: each rank's rows of the whole tensors read
    drop_fp8_checkpoint_values(model_chunks)  # the copies that loop's state_dict() made


def _optimizer_template(
    model_chunks: Sequence[torch.nn.Module], optimizer: Any, groups: ProcessGroupCollection, metadata: Any
) -> Tuple[dc.ShardedStateDict, Dict[str, Dict[str, torch.Tensor]]]:
    """Empty per-parameter tensors for every optimizer state the checkpoint holds, and their sharding.

    The distributed optimizer reads only the slices its DP rank owns (``sharded_state_template``);
    the others read each parameter's whole (TP-local) state.
    """
    saved: Dict[str, Dict[str, torch.dtype]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(dc.OPTIMIZER_STATE_PREFIX):
            param_key, _, state_name = key[len(dc.OPTIMIZER_STATE_PREFIX) :].rpartition(".")
            saved.setdefault(param_key, {})[state_name] = md.properties.dtype
    specs = dc.sharded_tensors_by_param_name(model_chunks, groups)
    if hasattr(optimizer, "sharded_state_template"):
        return optimizer.sharded_state_template(model_chunks, specs, saved)
    params = dict(named_model_params(model_chunks))
    per_param = {
        name: {
            state: torch.empty(params[name].shape, dtype=dtype, device=params[name].device)
            for state, dtype in saved[spec.key].items()
        }
        for name, spec in specs.items()
        if spec.key in saved
    }  # no entry: no state saved yet
    return dc.optimizer_sharded_state_dict(per_param, specs), per_param


def _header(
    iter_dir: str, with_optimizer: bool, check_args: Optional[Callable[[Any, str], None]]
) -> Tuple[Dict[str, Any], Any]:
    """A torch_dist checkpoint's common state and metadata, checked against this run."""
    common = read_json(os.path.join(iter_dir, COMMON_FILE), "checkpoint common state")
    if check_args is not None:
        check_args(common.get("args"), iter_dir)
    if with_optimizer and common.get("optimizer") is None:
        raise CheckpointingError(
            f"checkpoint {iter_dir} has no optimizer state (saved with --no-save-optim?); "
            "load with --no-load-optim or --finetune"
        )
    return common, dc.read_metadata(iter_dir)
