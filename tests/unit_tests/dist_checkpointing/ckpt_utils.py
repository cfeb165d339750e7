"""Helpers for checkpoint tests: models per layout, full weights by checkpoint key, a stub optimizer."""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import TIED_EMBEDDING_KEY, sharded_tensors_by_param_name
from megatron.core.parallel_state import ParallelLayout, ProcessGroupCollection, build_process_groups
from tests.model_utils import build_gpt, gather_tp, gpt2_style, llama_style, tp_group_of


def groups_for(tp: int = 1, pp: int = 1) -> ProcessGroupCollection:
    """Groups of a TP x PP layout over the whole world (the rest is DP); collective."""
    return build_process_groups(
        ParallelLayout(world_size=dist.get_world_size(), tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    )


def tiny_kwargs(style: str) -> Dict:
    """Hidden 32, 2 layers; ``gpt2`` is tied with learned positions, ``llama`` gated/GQA/untied,
    ``moe`` the llama one with 4 experts (top-2) in every layer."""
    if style == "gpt2":
        return gpt2_style()
    if style == "moe":
        return llama_style(
            hidden_size=32, ffn_hidden_size=64, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32
        )
    return llama_style(hidden_size=32, ffn_hidden_size=64)


def build_stage(style: str, groups: ProcessGroupCollection, seed: int) -> torch.nn.Module:
    """This rank's pipeline stage of the tiny model."""
    pp_rank, pp_size = groups.rank_in("pp"), groups.size_of("pp")
    return build_gpt(
        tiny_kwargs(style), groups, seed=seed, pre_process=pp_rank == 0, post_process=pp_rank == pp_size - 1
    )


def full_weights_by_key(
    model: torch.nn.Module, groups: ProcessGroupCollection, tensors: Dict[str, torch.Tensor] = None
) -> Dict[str, torch.Tensor]:
    """Whole tensors by checkpoint key, merged over every rank of the world.

    ``tensors`` (param name -> tensor shaped like the param) replaces the parameters
    (for optimizer state). The last stage's tied copy is returned under
    ``"tied_copy"`` so that tests can compare it with the embedding.
    """
    specs = sharded_tensors_by_param_name([model], groups)
    mine: Dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        value = param.detach() if tensors is None else tensors[name]
        full = gather_tp(value, param, tp_group_of(param, groups)).clone()
        key = "tied_copy" if getattr(param, "shared_embedding", False) else specs[name].key
        mine[key] = full
    gathered: List[Dict[str, torch.Tensor]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged: Dict[str, torch.Tensor] = {}
    for part in gathered:
        for key, value in part.items():
            if key in merged:
                assert torch.equal(merged[key], value), f"replicas of {key} differ"
            merged[key] = value
    return merged


def assert_same_weights(expected: Dict[str, torch.Tensor], actual: Dict[str, torch.Tensor]) -> None:
    """Equal tensors for every key; a tied copy must equal the word embedding."""
    tied = actual.pop("tied_copy", None)
    expected = {k: v for k, v in expected.items() if k != "tied_copy"}
    assert sorted(expected) == sorted(actual), (sorted(expected), sorted(actual))
    for key in expected:
        assert torch.equal(expected[key], actual[key]), f"{key} differs after load"
    if tied is not None:
        assert torch.equal(tied, expected[TIED_EMBEDDING_KEY]), "tied output copy not loaded from the embedding"


class StubOptimizer:
    """The optimizer contract of megatron/core/optimizer, with Adam-like state derived from the params."""

    def __init__(self) -> None:
        self.state: Dict[str, object] = {}

    def fill_from(self, model_chunks) -> None:
        """State that depends on the values: exp_avg = 2p + 1, exp_avg_sq = p^2, main_param = p (fp32)."""
        self.state = {
            "step": 7,
            "param_groups": [{"lr": 0.5, "betas": (0.9, 0.95)}],
            "grad_scaler": {"scale": torch.tensor(1024.0)},
        }
        for chunk in model_chunks:
            for name, p in chunk.named_parameters():
                p = p.detach().float()
                self.state[name] = {"exp_avg": 2 * p + 1, "exp_avg_sq": p * p, "main_param": p.clone()}

    def state_dict_by_param_name(self, model_chunks) -> Dict[str, object]:
        return self.state

    def reload_model_params(self) -> None:
        """Main weights from the model (a load without optimizer state): none are kept here."""

    def load_state_dict_by_param_name(self, model_chunks, state: Dict[str, object]) -> None:
        names = {n for c in model_chunks for n, _ in c.named_parameters()}
        missing = names - set(state)
        assert not missing, f"optimizer state missing for {sorted(missing)}"
        self.state = state
