"""T5Model under TP=2 and TP=2 with sequence parallelism equals the one-rank model.

Both layouts are tested: T5 v1.1 (RMSNorm, gated GeLU, relative position bias split over TP by
heads, untied head) and Megatron's local spec (LayerNorm, biases, learned positions, tied head with
bias). Each spawned group builds a one-rank reference on every rank from the same initialization
seed (the same weights for any layout, checked exactly) and compares the loss (mean over the decoder
padding) and every parameter's gradient, TP shards gathered back to full tensors; also full and
selective recomputation (the encoder output and the bias enter the checkpoints as inputs), and the gathered
and vocab-parallel logits under TP=2+SP. fp32; rtol=1e-5, atol=1e-6.
"""

import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from megatron.core.models.T5 import t5_padding_attention_masks
from tests.dist_harness import run_distributed
from tests.model_utils import build_t5, gather_tp, single_rank_groups, t5_batch, t5_config

RTOL, ATOL = 1e-5, 1e-6


def _inputs(data):
    return (data["enc"], data["dec"], *t5_padding_attention_masks(data["enc_pad"], data["dec_pad"]))


def _loss(model, data):
    loss = model(*_inputs(data), lm_labels=data["labels"])  # [b, s_dec]
    return (loss * data["loss_mask"]).sum() / data["loss_mask"].sum()


def _full(model, tp_group, of_grad: bool):
    return {n: gather_tp(p.grad if of_grad else p.data, p, tp_group) for n, p in model.named_parameters()}


def _run(model, data, tp_group):
    loss = _loss(model, data)
    loss.backward()
    allreduce_sequence_parallel_grads([model], tp_group)
    return loss.detach(), _full(model, tp_group, True), _full(model, tp_group, False)


def _assert_matches(where, got, ref):
    (loss, grads, weights), (ref_loss, ref_grads, ref_weights) = got, ref
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} loss: {m}")
    assert set(grads) == set(ref_grads), where
    for name in grads:
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=0, atol=0, msg=lambda m: f"{where} {name}")
        assert grads[name] is not None and grads[name].abs().sum() > 0, f"{where}: no gradient for {name}"
        torch.testing.assert_close(
            grads[name], ref_grads[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} grad {name}: {m}"
        )


def _tp_body(rank, world_size):
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    data = t5_batch()
    for v11 in (True, False):
        alone = single_rank_groups()
        ref = _run(build_t5(alone, v11), data, alone.tp)
        full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        for sp, recompute in ((False, {}), (True, {}), (True, full), (False, {"recompute_granularity": "selective"})):
            config = t5_config(groups, v11, sequence_parallel=sp, **recompute)
            model = build_t5(groups, v11, config=config)
            where = f"v11={v11} tp={world_size} sp={sp} recompute={recompute.get('recompute_granularity')}"
            _assert_matches(where, _run(model, data, groups.tp), ref)


def _logits_body(rank, world_size):
    """Under TP=2 + SP: gathered logits (``parallel_output=False``) and this rank's vocabulary slice."""
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    data = t5_batch()
    with torch.no_grad():
        ref = build_t5(single_rank_groups())(*_inputs(data))  # [b, s_dec, vocab]
        config = t5_config(groups, sequence_parallel=True)
        gathered = build_t5(groups, config=config, parallel_output=False)(*_inputs(data))
        torch.testing.assert_close(gathered, ref, rtol=RTOL, atol=ATOL)
        local = build_t5(groups, config=config)(*_inputs(data))  # [b, s_dec, vocab/tp]
        chunk = ref.shape[-1] // world_size
        torch.testing.assert_close(local, ref[..., rank * chunk : (rank + 1) * chunk], rtol=RTOL, atol=ATOL)


def test_t5_tensor_and_sequence_parallel_equal_single_rank():
    run_distributed(_tp_body, 2)


def test_t5_gathered_logits_equal_single_rank():
    run_distributed(_logits_body, 2)
