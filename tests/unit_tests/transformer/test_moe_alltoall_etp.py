"""The all-to-all token dispatcher and expert tensor parallelism different from TP.

* ``all_to_all`` with uneven per-rank split sizes: forward rows and the backward (the reverse
  all-to-all of a random output gradient) equal a single-process reference built from every
  rank's inputs.
* A Mixtral-style GPT (SwiGLU experts, top-2 softmax routing, one MoE and one dense layer) on 4
  gloo ranks: under EP=2 (TP=1), EP=2 x TP=2 with SP, ETP=1 with TP=2 + SP and EP=2, and ETP=2
  with TP=1, with the ``alltoall`` and the ``allgather`` dispatcher, the loss and
  every gradient (DDP-reduced, expert shards gathered over expert-TP) equal one rank computing
  the whole batch (rtol 1e-5; z-loss only: the Switch balance loss is not additive over
  data-parallel shards). With the balance loss on too, ``alltoall`` equals ``allgather`` in the
  same layout.
* A DeepSeek-V3-style GPT (MLA, gated shared experts, sigmoid group-limited routing with expert
  bias, grouped experts, one MTP module) in Megatron's DeepSeek layout at toy size (TP=2 with SP,
  EP=2, ETP=1, all-to-all): loss and every gradient equal one rank (rtol 1e-5).
"""

from __future__ import annotations

from typing import Dict, Tuple

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import all_to_all, checkpoint
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import MoEAuxLossAutoScaler, MoELayer
from megatron.core.transformer.moe.token_dispatcher import AllGatherDispatcher, AllToAllDispatcher
from megatron.training.theoretical_memory_params import LanguageModelShape, RankPosition, chunk_parameters
from tests.dist_harness import run_distributed
from tests.model_utils import (
    SEQ,
    VOCAB,
    build_gpt,
    deepseek_style,
    single_rank_groups,
)
from tests.unit_tests.distributed import dp_training as dpt
from tests.unit_tests.transformer.test_moe_expert_parallel import WITH_AUX, Z_ONLY, E, _compare, _groups, global_name
from tests.unit_tests.transformer.test_moe_expert_parallel import _kwargs as ep_kwargs
from tests.unit_tests.transformer.test_moe_expert_parallel import _one_step as ep_one_step

RTOL, ATOL, WEIGHT_RTOL = 1e-5, 1e-6, 1e-6
GLOBAL_BATCH = 4


# ----------------------------------------------------------------------------------
# all_to_all with uneven split sizes: forward and backward against a reference.
# ----------------------------------------------------------------------------------
def _sizes(src: int, dst: int) -> int:
    """Rows rank ``src`` sends to rank ``dst`` (uneven, zero included)."""
    return (src * 3 + dst * 2) % 4


def _rows(rank: int, world: int) -> torch.Tensor:
    total = sum(_sizes(rank, d) for d in range(world))
    return torch.randn(total, 3, generator=torch.Generator().manual_seed(10 + rank))  # [sum_d n(rank, d), 3]


def _output_weight(rank: int, world: int = 3) -> torch.Tensor:
    """A random weight on rank ``rank``'s received rows (so the backward carries distinct rows)."""
    rows = sum(_sizes(s, rank) for s in range(world))
    return torch.randn(rows, 3, generator=torch.Generator().manual_seed(50 + rank))


def _all_to_all_body(rank, world_size):
    group = dist.group.WORLD
    sent = _rows(rank, world_size).requires_grad_(True)
    send = [_sizes(rank, d) for d in range(world_size)]
    recv = [_sizes(s, rank) for s in range(world_size)]
    received = all_to_all(group, sent, recv, send)  # [sum_s n(s, rank), 3]
    # Reference: block ``rank`` of every source's rows, in source order.
    blocks = [_rows(s, world_size).split([_sizes(s, d) for d in range(world_size)]) for s in range(world_size)]
    torch.testing.assert_close(received, torch.cat([b[rank] for b in blocks]), rtol=0, atol=0)
    weight = _output_weight
    (received * weight(rank)).sum().backward()
    # d/d sent[block d] = rows of rank d's output weight that came from this rank.
    expected = []
    for d in range(world_size):
        start = sum(_sizes(s, d) for s in range(rank))
        expected.append(weight(d)[start : start + _sizes(rank, d)])
    torch.testing.assert_close(sent.grad, torch.cat(expected), rtol=0, atol=0)
    return received.shape[0]


def test_all_to_all_uneven_splits_forward_and_backward_equal_reference():
    assert sum(run_distributed(_all_to_all_body, 3)) == sum(_sizes(s, d) for s in range(3) for d in range(3))


# ----------------------------------------------------------------------------------
# A Mixtral-style MoE layer: both dispatchers against one rank, and against each other.
# ----------------------------------------------------------------------------------
def _layer(groups: ProcessGroupCollection, kind: str, sp: bool) -> MoELayer:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=E,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=kind,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        sequence_parallel=sp,
        tensor_model_parallel_size=groups.size_of("tp"),
        expert_model_parallel_size=groups.size_of("ep"),
        expert_tensor_parallel_size=groups.size_of("expt_tp"),
    )
    torch.manual_seed(7)
    return MoELayer(config, pg_collection=groups)


class _CountAllToAll:
    """Counts ``dist.all_to_all_single`` calls inside the block (the all-to-all dispatcher must make them)."""

    def __enter__(self):
        self.calls, self.original = 0, dist.all_to_all_single

        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self.original


class _CountHostReads:
    """Counts what would make a GPU wait for the host or the host for the GPU inside the block:
    ``tolist``, ``item``, ``cpu`` and tensors built from Python data (``torch.tensor``)."""

    NAMES = ("tolist", "item", "cpu")

    def __enter__(self):
        self.calls, self.saved = [], {name: getattr(torch.Tensor, name) for name in self.NAMES}
        self.saved_tensor = torch.tensor
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, self._counted(name, original))
        torch.tensor = self._counted("torch.tensor", self.saved_tensor)
        return self

    def _counted(self, name, original):
        def counted(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)
        torch.tensor = self.saved_tensor


def _run_layer(
    layer: MoELayer, x: torch.Tensor, grad: torch.Tensor, sp: bool, tp_rank: int, tp: int, recompute: bool = False
):
    """Output, input gradient and parameter gradients of this rank (its sequence shard under SP);
    ``recompute``: the layer under activation checkpointing (rerun in backward)."""
    rows = slice(tp_rank * x.shape[0] // tp, (tp_rank + 1) * x.shape[0] // tp) if sp else slice(None)
    mine = x[rows].clone().requires_grad_(True)  # [s(/tp), b, h]
    out = checkpoint(lambda h: layer(h)[0], False, mine) if recompute else layer(mine)[0]
    out.backward(grad[rows])
    return out.detach(), mine.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _layer_body(rank, world_size, layouts):
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(1))  # [s, b, h]
    grad = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(2))
    calls = {}
    for tp, ep, etp, sp, s in layouts:
        groups, where = _groups(tp, ep, etp), f"tp={tp} ep={ep} etp={etp} sp={sp} s={s}"
        rows = slice(groups.rank_in("tp") * s // tp, (groups.rank_in("tp") + 1) * s // tp) if sp else slice(None)
        results = {}
        small_ref = _run_layer(_layer(single_rank_groups(), "allgather", False), x[:s], grad[:s], False, 0, 1)
        for kind in ("alltoall", "allgather", "alltoall-recompute"):
            layer = _layer(groups, kind.split("-")[0], sp)
            with _CountAllToAll() as counter, _CountHostReads() as reads:
                results[kind] = _run_layer(layer, x[:s], grad[:s], sp, groups.rank_in("tp"), tp, "-" in kind)
            calls[(where, kind)] = (counter.calls, reads.calls)
            assert not layer.token_dispatcher.__dict__.get("replay"), f"{where} {kind}: sizes kept after backward"
            if "-" in kind:  # a checkpointed forward without a backward (evaluation) keeps nothing to replay
                with torch.no_grad():
                    checkpoint(lambda h: layer(h)[0], False, x[:s].clone().requires_grad_(True))
                assert not layer.token_dispatcher.replay, f"{where}: sizes kept for a forward without backward"
            out, dx, _ = results[kind]
            torch.testing.assert_close(
                out, small_ref[0][rows], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} {kind} out {m}"
            )
            torch.testing.assert_close(
                dx, small_ref[1][rows], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} {kind} dx {m}"
            )
        for name, g in results["alltoall"][2].items():
            for other in ("allgather", "alltoall-recompute"):
                torch.testing.assert_close(
                    g, results[other][2][name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} {other} {name} {m}"
                )
    return calls


# (tp, ep, etp, sequence_parallel, s): EP=4; EP=2 x TP=2 with SP; ETP=1 with TP=2 + SP and EP=2; ETP=2
# with TP=1.
LAYER_LAYOUTS = [(1, 4, 1, False, 6), (2, 2, 2, True, 6), (2, 2, 1, True, 6), (1, 2, 2, False, 6)]


def test_moe_layer_dispatchers_equal_one_rank_and_each_other():
    """Also: one host read per layer, forward and backward together (alltoall: the split sizes, in one
    ``tolist``; allgather: the experts' counts), and none more when the layer is recomputed."""
    for calls in run_distributed(_layer_body, 4, LAYER_LAYOUTS):
        for (where, kind), (count, reads) in calls.items():
            # Forward: tokens and probs; backward: their reverse all-to-alls; allgather: none.
            assert (count >= 4) if kind.startswith("alltoall") else (count == 0), (where, kind, count)
            assert reads == ["tolist"], (where, kind, reads)


# ----------------------------------------------------------------------------------
# Tiny GPT with MoE: layouts and dispatchers against one rank.
# ----------------------------------------------------------------------------------
def _kwargs(moe: Dict, dispatcher: str, **extra) -> Dict:
    return ep_kwargs(moe, moe_token_dispatcher_type=dispatcher, **extra)


def _one_step(kwargs: Dict, groups: ProcessGroupCollection) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """This DP rank's share of the global batch, DDP reduction: (global mean loss, full grads by global name)."""
    return ep_one_step(kwargs, groups, GLOBAL_BATCH)


# (tp, ep, etp, sequence_parallel) on 4 ranks.
LAYOUTS = [(1, 2, 1, False), (2, 2, 2, True), (2, 2, 1, True), (1, 2, 2, False)]


def _layouts_body(rank, world_size, layouts):
    MoEAuxLossAutoScaler.set_loss_scale(1.0)
    single = _one_step(_kwargs(Z_ONLY, "allgather"), single_rank_groups())
    worst = 0.0
    for tp, ep, etp, sp in layouts:
        groups = _groups(tp, ep, etp)
        extra = dict(sequence_parallel=True) if sp else {}
        where = f"tp={tp} ep={ep} etp={etp} sp={sp}"
        for kind in ("alltoall", "allgather"):
            got = _one_step(_kwargs(Z_ONLY, kind, **extra), groups)
            worst = max(worst, _compare(f"{where} {kind} vs one rank", got, single))
        aux = [_one_step(_kwargs(WITH_AUX, kind, **extra), groups) for kind in ("alltoall", "allgather")]
        worst = max(worst, _compare(f"{where} aux-loss alltoall vs allgather", *aux))
    return max(worst, _deepseek_etp1(DEEPSEEK_LAYOUT))


# A DeepSeek-V3-style model (MLA, gated shared experts, sigmoid group-limited routing with expert bias,
# grouped experts, one MTP module) with Megatron's DeepSeek layout at toy size: TP=2 with SP, EP=2, ETP=1.
DEEPSEEK = dict(num_moe_experts=E, moe_router_topk=2, moe_router_num_groups=2, moe_router_group_topk=1)
DEEPSEEK.update(moe_shared_expert_gate=True, moe_router_dtype="fp32", mtp_num_layers=1, moe_grouped_gemm=True)
DEEPSEEK_LAYOUT = (2, 2, 1, True)


def _deepseek_etp1(layout: Tuple[int, int, int, bool]) -> float:
    tp, ep, etp, sp = layout
    single = _one_step(deepseek_style(**DEEPSEEK), single_rank_groups())
    kw = deepseek_style(**DEEPSEEK, sequence_parallel=sp, moe_token_dispatcher_type="alltoall")
    return _compare(
        f"deepseek-style tp={tp} ep={ep} etp={etp} sp={sp} alltoall", _one_step(kw, _groups(tp, ep, etp)), single
    )


def test_alltoall_and_etp_layouts_equal_one_rank():
    assert max(run_distributed(_layouts_body, 4, LAYOUTS)) < 1e-5


def _dispatcher_kinds_body(rank, world_size):
    """The MoE layer picks its dispatcher from the config, and the expert grid differs from TP's."""
    groups = _groups(2, 2, 1)
    model = build_gpt(_kwargs(Z_ONLY, "alltoall"), groups)
    moe = model.decoder.layers[0].mlp
    assert isinstance(moe.token_dispatcher, AllToAllDispatcher), type(moe.token_dispatcher)
    other = build_gpt(_kwargs(Z_ONLY, "allgather"), groups)
    assert isinstance(other.decoder.layers[0].mlp.token_dispatcher, AllGatherDispatcher)
    # ETP=1 with TP=2: experts whole on every rank, the expert-TP group is the rank alone.
    assert groups.size_of("expt_tp") == 1 and groups.ranks["tp"] == [rank - rank % 2, rank - rank % 2 + 1]
    fc1 = moe.experts.local_experts[0].linear_fc1.weight
    assert fc1.shape[0] == 2 * Z_ONLY["moe_ffn_hidden_size"], fc1.shape  # gate + up, unsplit
    # The memory accounting names the built parameters with their expert-TP (unsplit) sizes.
    lm = LanguageModelShape(VOCAB, SEQ, "rope", share_embeddings_and_output_weights=False)
    derived = [(e.name, e.numel) for e in chunk_parameters(model.config, lm, RankPosition(tp=2, dp=2, ep=2, etp=1), 0)]
    assert derived == [(n, p.numel()) for n, p in model.named_parameters()]
    assert RankPosition(tp=2, dp=2, ep=2, etp=1).expt_dp == 2
    # Megatron's facade getters read the expert grid of initialize_model_parallel.
    ps.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
    )
    try:
        assert ps.get_expert_tensor_parallel_world_size() == 1 and ps.get_expert_tensor_parallel_rank() == 0
        assert dist.get_process_group_ranks(ps.get_expert_tensor_parallel_group()) == [rank]
        assert ps.get_expert_data_parallel_world_size() == 2 and ps.get_tensor_model_parallel_world_size() == 2
        assert dist.get_process_group_ranks(ps.get_expert_data_parallel_group()) == groups.ranks["expt_dp"]
    finally:
        ps.destroy_model_parallel()
    return groups.ranks["ep"], groups.ranks["expt_dp"]


def test_layer_builds_the_configured_dispatcher_on_the_expert_grid():
    results = run_distributed(_dispatcher_kinds_body, 4)
    # Expert grid ETP=1 x EP=2 x expert-DP=2: EP neighbours, expert-DP strided by EP.
    assert [r[0] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[1] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


# ----------------------------------------------------------------------------------
# Training: DDP and the distributed optimizer with expert-DP (2) != DP, clipping on.
# ----------------------------------------------------------------------------------
TRAIN_VARIANTS = {
    "plain": ({}, {}),
    "distopt_overlap": (
        dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=2000),
        dict(use_distributed_optimizer=True, overlap_param_gather=True),
    ),
}


def _training_body(rank, world_size, tp, ep, etp, sp):
    groups = _groups(tp, ep, etp)
    assert groups.size_of("expt_dp") == 4 // (ep * etp) and groups.size_of("dp") == 4 // tp
    kwargs = _kwargs(Z_ONLY, "alltoall", **(dict(sequence_parallel=True) if sp else {}))
    global_batch = dpt.MICRO_BATCH * dpt.NUM_MICRO * groups.size_of("dp")
    MoEAuxLossAutoScaler.set_loss_scale(1.0)  # the reference: one backward of the global mean
    ref_losses, ref_norms, ref_weights = dpt.reference_run(_kwargs(Z_ONLY, "allgather"), global_batch)
    assert min(ref_norms) > dpt.CLIP, "clipping must be active"
    worst = 0.0
    for name, (ddp_kw, opt_kw) in TRAIN_VARIANTS.items():
        MoEAuxLossAutoScaler.set_loss_scale(1.0 / dpt.NUM_MICRO)  # what forward_step sets
        losses, norms, weights, _, _ = dpt.parallel_run(groups, kwargs, ddp_kw, opt_kw)
        weights = {global_name(n, groups): w for n, w in weights.items()}
        ref = (ref_losses, ref_norms, {n: ref_weights[n] for n in weights})  # this rank's experts
        dpt.assert_matches(f"tp={tp} etp={etp} {name}", (losses, norms, weights), ref, WEIGHT_RTOL)
        worst = max([worst] + [dpt.relative_error(w, ref_weights[n]) for n, w in weights.items()])
    return worst


@pytest.mark.parametrize(
    "tp,ep,etp,sp",
    [(2, 2, 1, True), (2, 1, 1, True), (1, 1, 2, False)],  # expert-DP: 2 (= DP), 4 (DP 2), 2 (DP 4)
)
def test_etp_alltoall_training_with_distributed_optimizer_equals_single_rank(tp, ep, etp, sp):
    assert max(run_distributed(_training_body, 4, tp, ep, etp, sp)) <= WEIGHT_RTOL
