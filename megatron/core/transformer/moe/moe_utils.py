"""Auxiliary losses of MoE routers: their formulas, how they reach the gradients, and their logging.

The aux losses are not part of the model's output. ``MoEAuxLossAutoScaler`` returns its input
unchanged and, in backward, also back-propagates the aux loss with gradient ``loss_scale``.
The pipeline ``forward_step`` sets that scale exactly like the main loss is scaled (1 /
number of microbatches, or 1 with ``calculate_per_token_loss``, times the fp16 loss scale).

``AuxLossTracker`` is one run's aux-loss state: that scale and, per global layer, the detached
coefficient-free values (aux / coeff, as Megatron logs them) summed over the microbatches of
one iteration. Routers start bound to a process-wide default (Megatron's accessors); the
training loop binds them to its run's tracker with ``use_aux_loss_tracker``.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Union

import torch
import torch.distributed as dist

from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.transformer.moe_choices import BALANCE_LOSS_NAMES
from megatron.core.utils import comm_device

LOAD_BALANCING_LOSS = BALANCE_LOSS_NAMES["aux_loss"]
Z_LOSS = "z_loss"


def switch_load_balancing_loss(
    probs: torch.Tensor, tokens_per_expert: torch.Tensor, topk: int, coeff: float, num_tokens: Optional[int] = None
) -> torch.Tensor:
    """Switch-Transformer balance loss as Megatron defines it.

    ``coeff * E / (k * T^2) * sum_e (sum_t p[t, e]) * tokens_per_expert[e]``, with ``probs``
    ``[T, E]`` the softmax over all experts and ``tokens_per_expert`` ``[E]`` the top-k counts.
    Uniform routing gives ``coeff``. ``num_tokens`` (default ``T``): the tokens ``tokens_per_expert``
    counts, when those are more than ``probs``' own (``global_aux_loss``).
    """
    num_experts = probs.shape[1]
    num_tokens = probs.shape[0] if num_tokens is None else num_tokens
    per_expert = probs.sum(dim=0) * tokens_per_expert.to(probs.dtype)  # [E]
    return per_expert.sum() * (coeff * num_experts / (topk * num_tokens * num_tokens))


def router_z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE z-loss: ``coeff * mean_t logsumexp(logits[t])^2`` over ``logits`` ``[T, E]``."""
    return torch.square(torch.logsumexp(logits.float(), dim=-1)).mean() * coeff


class AuxLossTracker:
    """One run's aux-loss state: what the routers add and the gradient they get back.

    ``values``: per-layer sums of detached aux-loss values (``name -> [num_layers]``) since the
    last clear. ``loss_scale``: the gradient ``MoEAuxLossAutoScaler`` gives every aux loss in
    backward, set by the schedule's ``forward_step``.
    """

    def __init__(self) -> None:
        self.values: Dict[str, torch.Tensor] = {}
        self.loss_scale = torch.tensor(1.0)

    def add(self, name: str, value: torch.Tensor, layer_number: int, num_layers: int) -> None:
        """Add ``value`` to global 1-based ``layer_number``'s entry of ``name`` (entries grow to ``num_layers``:
        a tracker shared by models of different depths, e.g. with and without MTP modules, keeps both)."""
        kept = self.values.get(name)
        if kept is None or kept.numel() < num_layers:
            grown = torch.zeros(num_layers, dtype=torch.float32, device=value.device)
            if kept is not None:
                grown[: kept.numel()] = kept
            self.values[name] = grown
        self.values[name][layer_number - 1] += value.detach().float()

    def clear(self) -> None:
        self.values.clear()

    def set_loss_scale(self, scale: Union[torch.Tensor, float]) -> None:
        """Gradient given to every aux loss in backward (what the main loss is multiplied by)."""
        self.loss_scale = torch.as_tensor(scale, dtype=torch.float32).detach().reshape(())


_TRACKER = AuxLossTracker()  # the default behind Megatron's process-wide accessors


def get_aux_loss_tracker() -> AuxLossTracker:
    """The process-wide default tracker (routers are bound to it until ``use_aux_loss_tracker``)."""
    return _TRACKER


def use_aux_loss_tracker(model_chunks: Iterable[torch.nn.Module], tracker: AuxLossTracker) -> None:
    """Bind every router of ``model_chunks`` to ``tracker`` (the training loop passes its run's)."""
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(getattr(module, "aux_loss_tracker", None), AuxLossTracker):
                module.aux_loss_tracker = tracker


def aux_loss_tracker_of(model: torch.nn.Module) -> AuxLossTracker:
    """The tracker ``model``'s routers are bound to; the default for a model without routers."""
    bound = (getattr(m, "aux_loss_tracker", None) for m in model.modules())
    return next((t for t in bound if isinstance(t, AuxLossTracker)), _TRACKER)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output``; backward also sends ``tracker.loss_scale * weight`` into ``aux_loss``.

    ``weight`` lets tensor-parallel ranks that all compute the same aux loss contribute it
    once (see ``MoELayer``). ``tracker`` None means the process-wide default.
    """

    @staticmethod
    def forward(
        ctx, output: torch.Tensor, aux_loss: torch.Tensor, weight: float, tracker: Optional[AuxLossTracker] = None
    ) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.weight = weight
        ctx.tracker = tracker if tracker is not None else _TRACKER
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = ctx.tracker.loss_scale.to(aux_loss.device, aux_loss.dtype)
        return grad_output, torch.ones_like(aux_loss) * scale * ctx.weight, None, None

    @staticmethod
    def set_loss_scale(scale: Union[torch.Tensor, float]) -> None:
        """Megatron's process-wide setter: the default tracker's ``loss_scale``."""
        _TRACKER.set_loss_scale(scale)


def tracked_aux_loss_names(config) -> List[str]:
    """Names the routers of ``config`` track: the balance loss when its coefficient is > 0, the z-loss when set."""
    if config.num_moe_experts is None:
        return []
    names = []
    kind = config.moe_router_load_balancing_type
    if kind in BALANCE_LOSS_NAMES and config.moe_aux_loss_coeff > 0:
        names.append(BALANCE_LOSS_NAMES[kind])
    if config.moe_z_loss_coeff:
        names.append(Z_LOSS)
    return names


def tracked_mtp_loss_names(config) -> List[str]:
    """``mtp_{k} loss`` for each multi-token prediction module (tracked beside the aux losses)."""
    return [f"mtp_{k} loss" for k in range(1, (getattr(config, "mtp_num_layers", None) or 0) + 1)]


def aux_loss_pairs(
    config, groups: ProcessGroupCollection, num_microbatches: int, tracker: AuxLossTracker = _TRACKER
) -> Dict[str, torch.Tensor]:
    """This iteration's aux losses (and multi-token prediction losses, ``mtp_{k} loss``: their mean over
    microbatches and DP ranks) as ``[sum, count]`` pairs; clears the tracker. Collective over PP.

    ``sum`` adds the coefficient-free values of every MoE layer (all pipeline stages) and
    microbatch; ``count`` is layers x microbatches. Summing the pairs over data-parallel ranks
    before dividing (the training loop's ``reduce_losses`` does, in the same all-reduce as the
    main losses) gives Megatron's logged value: the mean over MoE layers, microbatches and
    DP ranks. Each rank routes its own tokens (its sequence shard under SP, its chunk under CP) and
    tracks its share of each aux loss (the shares of a TP x CP group add up to the loss of the whole
    sequences, see ``TopKRouter``), so the aux values are first summed over TP x CP: every rank
    then holds the value a TP=1, CP=1 run of the same batch logs.
    """
    aux_names, mtp_names = tracked_aux_loss_names(config), tracked_mtp_loss_names(config)
    names = aux_names + mtp_names
    if not names:
        return {}
    device = comm_device()
    zero = torch.zeros((), dtype=torch.float32, device=device)
    totals = torch.stack([tracker.values[n].to(device).sum() if n in tracker.values else zero for n in names])
    tracker.clear()
    if aux_names and groups.size_of("tp_cp") > 1:  # the shares of one replica's tokens
        aux = totals[: len(aux_names)].contiguous()
        dist.all_reduce(aux, group=groups.tp_cp)
        totals = torch.cat([aux, totals[len(aux_names) :]])
    if groups.size_of("pp") > 1:
        dist.all_reduce(totals, group=groups.pp)
    counts = torch.full_like(totals, float(num_microbatches))  # mtp_k: one value per microbatch
    counts[: len(aux_names)] *= num_moe_layers(config)  # aux losses: one per MoE layer and microbatch
    return dict(zip(names, torch.stack([totals, counts], dim=1)))  # name -> [sum, count]


def num_moe_layers(config) -> int:
    """MoE layers of the decoder and of the multi-token prediction modules (theirs repeat the last layer's kind)."""
    decoder = sum(config.is_moe_layer(n) for n in range(1, config.num_layers + 1))
    mtp = getattr(config, "mtp_num_layers", None) or 0
    return decoder + (mtp if config.num_moe_experts and config.is_moe_layer(config.num_layers) else 0)
