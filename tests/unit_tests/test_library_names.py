"""Issue 38's names for library users, checked against megatron-core's / Megatron-LM's documented behaviour.

Single-process checks first (nested-dict helpers, strategy actions, the canonical LR, Megatron-LM's
training helpers); then one 2-rank group for what needs process groups (boundaries without explicit
groups, ``_set_random_seed``).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import io
import logging
import os
import random
from typing import List, Literal, Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron.core.dist_checkpointing import dict_utils as du
from megatron.core.dist_checkpointing.strategies.base import StrategyAction
from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging
from megatron.training import global_vars
from megatron.training.argument_utils import ArgumentGroupFactory, TypeInferenceError
from tests.dist_harness import run_distributed


# ----------------------------------------------------------------------------------
# dist_checkpointing.dict_utils
# ----------------------------------------------------------------------------------
def _tree():
    return {"a": torch.arange(3), "b": {"c": 1, "d": [torch.ones(2), "s", []]}, "e": {}}


def test_extract_matching_values_keeps_the_nesting():
    is_tensor = lambda v: isinstance(v, torch.Tensor)  # noqa: E731
    match, rest = du.extract_matching_values(_tree(), is_tensor)
    assert set(match) == {"a", "b"} and set(match["b"]) == {"d"} and len(match["b"]["d"]) == 1
    assert torch.equal(match["b"]["d"][0], torch.ones(2)) and torch.equal(match["a"], torch.arange(3))
    # Non-matching leaves keep their place; empty containers stay on the non-matching side.
    assert rest == {"b": {"c": 1, "d": ["s", []]}, "e": {}}
    match, rest = du.extract_matching_values(_tree(), is_tensor, return_lists_as_dicts=True)
    assert list(match["b"]["d"]) == [0] and rest["b"]["d"] == {1: "s", 2: []}
    with pytest.raises(ValueError, match="dict or list"):
        du.extract_matching_values(3, is_tensor)


def test_diff_reports_sides_and_mismatches():
    left, right = _tree(), _tree()
    del left["e"]
    right["b"]["x"] = 2
    right["a"] = torch.tensor([0, 1, 5])
    right["b"]["c"] = 7
    only_left, only_right, mismatch = du.diff(left, right)
    assert only_left == [] and sorted(only_right) == [("b", "x"), ("e",)]
    assert sorted(m[0] for m in mismatch) == [("a",), ("b", "c")]
    assert du.diff([1, 2, 3], [1, 2]) == ([2], [], [])  # list tails are reported by index
    assert du.diff(_tree(), _tree()) == ([], [], [])


def test_nested_iteration_and_maps():
    tree = {"x": [1, {"y": 2}], "z": 3}
    assert list(du.nested_values(tree)) == [1, 2, 3]
    assert [(k, v) for _, k, v in du.nested_items_iter(tree)] == [(0, 1), ("y", 2), ("z", 3)]
    out = du.dict_list_map_outplace(lambda v: v * 10, tree)
    assert out == {"x": [10, {"y": 20}], "z": 30} and tree == {"x": [1, {"y": 2}], "z": 3}
    same = du.dict_list_map_inplace(lambda v: v + 1, tree)
    assert same is tree and tree == {"x": [2, {"y": 3}], "z": 4}
    du.dict_map(str, tree)
    assert tree == {"x": ["2", {"y": "3"}], "z": "4"}
    du.dict_map_with_key(lambda k, v: f"{k}={v}", tree)
    assert tree == {"x": ["0=2", {"y": "y=3"}], "z": "z=4"}


def test_merge_and_map_reduce():
    merged = du.merge({"a": {"b": 1}, "l": [{"p": 1}]}, {"a": {"c": 2}, "l": [{"q": 2}], "n": 3})
    assert merged == {"a": {"b": 1, "c": 2}, "l": [{"p": 1, "q": 2}], "n": 3}
    with pytest.raises(ValueError, match=r"\('a', 'b'\)"):
        du.merge({"a": {"b": 1}}, {"a": {"b": 2}})
    with pytest.raises(ValueError, match="lengths 1 and 2"):
        du.merge([1], [1, 2])
    words = ["apple", "avocado", "banana"]
    assert du.map_reduce(words, key_fn=lambda w: w[0], value_fn=len, reduce_fn=sum) == {"a": 12, "b": 6}


def test_sharded_tensor_dtype_and_axis_fragmentations():
    from megatron.core.dist_checkpointing import ShardedTensor

    piece = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3, dtype=torch.bfloat16), (0, 1, 4), (1, 0, 2))
    assert piece.global_shape == (8, 6) and piece.global_offset == (2, 0)
    assert piece.axis_fragmentations == (4, 2) and piece.dtype == torch.bfloat16


def test_sharded_tensor_takes_megatron_cores_positional_fields():
    """key, data, dtype, local_shape, global_shape, global_offset, axis_fragmentations, replica_id,
    prepend_axis_num, allow_shape_mismatch, flattened_range: megatron-core's order."""
    from megatron.core.dist_checkpointing import ShardedTensor

    data = torch.arange(6.0).view(2, 3)
    piece = ShardedTensor("w", data, torch.float32, (2, 3), (4, 3), (2, 0), (2, 1), 0)
    same = ShardedTensor.from_rank_offsets("w", data, (0, 1, 2))
    fields = ("key", "dtype", "local_shape", "global_shape", "global_offset", "axis_fragmentations", "replica_id")
    assert all(getattr(piece, f) == getattr(same, f) for f in fields) and piece.data is data
    assert piece.local_shape == (2, 3) and piece.replica_id == 0 and piece.has_regular_grid
    assert piece.global_slice() == (slice(2, 4), slice(0, 3)) and piece.local_chunk_offset_in_global() == (1, 0)
    assert piece.max_allowed_chunks() == (2, 3)
    piece.validate_metadata_integrity()
    # A prepended axis: the global tensor is [experts, 2, 3]; data is viewed, load returns data's shape.
    expert = ShardedTensor("e", data, torch.float32, (2, 3), (4, 2, 3), (1, 0, 0), None, (0, 1), 1)
    assert expert.data.shape == (1, 2, 3) and expert.data_shape == (2, 3) and expert.axis_fragmentations == (4, 1, 1)
    assert expert.replica_id == 1 and expert.prepend_axis_num == 0
    refused = [
        ((torch.bfloat16, (2, 3)), "dtype=torch.bfloat16"),  # not data's dtype
        ((torch.float32, (3, 2)), "local_shape=\\(3, 2\\)"),  # not data's shape
    ]
    for (dtype, local), message in refused:
        with pytest.raises(ValueError, match=message):
            ShardedTensor("w", data, dtype, local, (4, 3), (2, 0), None)
    with pytest.raises(ValueError, match="axis_fragmentations=\\(3, 1\\)"):
        ShardedTensor("w", data, torch.float32, (2, 3), (4, 3), (2, 0), (3, 1))
    with pytest.raises(NotImplementedError, match="allow_shape_mismatch"):
        ShardedTensor("w", data, torch.float32, (2, 3), (4, 3), (2, 0), None, 0, 0, True)
    with pytest.raises(NotImplementedError, match="flattened_range"):
        ShardedTensor("w", data, torch.float32, (2, 3), (4, 3), (2, 0), None, flattened_range=slice(0, 2))


def test_strategy_actions():
    assert {a.value for a in StrategyAction} == {"load_common", "load_sharded", "save_common", "save_sharded"}
    assert StrategyAction("save_sharded") is StrategyAction.SAVE_SHARDED


def test_canonical_lr_is_the_first_default_group():
    groups = [{"lr": 0.5, "default_config": False}, {"lr": 0.1, "default_config": True}, {"lr": 0.2}]
    assert get_canonical_lr_for_logging(groups) == 0.1
    assert get_canonical_lr_for_logging([{"lr": 0.3}]) is None


def test_config_without_width_and_symmetric_all_reduce_choice():
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, num_attention_heads=1)  # upstream's buffer-only configs
    assert (config.hidden_size, config.kv_channels, config.ffn_hidden_size) == (0, 0, 0)
    with pytest.raises(ValueError, match="LanguageModelEmbedding: hidden_size=0"):
        LanguageModelEmbedding(config, 16, 4)  # refused before any group is looked up
    with pytest.raises(ValueError, match="hidden_size=-1"):
        TransformerConfig(num_layers=1, num_attention_heads=1, hidden_size=-1)
    assert TransformerConfig(num_layers=1, num_attention_heads=1, symmetric_ar_type="one_shot").symmetric_ar_type
    with pytest.raises(ValueError, match="symmetric_ar_type='three_shot'"):
        TransformerConfig(num_layers=1, num_attention_heads=1, symmetric_ar_type="three_shot")


def test_hyper_comm_grid_groups_by_coordinates(monkeypatch):
    from megatron.core.hyper_comm_grid import HyperCommGrid

    monkeypatch.setenv("WORLD_SIZE", "16")
    grid = HyperCommGrid([2, 3, 2], ["tp", "cp", "dp"], rank_offset=4)
    coords = {r: ((r - 4) % 2, (r - 4) // 2 % 3, (r - 4) // 6) for r in range(4, 16)}  # tp fastest

    def reference(varying):  # ranks equal on every other dimension, ascending; groups by first rank
        keep = [i for i in range(3) if i not in varying]
        groups = {}
        for r in sorted(coords):
            groups.setdefault(tuple(coords[r][i] for i in keep), []).append(r)
        return sorted(groups.values())

    assert grid.get_rank_enum("cp") == reference([1])
    assert grid.get_rank_enum(["dp", "tp"]) == grid.get_rank_enum(["tp", "dp"]) == reference([0, 2])
    assert grid.get_rank_enum(["tp", "cp", "dp"]) == [list(range(4, 16))]
    assert grid._order_dims(["tp", "dp"])[1] == "dp-tp"
    with pytest.raises(KeyError, match="create_pg first"):
        grid.get_pg("tp")
    with pytest.raises(RuntimeError, match="needs 12 ranks"):
        HyperCommGrid([2, 3, 2], ["tp", "cp", "dp"], rank_offset=5)


def test_weights_only_load_reads_upstream_safe_globals(tmp_path):
    import megatron.core.utils  # noqa: F401 - registers the safe globals (upstream: on import megatron.core)

    path = str(tmp_path / "args.pt")
    torch.save({"args": argparse.Namespace(lr=0.1, name="x"), "buffer": io.BytesIO(b"abc")}, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["args"] == argparse.Namespace(lr=0.1, name="x") and loaded["buffer"].getvalue() == b"abc"
    torch.save({"other": Color.red}, path)  # anything not registered is still refused
    with pytest.raises(Exception, match="weights_only|Unsupported global"):
        torch.load(path, weights_only=True)


def test_chained_optimizer_over_plain_torch_optimizers():
    from megatron.core.optimizer import ChainedOptimizer

    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
    adam, sgd = torch.optim.Adam(params[:2], lr=0.01), torch.optim.SGD(params[2:], lr=0.1, momentum=0.9)
    chained = ChainedOptimizer([adam, sgd])
    assert chained.config is None and not chained.is_stub_optimizer
    chained.param_groups[0]["lr"] = 0.02  # the groups are the optimizers' own
    assert adam.param_groups[0]["lr"] == 0.02
    for p in params:
        p.grad = torch.ones(3)
    adam.step(), sgd.step()
    assert set(chained.state) == {(0, params[0]), (0, params[1]), (1, params[2])} and len(chained.state) == 3
    assert chained.state[(1, params[2])] is sgd.state[params[2]] and chained.state[(1, params[0])] is None
    saved = chained.state_dict()
    again = ChainedOptimizer([torch.optim.Adam(params[:2], lr=0.01), torch.optim.SGD(params[2:], lr=0.1)])
    again.load_state_dict(saved)
    assert torch.equal(again.state[(0, params[1])]["exp_avg"], adam.state[params[1]]["exp_avg"])
    chained.zero_grad()
    assert all(p.grad is None for p in params)
    with pytest.raises(ValueError, match="needs MegatronOptimizers"):
        chained.step()
    stub = ChainedOptimizer([])
    assert stub.is_stub_optimizer and stub.get_loss_scale().item() == 1.0


# ----------------------------------------------------------------------------------
# megatron.training: argument_utils, set_args, build_tokenizer(args)
# ----------------------------------------------------------------------------------
class Color(enum.Enum):
    red = 1
    blue = 2


@dataclasses.dataclass
class Base:
    """Base settings."""

    depth: int = 2
    """How deep."""


@dataclasses.dataclass
class Settings(Base):
    """Some settings."""

    name: Optional[str] = None
    """The run's name."""
    sizes: List[int] = dataclasses.field(default_factory=lambda: [1, 2])
    use_fast: bool = False
    keep_cache: bool = True
    mode: Literal["a", "b"] = "a"
    color: Color = Color.red
    hidden: int = dataclasses.field(default=0, init=False)
    either: int = dataclasses.field(default=1, metadata={"argparse_meta": {"arg_names": ["--either-one"]}})


def test_argument_group_factory_builds_flags_from_a_dataclass():
    parser = argparse.ArgumentParser()
    group = ArgumentGroupFactory(Settings, exclude=["depth"]).build_group(parser, title="settings")
    assert group.title == "settings" and group.description == "Some settings."
    defaults = parser.parse_args([])
    assert vars(defaults) == {
        "name": None,
        "sizes": [1, 2],
        "use_fast": False,
        "keep_cache": True,
        "mode": "a",
        "color": Color.red,
        "either": 1,
    }
    argv = "--name x --sizes 3 4 5 --use-fast --disable-keep-cache --mode b --color blue --either-one 7".split()
    args = parser.parse_args(argv)
    assert (args.name, args.sizes, args.use_fast, args.keep_cache) == ("x", [3, 4, 5], True, False)
    assert (args.mode, args.color, args.either) == ("b", Color.blue, 7)
    assert parser.parse_args(["--no-keep-cache"]).keep_cache is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "c"])
    helps = {a.dest: a.help for a in group._group_actions}
    assert helps["name"] == "The run's name."
    assert ArgumentGroupFactory(Settings).field_docstrings["depth"] == "How deep."  # from the base class


def test_argument_group_factory_refuses_what_argparse_cannot_say():
    @dataclasses.dataclass
    class Bad:
        both: int | str = 1

    with pytest.raises(TypeInferenceError, match="union"):
        ArgumentGroupFactory(Bad).build_group(argparse.ArgumentParser())


def test_set_args_and_build_tokenizer_from_a_minimal_namespace(monkeypatch):
    from megatron.training.tokenizer import build_tokenizer

    monkeypatch.setattr(global_vars, "_ARGS", None)
    args = argparse.Namespace(
        tokenizer_type="NullTokenizer", vocab_size=1000, make_vocab_size_divisible_by=128, tensor_model_parallel_size=2
    )
    global_vars.set_args(args)
    assert global_vars.get_args() is args
    tokenizer = build_tokenizer(args)  # only the attributes this type reads
    # The null tokenizer adds its end-of-document id; 1001 padded up to a multiple of 128 x TP.
    assert tokenizer.vocab_size == 1001 and args.padded_vocab_size == 1024
    args.padded_vocab_size = 2048  # a size read from a checkpoint is kept
    build_tokenizer(args)
    assert args.padded_vocab_size == 2048
    with pytest.raises(ValueError, match="not supported"):
        build_tokenizer(args, use_fast=True)


# ----------------------------------------------------------------------------------
# Boundaries without explicit groups, and _set_random_seed (2 ranks, TP=2 then EP=2)
# ----------------------------------------------------------------------------------
def _gpt_config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True, hidden_dropout=0.0)
    return TransformerConfig(**{**base, **kw})


def _check_random_seed(rank):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.training.initialize import _set_random_seed

    _set_random_seed(1234)  # pipeline rank 0: the seed itself for python, numpy and torch
    assert random.random() == random.Random(1234).random()
    assert np.random.rand() == np.random.RandomState(1234).rand()
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(1234)))
    with get_cuda_rng_tracker().fork():  # Megatron's TP stream: seed + 2718 + tp rank
        drawn = torch.rand(3)
    assert torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(1234 + 2718 + rank)))
    with pytest.raises(ValueError, match="positive"):
        _set_random_seed(0)


def _check_embedding(rank, groups):
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    config = _gpt_config(sequence_parallel=True, tensor_model_parallel_size=2)
    scattered = LanguageModelEmbedding(config, 64, 8, pg_collection=groups)
    whole = LanguageModelEmbedding(config, 64, 8, scatter_to_sequence_parallel=False)  # the default TP group
    assert whole.tp_group is groups.tp and LanguageModelEmbedding(config, 64, 8, "rope", 0, True, groups.tp)
    whole.load_state_dict(scattered.state_dict())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    full, shard = whole(ids, None), scattered(ids, None)  # [s, b, h] and [s/tp, b, h]
    assert full.shape == (8, 2, 16) and torch.allclose(shard, full.chunk(2)[rank])
    whole.zero_parameters()  # every table zeroed and marked shared (left out of grad-norm clipping)
    assert all(not p.any() and p.shared for p in whole.parameters())


def _check_moe_layer(groups):
    from megatron.core.transformer.moe import MoELayer

    config = _gpt_config(
        num_moe_experts=4,
        moe_router_topk=2,
        expert_model_parallel_size=2,
        gated_linear_unit=True,
        activation_func=F.silu,
    )
    explicit = MoELayer(config, pg_collection=groups)
    default = MoELayer(config)  # upstream: groups from initialize_model_parallel
    default.load_state_dict(explicit.state_dict())
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(1))
    assert torch.equal(default(x)[0], explicit(x)[0]) and default.num_local_experts == 2


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _check_common_state_and_bytes(rank, tmp):
    """BytesIO in a ShardedObject round-trips; a rank whose common state differs from rank 0's warns on save."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import nested

    records = _Records()
    nested.logger.addHandler(records)
    piece = lambda data: dc.ShardedObject("rng", data, (2,), (rank,))  # noqa: E731
    state = {"rng": piece(io.BytesIO(f"rank {rank}".encode())), "iteration": 5 + rank, "same": [1, 2]}
    dc.save(state, os.path.join(tmp, "a"))
    loaded = dc.load({"rng": piece(None)}, os.path.join(tmp, "a"))
    assert loaded["rng"].getvalue() == f"rank {rank}".encode() and loaded["iteration"] == 5  # rank 0's is written
    assert len(records.messages) == rank  # rank 0 compares with nobody
    assert rank == 0 or "Rank 1 common state dict differs" in records.messages[0]
    assert rank == 0 or "Mismatched keys: [('iteration',)]" in records.messages[0]
    without = lambda common: {k: v for k, v in common.items() if k != "iteration"}  # noqa: E731
    dc.save(state, os.path.join(tmp, "b"), preprocess_common_before_consistancy_check=without)
    dc.save(state, os.path.join(tmp, "c"), validate_access_integrity=False)
    assert len(records.messages) == rank  # neither warned again
    nested.logger.removeHandler(records)


def _check_hyper_comm_grid():
    import torch.distributed as dist

    from megatron.core.hyper_comm_grid import HyperCommGrid

    grid = HyperCommGrid([2], ["dp"])
    group = grid.create_pg(["dp"])
    assert grid.get_pg("dp") is group and dist.get_world_size(group) == 2
    with pytest.raises(KeyError, match="already created"):
        grid.create_pg("dp")


def _check_distributed_input_at_tp1():
    """distribute_saved_activations at TP=1: the caller's tensor is its flat copy until backward (as upstream)."""
    from megatron.core import tensor_parallel

    x, y = torch.ones(4, 4), torch.full((4, 4), 2.0)
    out = tensor_parallel.checkpoint(torch.add, True, x, y)
    assert torch.equal(out, torch.full((4, 4), 3.0)) and x.shape == (16,) and torch.equal(x, torch.ones(16))
    x = torch.ones(4, 4, requires_grad=True)
    tensor_parallel.checkpoint(torch.add, True, x, y).sum().backward()
    assert x.shape == (4, 4) and torch.equal(x.grad, torch.ones(4, 4))  # regrown for the recompute


def _check_sinkhorn_router(groups):
    """A Sinkhorn router routes every token to k experts, and its gate gets gradients through the probs."""
    from megatron.core.transformer.moe.router import TopKRouter

    config = _gpt_config(num_moe_experts=4, moe_router_topk=2, moe_router_load_balancing_type="sinkhorn")
    router = TopKRouter(config, groups.tp).train()
    probs, routing = router(torch.randn(16, 16, generator=torch.Generator().manual_seed(4)))
    assert probs.shape == (16, 4) and (routing.sum(1) == 2).all() and torch.equal(probs != 0, routing)
    probs.sum().backward()
    assert router.weight.grad.abs().sum() > 0


def _boundaries(rank, world, tmp):
    from megatron.core import parallel_state as ps

    groups = ps.initialize_model_parallel(tensor_model_parallel_size=2)
    _check_random_seed(rank)
    _check_embedding(rank, groups)
    ps.destroy_model_parallel()
    groups = ps.initialize_model_parallel(expert_model_parallel_size=2)
    _check_moe_layer(groups)
    _check_hyper_comm_grid()
    _check_distributed_input_at_tp1()
    _check_sinkhorn_router(groups)
    ps.destroy_model_parallel()
    _check_common_state_and_bytes(rank, tmp)


def test_boundaries_without_explicit_groups_and_set_random_seed_and_common_state(tmp_path):
    run_distributed(_boundaries, 2, str(tmp_path))


# ----------------------------------------------------------------------------------
# moe_router_load_balancing_type='sinkhorn'
# ----------------------------------------------------------------------------------
def _numpy_sinkhorn(cost, tol=1e-4):
    """Sinkhorn-Knopp in numpy (float64): scale exp(cost) to rows of 1/T and columns of 1/E."""
    k = np.exp(cost.astype(np.float64))
    r, c = np.ones(k.shape[0]), np.ones(k.shape[1])
    while True:
        r = 1.0 / (k.shape[0] * (k @ c))
        new_c = 1.0 / (k.shape[1] * (r @ k))
        done = np.abs(new_c - c).mean() <= tol
        c = new_c
        if done:
            return k * np.outer(r, c)


def test_sinkhorn_balances_and_routes_like_a_numpy_reference():
    from megatron.core.transformer.moe.routing import sinkhorn, sinkhorn_route

    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(3)) * 3
    balanced = sinkhorn(logits.double(), tol=1e-6)  # columns exact after the last update, rows nearly
    assert torch.allclose(balanced.sum(0), torch.full((8,), 1 / 8, dtype=torch.float64), rtol=1e-6)
    assert torch.allclose(balanced.sum(1), torch.full((64,), 1 / 64, dtype=torch.float64), rtol=1e-4)
    want = _numpy_sinkhorn(logits.numpy())
    assert np.allclose(sinkhorn(logits).numpy(), want, rtol=1e-4)
    for topk in (1, 2):
        probs, routing = sinkhorn_route(logits, topk, training=True)
        chosen = np.argsort(-want, axis=1)[:, :topk]
        assert (routing.sum(1) == topk).all() and all(
            set(np.flatnonzero(routing[t])) == set(chosen[t]) for t in range(64)
        )
        act = torch.sigmoid(logits) if topk == 1 else torch.softmax(logits, -1)
        assert torch.allclose(probs, act * routing)
        _, eval_map = sinkhorn_route(logits, topk, training=False)  # evaluation: the activated logits' top k
        assert torch.equal(eval_map, torch.zeros_like(eval_map).scatter(1, act.topk(topk, 1).indices, True))
    # Balancing spreads tokens more evenly than the plain top-1 of these skewed logits.
    skewed = logits + torch.tensor([4.0] + [0.0] * 7)
    spread = lambda m: m.sum(0).float().std()  # noqa: E731
    assert spread(sinkhorn_route(skewed, 1, True)[1]) < spread(sinkhorn_route(skewed, 1, False)[1])


def test_sinkhorn_refuses_the_settings_it_ignores():
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2)
    assert TransformerConfig(**base, moe_router_load_balancing_type="sinkhorn").moe_aux_loss_coeff == 0.0
    with pytest.raises(ValueError, match="moe_aux_loss_coeff=0.01 does not apply"):
        TransformerConfig(**base, moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.01)
