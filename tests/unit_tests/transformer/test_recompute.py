"""Activation recomputation changes memory, not results: with dropout on, full (uniform, block) and
selective recomputation give bit-identical losses and gradients to no recomputation, because the
recompute replays the RNG states (TP=2 with sequence parallelism, so the tracked stream is used).

Structurally, each setting must recompute what it names and save less for backward: forward pre-hooks
count how often each layer and each core attention runs in one forward + backward (twice when
recomputed), and ``saved_tensors_hooks`` add up the bytes the forward keeps for backward (fewer with
recomputation, fewer again with ``distribute_saved_activations`` at TP=2).
"""

from typing import Dict, Tuple

import torch

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gpt2_style

SETTINGS = {
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}


def _run(groups, **recompute):
    style = gpt2_style(hidden_dropout=0.1, attention_dropout=0.1, sequence_parallel=True)
    model = build_gpt(style, groups, **recompute)
    torch.manual_seed(5)
    model_parallel_cuda_manual_seed(5)  # same dropout masks for every setting
    tokens, labels = batch()
    loss = model(tokens, None, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _body(rank, world_size):
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=2)
    base_loss, base_grads = _run(groups)
    for name, recompute in SETTINGS.items():
        loss, grads = _run(groups, **recompute)
        assert torch.equal(loss, base_loss), name
        for key, grad in grads.items():
            assert torch.equal(grad, base_grads[key]), f"{name}: {key}"


def test_recompute_is_exact_with_dropout():
    run_distributed(_body, 2)


def _runs_and_saved_bytes(groups, **recompute) -> Tuple[Dict[str, int], int]:
    """Forward runs per layer / core attention in one forward + backward, and the bytes saved for backward."""
    model = build_gpt(gpt2_style(num_layers=3, hidden_dropout=0.1), groups, **recompute)
    runs: Dict[str, int] = {}
    for i, layer in enumerate(model.decoder.layers):
        for name, module in ((f"layer{i}", layer), (f"attention{i}", layer.self_attention.core_attention)):
            runs[name] = 0
            module.register_forward_pre_hook(lambda m, a, name=name: runs.__setitem__(name, runs[name] + 1))
    params = {p.data_ptr() for p in model.parameters()}
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            saved.append(t.numel() * t.element_size())
        return t

    tokens, labels = batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, None, None, labels=labels).mean()
    loss.backward()
    return runs, sum(saved)


def _structure_body(rank, world_size):
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=2)
    twice = {
        "full-uniform": {"layer0", "layer1", "layer2", "attention0", "attention1", "attention2"},
        "full-block": {"layer0", "attention0"},  # recompute_num_layers=1: the first layer only
        "selective": {"attention0", "attention1", "attention2"},
    }
    base_runs, base_saved = _runs_and_saved_bytes(groups)
    assert set(base_runs.values()) == {1}, base_runs
    saved_by = {}
    for name, recompute in SETTINGS.items():
        runs, saved_by[name] = _runs_and_saved_bytes(groups, **recompute)
        assert {k for k, n in runs.items() if n == 2} == twice[name], f"{name}: forward runs {runs}"
        assert set(runs.values()) <= {1, 2}, f"{name}: forward runs {runs}"
        assert saved_by[name] < base_saved, f"{name}: saved {saved_by[name]} bytes, {base_saved} without recompute"
    # distribute_saved_activations keeps 1/tp of each recomputed block's input on each TP rank.
    _, distributed = _runs_and_saved_bytes(groups, distribute_saved_activations=True, **SETTINGS["full-uniform"])
    assert distributed < saved_by["full-uniform"], f"distributed: saved {distributed} bytes, {saved_by['full-uniform']}"


def test_recompute_reruns_what_it_names_and_saves_less():
    run_distributed(_structure_body, 2)
