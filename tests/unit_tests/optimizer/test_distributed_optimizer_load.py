"""The distributed optimizer reads only its own slices from a torch_dist checkpoint.

``sharded_state_template`` asks, per parameter with a slice on this rank, for the smallest box of the
parameter's view that holds the slice; loading through it gives exactly the state that loading whole
parameters gives (compared with the state before saving), for DP=2 and TP=2 x DP=2 (a GPT-2 and a
SwiGLU/GQA model, whose fc1 is a stride-2 view), while allocating little more than 1/dp of the state.

Without optimizer state (``--no-load-optim``, ``--finetune``) the fp32 main weights are copied from the
loaded bf16 model (before, they kept the fresh model's initial values and the first step overwrote the
loaded weights).
"""

from __future__ import annotations

import os
from typing import Dict

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import plain_data
from megatron.core.dist_checkpointing.serialization import read_json
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.training.checkpointing import CheckpointConfig, load_checkpoint, save_checkpoint
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gpt2_style, llama_style
from tests.unit_tests.dist_checkpointing.ckpt_utils import groups_for

BF16 = {"params_dtype": torch.bfloat16, "bf16": True}
STYLES = {"gpt2": gpt2_style, "llama": llama_style}


def _build(groups, style: str, seed: int):
    model = build_gpt(STYLES[style](**BF16), groups, seed=seed)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model, pg_collection=groups
    )
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, use_distributed_optimizer=True, **BF16)
    return ddp, get_megatron_optimizer(config, [ddp], pg_collection=groups)


def _train(groups, ddp, opt) -> None:
    for it in range(2):
        tokens, labels = batch(seed=10 * it + groups.rank_in("dp"), b=2)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        opt.scale_loss(ddp(tokens, None, None, labels=labels).float().mean()).backward()
        finalize_model_grads([ddp], None, groups)
        assert opt.step()[0]


def _saved_dtypes(iter_dir: str) -> Dict[str, Dict[str, torch.dtype]]:
    saved: Dict[str, Dict[str, torch.dtype]] = {}
    for key, md in dc.read_metadata(iter_dir).state_dict_metadata.items():
        if key.startswith(dc.OPTIMIZER_STATE_PREFIX):
            param_key, _, state = key[len(dc.OPTIMIZER_STATE_PREFIX) :].rpartition(".")
            saved.setdefault(param_key, {})[state] = md.properties.dtype
    return saved


def _state_of(opt) -> Dict[int, Dict[str, torch.Tensor]]:
    return {i: {k: v.clone() for k, v in opt.optimizer.state[link.main].items()} for i, link in enumerate(opt.links)}


def _body(rank: int, world_size: int, tmp: str, tp: int, style: str) -> None:
    groups = groups_for(tp)
    ddp, opt = _build(groups, style, seed=1)
    _train(groups, ddp, opt)
    save_checkpoint(2, [ddp], opt, None, CheckpointConfig(save=tmp), {}, {})
    before = _state_of(opt)
    main_params = [link.main.detach().clone() for link in opt.links]

    ddp, opt = _build(groups, style, seed=7)
    iter_dir = os.path.join(tmp, "iter_0000002")
    specs = dc.sharded_tensors_by_param_name([ddp], groups)
    template, per_param = opt.sharded_state_template([ddp], specs, _saved_dtypes(iter_dir))
    dc.load(template, iter_dir)
    state = dict(plain_data.decode(read_json(os.path.join(iter_dir, "common.json"), "common")["optimizer"]))
    state.update(per_param)
    opt.load_state_dict_by_param_name([ddp], state)

    for i, link in enumerate(opt.links):
        for key, value in before[i].items():
            assert torch.equal(opt.optimizer.state[link.main][key], value), (i, key)
        assert torch.equal(link.main, main_params[i]), i
    read = sum(t.data.numel() for t in template.values())
    shard = 3 * sum(link.main.numel() for link in opt.links)  # exp_avg, exp_avg_sq, main_param
    full = 3 * sum(p.numel() for p in ddp.module.parameters())
    assert shard <= read < 0.75 * full, (shard, read, full)


# [1-gpt2] in the full tier: [2-llama] reads its slices the same way (under TP=2 too); GPT-2's tied
# embedding through the distributed optimizer's checkpoint: test_main_weights_follow_the_loaded_model_...
# below and test_distributed_optimizer.py::test_distributed_optimizer_state_is_sharded_and_portable[4].
@pytest.mark.parametrize("tp,style", [pytest.param(1, "gpt2", marks=pytest.mark.full), (2, "llama")])
def test_distributed_optimizer_loads_only_its_slices(tmp_path, tp, style):
    run_distributed(_body, 2 * tp, str(tmp_path), tp, style)


def _weights_only_body(rank: int, world_size: int, tmp: str) -> None:
    groups = groups_for(1)
    ddp, opt = _build(groups, "gpt2", seed=1)
    _train(groups, ddp, opt)
    save_checkpoint(2, [ddp], opt, None, CheckpointConfig(save=tmp), {}, {})
    saved = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    for flags in (dict(no_load_optim=True), dict(finetune=True)):
        fresh, fresh_opt = _build(groups, "gpt2", seed=7)
        load_checkpoint([fresh], fresh_opt, None, CheckpointConfig(load=tmp, no_load_rng=True, **flags))
        assert all(torch.equal(p, saved[n]) for n, p in fresh.module.named_parameters()), flags
        # the fp32 main weights are the loaded ones, not the fresh model's initial values
        assert all(torch.equal(link.main, link.model_data().float()) for link in fresh_opt.links), flags


def test_main_weights_follow_the_loaded_model_without_optimizer_state(tmp_path):
    run_distributed(_weights_only_body, 2, str(tmp_path))
