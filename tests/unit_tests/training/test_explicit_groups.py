"""Groups are passed, not fetched: the training path never reads the default process groups.

``parallel_state.forbid_default_process_groups()`` makes every read of the default collection
(all of Megatron's module-level getters go through it) raise. A whole ``pretrain()`` run with
TP x PP x virtual pipeline, sequence parallelism, MoE, evaluation and a checkpoint save runs
inside it, so any module that fell back to the default groups would fail the run; the process-wide
MoE aux-loss tracker must stay untouched (the run binds its routers to its own).

The second test lists, from the source, every call into the facade from ``megatron/core`` and
``megatron/training``: only the public boundaries whose Megatron signature keeps
``pg_collection=None`` (named in docs/ARCHITECTURE.md) may appear.
"""

from __future__ import annotations

import ast
import inspect
import os
from typing import Set, Tuple

import pytest
import torch.distributed as dist

from megatron.core import parallel_ranks, parallel_state, process_groups
from tests.dist_harness import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# file, enclosing function, facade name: the public boundaries that resolve None for library users
# (Megatron's signatures keep pg_collection=None / tp_group=None there), and start-up, which builds the
# default or keeps one a caller built beforehand (Megatron's behaviour).
_ALLOWED_TABLE = """
megatron/core/models/gpt/gpt_model.py GPTModel.__init__ use_mpu_process_groups
megatron/core/models/bert/bert_model.py BertModel.__init__ use_mpu_process_groups
megatron/core/models/T5/t5_model.py T5Model.__init__ use_mpu_process_groups
megatron/core/distributed/distributed_data_parallel.py DistributedDataParallel.__init__ use_mpu_process_groups
megatron/core/distributed/finalize_model_grads.py _model_groups use_mpu_process_groups
megatron/core/optimizer/__init__.py get_megatron_optimizer use_mpu_process_groups
megatron/core/pipeline_parallel/microbatch.py ScheduleArgs.__post_init__ use_mpu_process_groups
megatron/core/pipeline_parallel/schedules.py get_forward_backward_func model_parallel_is_initialized
megatron/core/pipeline_parallel/schedules.py get_forward_backward_func get_pipeline_model_parallel_world_size
megatron/core/pipeline_parallel/schedules.py get_forward_backward_func get_virtual_pipeline_model_parallel_world_size
megatron/core/pipeline_parallel/schedule_utils.py _pipeline_sizes get_pipeline_model_parallel_world_size
megatron/core/pipeline_parallel/schedule_utils.py _pipeline_sizes get_pipeline_model_parallel_rank
megatron/core/pipeline_parallel/schedule_utils.py _pipeline_sizes get_virtual_pipeline_model_parallel_world_size
megatron/core/tensor_parallel/layers.py _init_common get_tensor_model_parallel_group_if_none
megatron/core/extensions/transformer_engine.py _make_classes.TELinear.__init__ get_tensor_model_parallel_group_if_none
megatron/core/transformer/transformer_layer.py config_stage get_pipeline_model_parallel_rank
megatron/core/transformer/pipeline_parallel_layer_layout.py PipelineParallelLayerLayout._stage get_pipeline_model_parallel_rank
megatron/core/transformer/attention.py SelfAttention.__init__ use_mpu_process_groups
megatron/core/transformer/mlp.py MLP.__init__ get_tensor_model_parallel_group_if_none
megatron/core/transformer/transformer_layer.py TransformerLayer.__init__ use_mpu_process_groups
megatron/core/transformer/transformer_block.py TransformerBlock.__init__ use_mpu_process_groups
megatron/core/tensor_parallel/layers.py VocabParallelEmbedding.__init__ get_tensor_model_parallel_group_if_none
megatron/core/models/common/embeddings/language_model_embedding.py LanguageModelEmbedding.__init__ get_tensor_model_parallel_group_if_none
megatron/core/transformer/moe/moe_layer.py MoELayer.__init__ use_mpu_process_groups
megatron/core/ssm/mamba_mixer.py MambaMixer.__init__ use_mpu_process_groups
megatron/core/ssm/gated_delta_net.py GatedDeltaNet.__init__ use_mpu_process_groups
megatron/core/distributed/torch_fully_sharded_data_parallel.py TorchFullyShardedDataParallel.__init__ use_mpu_process_groups
megatron/core/tensor_parallel/layers.py param_is_not_tensor_parallel_duplicate get_tensor_model_parallel_group_if_none
megatron/core/tensor_parallel/linear_function.py _default_tp_group get_tensor_model_parallel_group_if_none
megatron/core/tensor_parallel/mappings.py resolve_tp_group get_tensor_model_parallel_group_if_none
megatron/core/tensor_parallel/random.py model_parallel_cuda_manual_seed use_mpu_process_groups
megatron/core/tensor_parallel/random.py _distribute_group get_tensor_model_parallel_group_if_none
megatron/core/tensor_parallel/utils.py split_tensor_into_1d_equal_chunks get_tensor_model_parallel_group_if_none
megatron/core/tensor_parallel/utils.py gather_split_1d_tensor get_tensor_model_parallel_group_if_none
megatron/core/tensor_parallel/data.py broadcast_data get_tensor_model_parallel_group_if_none
megatron/core/utils.py get_tensor_model_parallel_group_if_none has_default_process_groups
megatron/core/utils.py get_tensor_model_parallel_group_if_none get_tensor_model_parallel_group_if_none
megatron/training/initialize.py initialize_distributed model_parallel_is_initialized
megatron/training/initialize.py initialize_distributed use_mpu_process_groups
megatron/training/initialize.py initialize_distributed initialize_model_parallel
megatron/training/initialize.py shutdown_distributed destroy_model_parallel
megatron/training/initialize.py _set_random_seed use_mpu_process_groups
"""  # noqa: E501 (one call site per line)
FACADE_MODULES = {f"megatron/core/{name}.py" for name in ("parallel_state", "parallel_ranks", "process_groups")}
ALLOWED_FACADE_CALLS = {tuple(line.split()) for line in _ALLOWED_TABLE.strip().splitlines()}


def _facade_names() -> Set[str]:
    """Public functions of parallel_state (and its parallel_ranks half) that read or change the default collection."""
    names = {
        name
        for module in (parallel_state, parallel_ranks, process_groups)
        for name, obj in vars(module).items()
        if inspect.isfunction(obj) and obj.__module__ == module.__name__ and not name.startswith("_")
    }
    names -= {"build_process_groups", "warn_sequence_parallel_without_tp", "forbid_default_process_groups"}
    names -= {"check_hierarchical_cp_sizes"}  # validates sizes; reads no group
    names -= {"is_initialized"}  # reads no group; its name is torch.distributed.is_initialized's too
    return names | {"use_mpu_process_groups"}


class _Calls(ast.NodeVisitor):
    def __init__(self, path: str, names: Set[str]) -> None:
        self.path, self.names, self.scope = path, names, []
        self.found: Set[Tuple[str, str, str]] = set()

    def _scoped(self, node: ast.AST) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in self.names:
            self.found.add((self.path, ".".join(self.scope), name))
        self.generic_visit(node)


def _facade_calls() -> Set[Tuple[str, str, str]]:
    names, found = _facade_names(), set()
    for top in ("megatron/core", "megatron/training"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for file in files:
                path = os.path.relpath(os.path.join(root, file), REPO)
                if not file.endswith(".py") or path in FACADE_MODULES:
                    continue
                with open(os.path.join(REPO, path), encoding="utf-8") as f:
                    visitor = _Calls(path, names)
                    visitor.visit(ast.parse(f.read(), path))
                found |= visitor.found
    return found


def test_only_public_boundaries_call_the_group_facade():
    found = _facade_calls()
    assert found - ALLOWED_FACADE_CALLS == set(), "new calls into the global group facade (pass the groups instead)"
    assert ALLOWED_FACADE_CALLS - found == set(), "allowed calls that no longer exist: update ALLOWED_FACADE_CALLS"


def test_facade_reads_raise_while_forbidden():
    with parallel_state.forbid_default_process_groups("test"):
        with pytest.raises(RuntimeError, match="read while forbidden: test"):
            parallel_state.get_tensor_model_parallel_world_size()
    with pytest.raises(RuntimeError, match="not initialized"):  # the guard is gone again
        parallel_state.get_tensor_model_parallel_world_size()


def _pretrain_forbidden(rank: int, world_size: int, save_dir: str) -> int:
    import pretrain_gpt
    from megatron.core.transformer.enums import ModelType
    from megatron.core.transformer.moe import get_aux_loss_tracker
    from megatron.training.training import pretrain
    from tests.functional_tests.gpt_runs import mock_flags, tiny_gpt_flags, with_flags

    changes = {"--num-layers": "4", "--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2"}
    changes.update({"--num-layers-per-virtual-pipeline-stage": "1", "--num-experts": "2", "--moe-router-topk": "1"})
    changes.update({"--moe-aux-loss-coeff": "0.01", "--eval-interval": "3", "--save": save_dir, "--save-interval": "3"})
    flags = with_flags(tiny_gpt_flags(3) + mock_flags(), changes) + ["--sequence-parallel"]
    with parallel_state.forbid_default_process_groups("the training loop must pass its groups"):
        state = pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            argv=flags,
        )
    assert dist.is_initialized()  # the harness's group is left alone
    default = get_aux_loss_tracker()  # the routers wrote to the run's tracker, the schedule scaled that one
    assert not default.values and float(default.loss_scale) == 1.0, (default.values, default.loss_scale)
    return state.iteration


def test_pretrain_never_reads_the_default_groups(tmp_path):
    iterations = run_distributed(_pretrain_forbidden, 4, str(tmp_path / "ckpt"))
    assert iterations == [3, 3, 3, 3]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
