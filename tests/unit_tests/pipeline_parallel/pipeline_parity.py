"""Helpers for pipeline parity tests: build stage chunks, load reference weights, train, compare.

The reference is the PP=1, TP=1 model built on every rank from the same seed. Stage chunks
get the reference weights by global layer number (``decoder.layers.{i}`` of a chunk is
reference layer ``layer_number - 1``), sliced to this rank's TP shard.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from megatron.core.models import GPTModel
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import stage_hidden_size
from megatron.core.pipeline_parallel.tied_embeddings import allreduce_tied_embedding_grads, sync_tied_embeddings
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from tests.model_utils import SEQ, batch, build_gpt, single_rank_groups

MICRO = 2
LR = 0.1


def build_chunks(
    kwargs: Dict, groups: ProcessGroupCollection, vp: int, chunk_extra: Optional[Dict] = None
) -> List[GPTModel]:
    """This rank's model chunks (one per virtual stage), pre/post-process on the end stages.

    ``chunk_extra``: config fields for the stage chunks only (not the PP=1 reference), e.g. a layout.
    """
    pp, rank = groups.size_of("pp"), groups.rank_in("pp")
    extra = {"virtual_pipeline_model_parallel_size": vp} if vp > 1 else {}
    extra.update(chunk_extra or {})
    return [
        build_gpt(
            kwargs,
            groups,
            seed=99,
            pre_process=rank == 0 and c == 0,
            post_process=rank == pp - 1 and c == vp - 1,
            vp_stage=c,
            **extra,
        )
        for c in range(vp)
    ]


def reference_name(chunk: GPTModel, name: str) -> str:
    """The reference parameter name of ``name`` in ``chunk`` (global layer numbering)."""
    if name.startswith("decoder.layers."):
        local, rest = name[len("decoder.layers.") :].split(".", 1)
        return f"decoder.layers.{chunk.decoder.layers[int(local)].layer_number - 1}.{rest}"
    if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return name


def tp_shard(full: torch.Tensor, param: torch.nn.Parameter, groups: ProcessGroupCollection) -> torch.Tensor:
    """This rank's TP shard of a full reference tensor (stride aware)."""
    world = groups.size_of("tp")
    if world == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, param.partition_stride
    blocks = torch.split(full, full.shape[dim] // (stride * world), dim=dim)
    return torch.cat(blocks[groups.rank_in("tp") :: world], dim=dim)


def load_reference(chunks: List[GPTModel], reference: GPTModel, groups: ProcessGroupCollection) -> None:
    ref = dict(reference.named_parameters())
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                param.copy_(tp_shard(ref[reference_name(chunk, name)], param, groups))


def compare(
    chunks: List[GPTModel],
    reference: GPTModel,
    groups: ProcessGroupCollection,
    what: str,
    rtol: float,
    atol: float,
    grads: bool,
) -> None:
    ref = dict(reference.named_parameters())
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            full = ref[reference_name(chunk, name)]
            mine, expected = (param.grad, full.grad) if grads else (param.data, full.data)
            torch.testing.assert_close(
                mine,
                tp_shard(expected, param, groups),
                rtol=rtol,
                atol=atol,
                msg=lambda m: f"{what} {'grad' if grads else 'weight'} {name}: {m}",
            )


def _loss_func(output: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Dict]:
    total = output.sum()  # output: per-token loss [b, s]
    tokens = torch.tensor(output.numel())
    return total, tokens, {"lm loss": torch.stack([total.detach(), tokens.float()])}


_STAGE_OUTPUTS: List[torch.Tensor] = []  # what non-last chunks returned (and the schedule sent)


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    output = model(tokens, None, None, labels=labels)
    if not model.post_process:
        _STAGE_OUTPUTS.append(output)
    return output, _loss_func


def check_released(chunks: List[GPTModel], what: str) -> None:
    """Sent stage outputs hold one element with ``deallocate_pipeline_outputs``, all of [s, b, h] without
    (``[s, b, n * h]`` with ``n`` hyper-connection streams)."""
    sizes = {t.numel() for t in _STAGE_OUTPUTS}
    _STAGE_OUTPUTS.clear()
    if not sizes:
        return
    config = chunks[0].config
    seq = SEQ // config.tensor_model_parallel_size if config.sequence_parallel else SEQ
    expected = {1} if config.deallocate_pipeline_outputs else {seq * MICRO * stage_hidden_size(config)}
    assert sizes == expected, f"{what}: sent stage outputs have {sorted(sizes)} elements, expected {expected}"


def make_finalize(groups: ProcessGroupCollection) -> Callable:
    """What finalize_model_grads must do for these tests: SP, tied-embedding and DP reductions."""

    def finalize(chunks: List[torch.nn.Module], num_tokens) -> None:
        allreduce_sequence_parallel_grads(chunks, groups.tp)
        allreduce_tied_embedding_grads(chunks, groups)
        dp = groups.size_of("dp")
        for chunk in chunks:
            for p in chunk.parameters():
                if p.grad is not None and dp > 1:
                    dist.all_reduce(p.grad, group=groups.dp)
                    p.grad /= dp

    return finalize


def run_pipeline(
    chunks,
    groups,
    tokens,
    labels,
    num_mb: int,
    forward_only: bool = False,
    forward_step_func: Optional[Callable] = None,
):
    """One schedule call on this DP rank's slice of the global batch; returns the mean loss (last stage).

    ``forward_step_func`` defaults to one that records the stage outputs for ``check_released``.
    """
    dp_rank, rows = groups.rank_in("dp"), MICRO * num_mb
    tokens, labels = tokens[dp_rank * rows : (dp_rank + 1) * rows], labels[dp_rank * rows : (dp_rank + 1) * rows]
    micro = [(tokens[i : i + MICRO], labels[i : i + MICRO]) for i in range(0, rows, MICRO)]
    func = get_forward_backward_func(groups.size_of("pp"), len(chunks))
    reports = func(
        forward_step_func=forward_step_func or _forward_step,
        data_iterator=[iter(micro) for _ in chunks],
        model=chunks,
        num_microbatches=num_mb,
        seq_length=SEQ,
        micro_batch_size=MICRO,
        forward_only=forward_only,
        pg_collection=groups,
    )
    if not reports:
        return None
    summed = torch.stack([r["lm loss"] for r in reports]).sum(0)
    loss = summed[0] / summed[1]
    if groups.size_of("dp") > 1:
        dist.all_reduce(loss, group=groups.dp)
        loss /= groups.size_of("dp")
    return loss


def reference_loss_backward(
    reference: GPTModel, tokens: torch.Tensor, labels: torch.Tensor, num_micro: int
) -> torch.Tensor:
    """Back-propagate the reference's mean loss; returns it.

    With MoE (or multi-token prediction) the aux (MTP) losses depend on which tokens are routed
    (averaged) together, so the reference runs the pipeline's ``num_micro`` microbatches one by one,
    each weighted 1/num_micro like the schedule weights them (main loss and aux losses alike).
    """
    if not (reference.config.num_moe_experts or reference.config.mtp_num_layers):
        loss = reference(tokens, None, None, labels=labels).mean()
        loss.backward()
        return loss.detach()
    MoEAuxLossAutoScaler.set_loss_scale(1.0 / num_micro)
    total = torch.zeros(())
    for i in range(0, tokens.shape[0], MICRO):
        loss = reference(tokens[i : i + MICRO], None, None, labels=labels[i : i + MICRO]).mean() / num_micro
        loss.backward()
        total += loss.detach()
    return total


def check_parity(
    kwargs: Dict,
    groups: ProcessGroupCollection,
    vp: int,
    num_mb: int,
    what: str,
    iterations: int = 3,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    chunk_extra: Optional[Dict] = None,
) -> None:
    """Train the stage chunks and the PP=1 reference side by side; compare loss, grads, weights."""
    reference = build_gpt(kwargs, single_rank_groups(), seed=7)
    chunks = build_chunks(kwargs, groups, vp, chunk_extra)
    load_reference(chunks, reference, groups)
    sync_tied_embeddings(chunks, groups)  # no-op here (weights loaded), exercised for the call pattern
    compare(chunks, reference, groups, what + " initial", 0, 0, grads=False)
    for chunk in chunks:
        chunk.config.finalize_model_grads_func = make_finalize(groups)
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for it in range(iterations):
        tokens, labels = batch(seed=it, b=MICRO * num_mb * groups.size_of("dp"))
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        _STAGE_OUTPUTS.clear()
        loss = run_pipeline(chunks, groups, tokens, labels, num_mb)
        check_released(chunks, f"{what} iteration {it}")
        ref_loss = reference_loss_backward(reference, tokens, labels, num_mb * groups.size_of("dp"))
        if loss is not None:
            torch.testing.assert_close(
                loss, ref_loss.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{what} iteration {it} loss: {m}"
            )
        compare(chunks, reference, groups, f"{what} iteration {it}", rtol, atol, grads=True)
        opt.step()
        ref_opt.step()
    compare(chunks, reference, groups, what + " after steps", rtol, atol, grads=False)
    tokens, labels = batch(seed=100, b=MICRO * num_mb * groups.size_of("dp"))
    with torch.no_grad():
        loss = run_pipeline(chunks, groups, tokens, labels, num_mb, forward_only=True)
        ref_loss = reference(tokens, None, None, labels=labels).mean()
    if loss is not None:
        torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol, msg=lambda m: f"{what} eval loss: {m}")
