"""What a resumed run restores besides the weights: every RNG stream, and each optimizer group's settings.

The end-to-end proof is ``tests/functional_tests/test_pretrain_gpt.py`` (resume with dropout under
TP=2 and PP=2); these tests pin the pieces: the generators a checkpoint captures, the blocks of
the training loop that must not move them, and optimizer groups matched by kind across stages.
"""

import logging
import random

import numpy as np
import pytest
import torch

from megatron.core.dist_checkpointing import plain_data
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel.random import (
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    seed_rng_tracker,
    use_rng_tracker,
)
from megatron.training.checkpointing import collect_rng_state, restore_rng_state
from megatron.training.training import rng_untouched
from tests.unit_tests.optimizer.test_optimizer import groups  # noqa: F401 - the one-rank process groups fixture

TRACKED = "model-parallel-rng"


@pytest.fixture
def seeded():
    """Seed every generator as start-up does (TP rank 0) into a run's own tracker, installed as the current one."""
    tracker = CudaRNGStatesTracker()
    outer = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    seed_rng_tracker(tracker, 5, tp_rank=0, ep_rank=0, etp_rank=0)
    with use_rng_tracker(tracker):
        yield tracker
    random.setstate(outer[0])
    np.random.set_state(outer[1])
    torch.set_rng_state(outer[2])


def _draws():
    """One number from each stream a training step may draw from."""
    with get_cuda_rng_tracker().fork(TRACKED):
        tracked = torch.rand(3)
    return random.random(), float(np.random.rand()), torch.rand(3), tracked


def test_the_run_tracker_is_the_current_one_only_inside_use_rng_tracker():
    default = get_cuda_rng_tracker()
    first, second = CudaRNGStatesTracker(), CudaRNGStatesTracker()
    seed_rng_tracker(first, 1, 0, 0, 0)
    seed_rng_tracker(second, 2, 0, 0, 0)
    with use_rng_tracker(first):
        assert get_cuda_rng_tracker() is first
        with use_rng_tracker(second):
            with get_cuda_rng_tracker().fork(TRACKED):
                torch.rand(2)  # advances the second run's stream only
        assert get_cuda_rng_tracker() is first
    assert get_cuda_rng_tracker() is default
    fresh = {seed: CudaRNGStatesTracker() for seed in (1, 2)}
    for seed, tracker in fresh.items():
        seed_rng_tracker(tracker, seed, 0, 0, 0)
    assert torch.equal(first.get_states()[TRACKED], fresh[1].get_states()[TRACKED])  # untouched
    assert not torch.equal(second.get_states()[TRACKED], fresh[2].get_states()[TRACKED])  # drawn from


def _same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def test_restore_replays_every_stream(seeded):
    state = collect_rng_state(seeded)
    first = _draws()
    restore_rng_state(state, seeded)
    assert _same(_draws(), first)


def test_dataloader_start_moves_the_default_generator_but_not_inside_rng_untouched(seeded):
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    before = torch.get_rng_state()
    iter(loader)  # the iterator draws its workers' base seed from the default generator
    assert not torch.equal(before, torch.get_rng_state())
    state = collect_rng_state(seeded)
    with rng_untouched(seeded):
        iter(loader)
        _draws()
    assert collect_rng_state(seeded) == state


def _as_if_saved_on_cuda(state):
    """``state`` rewritten as a CUDA process would have saved it (16-byte CUDA generator states)."""
    decoded = plain_data.decode(state)
    cuda_state = torch.zeros(16, dtype=torch.uint8)
    decoded.update(
        device="cuda",
        cuda=[cuda_state],
        cuda_device=0,
        tracker={name: cuda_state.clone() for name in decoded["tracker"]},
    )
    return plain_data.encode(decoded)


@pytest.mark.skipif(torch.cuda.is_available(), reason="restores a CUDA-saved state on a CPU-only process")
def test_cuda_saved_state_restores_host_generators_and_says_what_it_left(seeded, caplog):
    saved = collect_rng_state(seeded)
    expected = _draws()[:3]  # python, numpy, torch CPU after the saved point
    cuda_saved = _as_if_saved_on_cuda(saved)
    tracker_before = get_cuda_rng_tracker().get_states()
    with caplog.at_level(logging.WARNING, logger="megatron.training.checkpointing"):
        restore_rng_state(cuda_saved, seeded)
    assert "saved on cuda, this run is on cpu" in caplog.text
    after = get_cuda_rng_tracker().get_states()
    assert after.keys() == tracker_before.keys()
    assert all(torch.equal(after[k], tracker_before[k]) for k in after)  # CPU streams, still usable
    assert _same(_draws()[:3], expected)


def test_state_written_before_the_device_field_still_restores(seeded):
    decoded = plain_data.decode(collect_rng_state(seeded))
    del decoded["device"], decoded["cuda_device"]
    old = plain_data.encode(decoded)
    first = _draws()
    restore_rng_state(old, seeded)
    assert _same(_draws(), first)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_cuda_device_generator_is_captured_and_restored(seeded):
    state = collect_rng_state(seeded)
    assert plain_data.decode(state)["device"] == "cuda"
    per_device = [torch.rand(4, device=f"cuda:{d}") for d in range(torch.cuda.device_count())]
    first = _draws()
    restore_rng_state(state, seeded)
    again = [torch.rand(4, device=f"cuda:{d}") for d in range(torch.cuda.device_count())]
    assert all(torch.equal(a, b) for a, b in zip(per_device, again))
    assert _same(_draws(), first)


# ----------------------------------------------------------------------------------
# Optimizer groups: a checkpoint keeps rank 0's list; other pipeline stages order theirs differently.
# ----------------------------------------------------------------------------------
def _optimizer(model, process_groups):
    config = OptimizerConfig(lr=1e-3, min_lr=1e-4, weight_decay=0.1)
    return get_megatron_optimizer(config, [model], pg_collection=process_groups)


def test_group_settings_load_by_kind_not_position(groups):  # noqa: F811 - the fixture
    """First stage: a weight first (decay group first); last stage: a norm first (no-decay group first)."""
    first_stage = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.LayerNorm(4))
    last_stage = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4, bias=False))
    saved = _optimizer(first_stage, groups).state_dict_by_param_name([first_stage])["param_groups"]
    opt = _optimizer(last_stage, groups)
    assert [g["wd_mult"] for g in opt.param_groups] != [g["wd_mult"] for g in saved]  # the case at hand
    state = opt.state_dict_by_param_name([last_stage])
    built = [dict(g) for g in opt.param_groups]
    opt.load_state_dict_by_param_name([last_stage], dict(state, param_groups=saved))
    for group, before in zip(opt.param_groups, built):
        assert group["wd_mult"] == before["wd_mult"] and group["weight_decay"] == before["weight_decay"]
        assert group["params"] == before["params"]
