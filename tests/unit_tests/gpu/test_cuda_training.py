"""On a real GPU (skipped without one): a tiny MoE GPT trained in fp16 through the schedule on a
one-rank NCCL group; the host syncs of an optimizer step are counted with CUDA's sync debug mode,
and the optimizer state is resumed from CPU tensors (as a checkpoint loads it) into a fresh run.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.model_utils import SEQ, batch, build_gpt, gpt2_style

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01)


def _build(groups) -> Tuple[torch.nn.Module, DistributedDataParallel, object]:
    model = build_gpt(
        gpt2_style(hidden_dropout=0.1, attention_dropout=0.1, fp16=True, params_dtype=torch.float16, **MOE), groups
    ).cuda()
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model, pg_collection=groups
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            lr=1e-3,
            fp16=True,
            params_dtype=torch.float16,
            clip_grad=1.0,
            initial_loss_scale=2.0**12,
            log_num_zeros_in_grad=True,
        ),
        [ddp],
        pg_collection=groups,
    )
    model.config.grad_scale_func = opt.scale_loss
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = lambda chunks, tokens: finalize_model_grads(chunks, tokens, groups)
    return model, ddp, opt


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    losses = model(tokens, None, None, labels=labels)  # [b, s]
    mask = torch.ones_like(losses, dtype=torch.float32)

    def loss_func(output: torch.Tensor):
        return (output.float() * mask).sum(), mask.sum().int(), {}

    return losses, loss_func


def _step(ddp, opt, seed: int) -> Tuple[bool, List[str]]:
    """One iteration of two microbatches; returns (updated, sync warnings raised by opt.step)."""
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    data = iter([tuple(t.cuda() for t in batch(seed=seed + i)) for i in range(2)])
    ddp.zero_grad_buffer()
    opt.zero_grad()
    torch.cuda.synchronize()
    schedule_syncs = _syncs(
        lambda: forward_backward_no_pipelining(
            forward_step_func=_forward_step,
            data_iterator=data,
            model=[ddp],
            num_microbatches=2,
            seq_length=SEQ,
            micro_batch_size=2,
        )
    )
    print(f"  forward/backward of 2 microbatches: {len(schedule_syncs)} host syncs")
    updated: List[bool] = []
    step_syncs = _syncs(lambda: updated.append(opt.step()[0]))
    return updated[0], step_syncs


def _syncs(work) -> List[str]:
    """The synchronizing CUDA operations ``work()`` performs (CUDA's sync debug mode)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            work()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]


def _weights(model) -> Dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_fp16_moe_gpt_trains_counts_syncs_and_resumes(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        groups = ps.initialize_model_parallel()
        model, ddp, opt = _build(groups)
        for it in range(3):
            ok, syncs = _step(ddp, opt, it)
            print(f"step {it}: updated={ok} host syncs in opt.step: {len(syncs)} {syncs}")
            assert ok and len(syncs) <= 3, syncs  # found-inf, grad norm, zero count
        state = opt.state_dict_by_param_name([ddp])
        names = [name for name, _ in model.named_parameters()]
        assert all(t.device.type == "cpu" for name in names for t in state[name].values())
        resumed_model, resumed_ddp, resumed_opt = _build(groups)
        resumed_model.load_state_dict(model.state_dict())
        resumed_opt.load_state_dict_by_param_name([resumed_ddp], state)
        for main in (p for g in resumed_opt.optimizer.param_groups for p in g["params"]):
            assert all(t.device == main.device for t in resumed_opt.optimizer.state[main].values())
        assert _step(ddp, opt, 9)[0] and _step(resumed_ddp, resumed_opt, 9)[0]
        for (name, a), b in zip(_weights(model).items(), _weights(resumed_model).values()):
            assert torch.equal(a, b), name
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
