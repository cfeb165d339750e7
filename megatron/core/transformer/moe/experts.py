"""The local experts, each an ``MLP`` (``is_expert=True``) on the tokens routed to it: run one after
another (``SequentialMLP``) or, with ``moe_grouped_gemm``, as one grouped GEMM per projection
over all of them (``GroupedMLP``, the same parameters)."""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.transformer.mlp import MLP, apply_activation
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

GROUPED_MM_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# CUDA's grouped GEMM (CUTLASS with TMA loads) needs every group of the token dimension to start on a
# 16-byte boundary: the weight-gradient GEMM contracts over tokens, group by group, so each expert's
# row count is padded to a multiple of 16 bytes / element size (8 rows in bf16, 4 in fp32).
GROUP_ALIGN_BYTES = 16


def group_alignment(dtype: torch.dtype) -> int:
    """Rows each expert's group is padded to a multiple of for ``torch._grouped_mm`` in ``dtype``."""
    return max(1, GROUP_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())


class GroupedLinear(torch.autograd.Function):
    """``x`` ``[M, in]`` (rows grouped by expert, group ``e`` ending at ``ends[e]``) times expert ``e``'s
    ``weight`` ``[out, in]`` transposed -> ``[M, out]``, one ``torch._grouped_mm`` each way.

    Saved for backward: ``x`` and the expert weights themselves (the parameters, no memory of their
    own); the stacked copy the kernel reads exists only inside forward and backward, not once per
    MoE layer and microbatch until the backward.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, ends: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, ends, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=ends)  # [M, out]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, ends, *weights = ctx.saved_tensors
        grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=ends) if ctx.needs_input_grad[0] else None
        grad_w = torch._grouped_mm(grad.t(), x, offs=ends)  # [E, out, in]: per group, grad_e^T @ x_e
        return (grad_x, None, *grad_w.unbind(0))


def expert_counts(routing_map: torch.Tensor) -> torch.Tensor:
    """Tokens routed to each expert ``[E]`` (int64), on the map's device: no host read."""
    return routing_map.bool().sum(dim=0)


def permute_by_expert(
    probs: torch.Tensor, routing_map: torch.Tensor, counts: Optional[List[int]] = None
) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
    """The routed (token, expert) pairs expert by expert: token ids ``[N]`` (ascending within an
    expert), their probs ``[N]`` and the per-expert counts (``N`` = their sum).

    One stable sort of the ``[E, T]`` routing map puts the routed pairs first, expert by expert;
    ``counts`` (the host's copy, when a caller already has it) split them, else one host read of
    the per-expert counts does (a ``nonzero`` per expert would read the host once per expert).
    """
    num_tokens = routing_map.shape[0]
    routed = routing_map.t().reshape(-1).bool()  # [E*T], expert-major
    if counts is None:
        counts = routed.view(-1, num_tokens).sum(dim=1).tolist()  # [E] the one host read
    order = torch.argsort((~routed).to(torch.uint8), stable=True)[: sum(counts)]  # [N]
    return order % num_tokens, probs.t().reshape(-1)[order], counts


def sort_by_expert(probs: torch.Tensor, routing_map: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Per expert: the ids of the tokens routed to it (ascending) and their routing probabilities."""
    token_ids, sorted_probs, counts = permute_by_expert(probs, routing_map)
    return list(token_ids.split(counts)), list(sorted_probs.split(counts))


def grouped_mm_supported(tokens: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``tokens``' dtype on its device (CPU: fp32/bf16/fp16;
    CUDA: bf16 on compute capability >= 9.0). Elsewhere the experts run in a loop."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if tokens.device.type == "cpu":
        return tokens.dtype in GROUPED_MM_CPU_DTYPES
    if tokens.device.type != "cuda" or tokens.dtype != torch.bfloat16 or not torch.cuda.is_available():
        return False  # (also a fake CUDA device without a GPU: the dry run)
    return torch.cuda.get_device_capability(tokens.device) >= (9, 0)


class SequentialMLP(MegatronModule):
    """``local_experts.{i}``: one MLP per local expert, each split over the expert-TP group.

    Local expert ``i`` of EP rank ``r`` is global expert ``r * num_local_experts + i``. With
    ``use_cpu_initialization`` every rank draws all experts' weights in global order and keeps
    its own, so the initial model (and the default generator afterwards) does not depend on EP.

    ``forward`` returns this rank's partial sum over TP of ``sum_k p[t, e_k] * expert_{e_k}(x_t)``;
    the MoE layer reduces it. Every expert runs, also on zero tokens, so every parameter gets a
    gradient (zeros) each step.
    """

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: Union[ModuleSpec, type, None] = None,
        *,
        pg_collection: ProcessGroupCollection,
    ) -> None:
        super().__init__(config)
        groups = pg_collection
        self.tp_group = groups.expt_tp
        ep_size = groups.size_of("ep")
        first = groups.rank_in("ep") * num_local_experts
        built = num_local_experts * ep_size if config.use_cpu_initialization and ep_size > 1 else num_local_experts
        experts = [
            build_module(
                submodules or MLP,
                config,
                pg_collection=groups,
                ffn_hidden_size=config.moe_ffn_hidden_size,
                is_expert=True,
            )
            for _ in range(built)
        ]
        if built > num_local_experts:
            experts = experts[first : first + num_local_experts]
        self.local_experts = torch.nn.ModuleList(experts)

    def _bias_share(self, bias: torch.Tensor) -> torch.Tensor:
        """The replicated output bias as a partial sum over TP: whole on rank 0, zero elsewhere."""
        bias = copy_to_tensor_model_parallel_region(bias, self.tp_group)  # gradient summed over TP
        return bias if dist.get_rank(self.tp_group) == 0 else bias * 0.0

    def forward(
        self,
        tokens: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor,
        tokens_per_expert: Optional[List[int]] = None,
    ) -> torch.Tensor:
        """``tokens`` ``[T, h]``, ``probs`` and ``routing_map`` ``[T, E]`` -> partial output ``[T, h]``.

        ``tokens_per_expert``: the map's per-expert counts where the caller read them already (the
        all-to-all dispatcher's one size exchange); otherwise one host read here."""
        sizes = expert_counts(routing_map)  # [E] on the device
        token_ids, weights, counts = permute_by_expert(probs, routing_map, tokens_per_expert)  # [N], [N], E counts
        out = self.run_experts(tokens[token_ids], counts, sizes)  # [N, h] partial over TP
        weighted = out * weights.unsqueeze(-1).to(out.dtype)  # [N, h]
        return torch.zeros_like(tokens).index_add(0, token_ids, weighted)  # [T, h]

    def run_experts(self, permuted: torch.Tensor, counts: List[int], sizes: torch.Tensor) -> torch.Tensor:
        """Tokens ``[N, h]`` sorted by expert (``counts[i]`` for local expert ``i``; ``sizes`` the same
        counts ``[E]`` on the device) -> outputs ``[N, h]``."""
        outputs = []
        for expert, chunk in zip(self.local_experts, permuted.split(counts)):
            out, bias = expert(chunk)  # [n_e, h] partial over TP, [h] or None
            outputs.append(out if bias is None else out + self._bias_share(bias))
        return torch.cat(outputs)  # [N, h]


class GroupedMLP(SequentialMLP):
    """``moe_grouped_gemm``: the local experts as one ``torch._grouped_mm`` per projection.

    The parameters are ``SequentialMLP``'s (``local_experts.{i}.linear_fc1.weight`` ...), stacked
    at each forward, so checkpoints of either class load into the other. Where ``_grouped_mm``
    does not take the dtype/device (``grouped_mm_supported``), the experts are not plain ``MLP``s,
    or their linears are FP8/FP4-quantized, the experts run in ``SequentialMLP``'s loop.
    """

    # The forward reads the experts' weights without calling the experts: the distributed optimizer's
    # parameter-gather pre-hook must wait for all of them here, not at the experts' (skipped) forwards.
    reads_submodule_parameters = True

    def run_experts(self, permuted: torch.Tensor, counts: List[int], sizes: torch.Tensor) -> torch.Tensor:
        """Tokens ``[N, h]`` sorted by expert -> outputs ``[N, h]``, two grouped GEMMs over the groups
        padded to ``group_alignment`` rows (``M`` in all; zero input rows, their outputs dropped)."""
        quantized = any(getattr(e.linear_fc1, "quantizer", None) is not None for e in self.local_experts)
        if quantized or not grouped_mm_supported(permuted) or not all(type(e) is MLP for e in self.local_experts):
            return super().run_experts(permuted, counts, sizes)  # FP8/FP4 experts quantize inside their linears
        fc1 = [e.linear_fc1 for e in self.local_experts]
        fc2 = [e.linear_fc2 for e in self.local_experts]
        expert_of_row, rows, ends = _padded_groups(counts, sizes, group_alignment(permuted.dtype))
        x = permuted.new_zeros(expert_of_row.shape[0], permuted.shape[1]).index_copy(0, rows, permuted)  # [M, h]
        hidden = GroupedLinear.apply(x, ends, *[layer.weight for layer in fc1])  # [M, f1/tp]
        if fc1[0].bias is not None:
            hidden = hidden + torch.stack([layer.bias for layer in fc1])[expert_of_row]  # [M, f1/tp]
        hidden = self._activation(hidden)  # [M, f/tp]; padding rows reach only padding rows of the output
        out = GroupedLinear.apply(hidden, ends, *[layer.weight for layer in fc2])  # [M, h] partial over TP
        if fc2[0].bias is not None:
            out = out + self._bias_share(torch.stack([layer.bias for layer in fc2]))[expert_of_row]  # [M, h]
        return out[rows]  # [N, h]

    def _activation(self, hidden: torch.Tensor) -> torch.Tensor:
        """``MLP``'s activation on fc1's output ``[N, f1/tp]`` (gated: ``act(gate) * up``)."""
        return apply_activation(self.config, hidden)


def _padded_groups(
    counts: List[int], sizes: torch.Tensor, align: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each expert's ``counts[e]`` rows (``sizes`` ``[E]``: the same on the device, so nothing is
    uploaded) padded to a multiple of ``align``: the expert of every padded row ``[M]``, the padded row
    of every real row ``[N]``, and the groups' ends ``[E]`` (int32)."""
    device = sizes.device
    padded_sizes = (sizes + align - 1) // align * align  # [E]
    total = sum(-(-c // align) * align for c in counts)  # M, known on the host
    padded_ends = padded_sizes.cumsum(0)  # [E]
    shift = (padded_ends - padded_sizes) - (sizes.cumsum(0) - sizes)  # [E] padded start - packed start
    real = sum(counts)  # N
    rows = torch.arange(real, device=device) + torch.repeat_interleave(shift, sizes, output_size=real)  # [N]
    experts = torch.arange(len(counts), device=device)
    expert_of_row = torch.repeat_interleave(experts, padded_sizes, output_size=total)  # [M]
    return expert_of_row, rows, padded_ends.to(torch.int32)
