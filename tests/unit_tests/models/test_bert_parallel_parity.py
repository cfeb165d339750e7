"""BertModel under TP=2, TP=2 with sequence parallelism, and PP=2 equals the one-rank model.

The tested loss is the masked-LM loss (mean over the loss mask) plus the NSP cross entropy of the
binary head, so the pooler's first-token gather and the LM head are both under test. Each spawned
group builds a one-rank reference on every rank from the same seed (CPU initialization with an
initialization seed: the same weights for any layout, checked exactly) and compares the loss and
every parameter's gradient, TP shards gathered back to full tensors and pipeline-stage layers
renamed to their global numbers; with tied embeddings under PP the two stages' copies are summed
(``allreduce_embedding_grads``) and each must equal the reference's one weight. fp32; rtol=1e-5,
atol=1e-6 (only the order of float additions differs). The whole file runs in about 20 s.
"""

import re

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.distributed.finalize_model_grads import allreduce_embedding_grads, allreduce_sequence_parallel_grads
from megatron.core.models.bert import bert_layer_local_spec, bert_layer_post_ln_spec
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from tests.dist_harness import run_distributed
from tests.model_utils import bert_batch, bert_config, build_bert, gather_tp, single_rank_groups

RTOL, ATOL = 1e-5, 1e-6
SPECS = (("post_ln", bert_layer_post_ln_spec), ("pre_ln", bert_layer_local_spec))


def _loss_from_outputs(lm_loss, binary_logits, data):
    """Mean masked-LM loss plus the NSP cross entropy."""
    mask = data["loss_mask"]
    return (lm_loss * mask).sum() / mask.sum() + F.cross_entropy(binary_logits, data["nsp"])


def _forward(model, data):
    lm_loss, binary = model(data["tokens"], data["padding"], data["types"], lm_labels=data["labels"])
    return _loss_from_outputs(lm_loss, binary, data)


def _global_name(model, name: str) -> str:
    """``encoder.layers.<local>.`` -> ``encoder.layers.<global layer_number - 1>.``."""
    match = re.match(r"encoder\.layers\.(\d+)\.", name)
    if match is None:
        return name
    number = model.encoder.layers[int(match.group(1))].layer_number
    return f"encoder.layers.{number - 1}." + name[match.end() :]


def _full_tensors(model, tp_group, of_grad: bool):
    return {
        _global_name(model, n): gather_tp(p.grad if of_grad else p.data, p, tp_group)
        for n, p in model.named_parameters()
    }


def _reference(spec, data, **model_kwargs):
    groups = single_rank_groups()
    model = build_bert(groups, spec, **model_kwargs)
    loss = _forward(model, data)
    loss.backward()
    return loss.detach(), _full_tensors(model, groups.tp, True), _full_tensors(model, groups.tp, False)


def _assert_matches(where, loss, grads, weights, ref):
    ref_loss, ref_grads, ref_weights = ref
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} loss: {m}")
    assert set(grads) <= set(ref_grads) and grads, where
    for name in grads:
        torch.testing.assert_close(
            weights[name], ref_weights[name], rtol=0, atol=0, msg=lambda m: f"{where} {name}: {m}"
        )
        torch.testing.assert_close(
            grads[name], ref_grads[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} grad {name}: {m}"
        )


def _tp_body(rank, world_size):
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    data = bert_batch()
    for spec_name, spec in SPECS:
        ref = _reference(spec, data, share_embeddings_and_output_weights=True)
        for sp in (False, True):
            config = bert_config(groups, sequence_parallel=sp)
            model = build_bert(groups, spec, config=config, share_embeddings_and_output_weights=True)
            loss = _forward(model, data)
            loss.backward()
            allreduce_sequence_parallel_grads([model], groups.tp)
            grads, weights = _full_tensors(model, groups.tp, True), _full_tensors(model, groups.tp, False)
            assert set(grads) == set(ref[1])
            _assert_matches(f"{spec_name} tp={world_size} sp={sp}", loss.detach(), grads, weights, ref)


def _logits_body(rank, world_size):
    """Under TP=2 + SP: gathered logits (``parallel_output=False``), vocab-parallel logits, binary logits
    and return_embeddings equal the one-rank model's."""
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    data = bert_batch()
    args = (data["tokens"], data["padding"], data["types"])
    ref_logits, ref_binary = build_bert(single_rank_groups())(*args)  # [b, s, v], [b, 2]
    config = bert_config(groups, sequence_parallel=True)
    logits, binary = build_bert(groups, config=config, parallel_output=False)(*args)
    torch.testing.assert_close(logits, ref_logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(binary, ref_binary, rtol=RTOL, atol=ATOL)
    local, _ = build_bert(groups, config=config)(*args)  # [b, s, v/tp]
    chunk = ref_logits.shape[-1] // world_size
    torch.testing.assert_close(local, ref_logits[..., rank * chunk : (rank + 1) * chunk], rtol=RTOL, atol=ATOL)
    # return_embeddings gathers the sequence shards under SP before averaging.
    ref_means = build_bert(single_rank_groups(), return_embeddings=True)(*args)  # [b, h]
    means = build_bert(groups, config=config, return_embeddings=True)(*args)
    torch.testing.assert_close(means, ref_means, rtol=RTOL, atol=ATOL)


def _pipeline_step(model, data, first: bool, shape):
    """One forward/backward over two stages with point-to-point send/recv; the loss on the last stage."""
    if first:
        hidden = model(data["tokens"], data["padding"], data["types"])  # [s, b, h]
        dist.send(hidden.detach().contiguous(), dst=1)
        grad = torch.empty(hidden.shape)
        dist.recv(grad, src=1)
        hidden.backward(grad)
        return None
    received = torch.empty(shape)
    dist.recv(received, src=0)
    received.requires_grad_(True)
    model.set_input_tensor(received)
    loss = _forward(model, data)
    loss.backward()
    dist.send(received.grad.contiguous(), dst=0)
    return loss.detach()


def _tie_across_stages(model, rank: int) -> None:
    """The training code's start: the last stage's output weight is a copy of the first stage's embedding."""
    weight = model.shared_embedding_or_output_weight()
    dist.broadcast(weight.data, src=0)


def _pp_body(rank, world_size):
    groups = build_process_groups(ParallelLayout(world_size=world_size, pipeline_model_parallel_size=world_size))
    data = bert_batch()
    shape = (data["tokens"].shape[1], data["tokens"].shape[0], bert_config(groups).hidden_size)  # [s, b, h]
    for (spec_name, spec), tied in [(named, tied) for named in SPECS for tied in (False, True)]:
        ref = _reference(spec, data, share_embeddings_and_output_weights=tied)
        model = build_bert(
            groups, spec, pre_process=rank == 0, post_process=rank == 1, share_embeddings_and_output_weights=tied
        )
        if tied:
            _tie_across_stages(model, rank)
        loss = _pipeline_step(model, data, rank == 0, shape)
        allreduce_embedding_grads([model], groups)
        grads, weights = _full_tensors(model, groups.tp, True), _full_tensors(model, groups.tp, False)
        if tied and rank == 1:  # the tied copy is compared with the reference's one weight
            for table in (grads, weights):
                table["embedding.word_embeddings.weight"] = table.pop("output_layer.weight")
        where = f"{spec_name} tied={tied} pp={world_size} rank={rank}"
        _assert_matches(where, ref[0] if loss is None else loss, grads, weights, ref)
        # Together the two stages hold every parameter of the reference.
        names = [None, None]
        dist.all_gather_object(names, sorted(grads))
        assert set(names[0]) | set(names[1]) == set(ref[1]), where


def test_bert_tensor_and_sequence_parallel_equal_single_rank():
    run_distributed(_tp_body, 2)


def test_bert_gathered_logits_equal_single_rank():
    run_distributed(_logits_body, 2)


def test_bert_pipeline_parallel_equals_single_rank():
    run_distributed(_pp_body, 2)
