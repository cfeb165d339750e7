"""Muon (momentum orthogonalised by Newton–Schulz) for 2-D linear weights, AdamW for the rest.

Megatron-core trains with ``--optimizer muon`` through NVIDIA's emerging-optimizers ``Muon``; this is
the same update written here: an EMA momentum ``m = mu m + (1 - mu) g`` (Nesterov: ``g + mu (m - g)``),
the quintic Newton–Schulz iteration with five tuned coefficient triples (``steps`` a multiple of five),
a shape scale (``spectral``: sqrt(max(rows, cols)); ``unit_rms_norm``: sqrt(rows / cols);
``shape_scaling``: sqrt(max(1, rows / cols))) times ``extra_scale_factor``, and decoupled weight decay.
Parameters of groups without ``use_muon`` (embeddings, output layer, norms, biases) take AdamW.

Tensor parallelism (``tp_mode``): ``blockwise`` orthogonalises each rank's shard on its own (its shape
sets the scale); ``duplicated`` all-gathers the shards along the parameter's ``partition_dim``,
orthogonalises the whole matrix on every rank and keeps this rank's slice; ``distributed`` keeps the
shards and runs the iteration on the whole matrix oriented so that they are column blocks (transposed
when ``partition_dim`` is 0): the Frobenius norm and each step's Gram matrix are summed over TP, the rest
is local, and each rank ends with its own slice of the whole matrix's orthogonal factor.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.layers import is_expert_param

# Quintic Newton–Schulz coefficients (a, b, c) per step, as emerging-optimizers' "quintic" set.
QUINTIC_COEFFICIENTS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
TP_MODES = ("blockwise", "duplicated", "distributed")
MATMUL_PRECISIONS = ("low", "medium", "high")


def newton_schulz(
    x: torch.Tensor,
    steps: int,
    bf16: bool,
    eps: float = 1e-7,
    group: Optional[dist.ProcessGroup] = None,
    transpose: Optional[bool] = None,
) -> torch.Tensor:
    """The approximate orthogonal factor of ``x`` [rows, cols] (fp32 in, fp32 out).

    Works on the wide orientation (transposed when rows > cols; ``transpose`` forces it), normalised to
    unit Frobenius norm; ``bf16`` runs the iterations in bfloat16 (Megatron's ``medium`` / ``low`` fp32
    matmul precision). ``group``: the working matrix is split into column blocks over this group, ``x``
    (after the orientation) being this rank's; the norm and the Gram matrices are summed over it (fp32).
    """
    transpose = x.size(0) > x.size(1) if transpose is None else transpose
    work = (x.mT if transpose else x).float()  # [m, n (this rank's columns)]
    if group is None:
        y = torch.nn.functional.normalize(work, p=2, dim=(-2, -1), eps=eps)
    else:
        square_sum = work.square().sum()
        dist.all_reduce(square_sum, group=group)
        y = work / square_sum.sqrt().clamp_min(eps)
    if bf16:
        y = y.to(torch.bfloat16)
    for i in range(steps):
        a, b, c = QUINTIC_COEFFICIENTS[i % len(QUINTIC_COEFFICIENTS)]
        gram = y @ y.mT  # [m, m]
        if group is not None:  # the whole matrix's Gram: the column blocks' summed
            gram = gram.float()
            dist.all_reduce(gram, group=group)
            gram = gram.to(y.dtype)
        poly = b * gram + c * (gram @ gram)  # [m, m]
        y = a * y + poly @ y  # [m, n]
    y = y.float()
    return y.mT if transpose else y


def muon_scale(rows: int, cols: int, mode: str) -> float:
    """The update's shape scale for a [rows, cols] weight (see the module docstring)."""
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"muon_scale_mode={mode!r}: must be one of {SCALE_MODES}")


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the groups with ``use_muon``, AdamW (torch's update) on the others.

    ``tp_groups`` are the (dense, expert) tensor-parallel groups ``duplicated`` gathers over (expert
    weights, ``allreduce=False``, over the second); a parameter's ``partition_dim`` attribute (with
    ``tensor_model_parallel``) says which dimension is sharded.
    """

    def __init__(
        self,
        param_groups: List[Dict[str, Any]],
        *,
        lr: float,
        weight_decay: float,
        momentum: float,
        nesterov: bool,
        num_ns_steps: int,
        scale_mode: str,
        extra_scale_factor: float,
        bf16_newton_schulz: bool,
        tp_mode: str,
        tp_groups: Optional[Tuple[dist.ProcessGroup, ...]],
        betas: tuple,
        eps: float,
    ) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, use_muon=False, momentum=momentum, betas=betas, eps=eps)
        super().__init__(param_groups, defaults)
        self.nesterov = nesterov
        self.num_ns_steps = num_ns_steps
        self.scale_mode = scale_mode
        self.extra_scale_factor = extra_scale_factor
        self.bf16_newton_schulz = bf16_newton_schulz
        self.tp_mode = tp_mode
        self.tp_groups = tp_groups

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch's contract
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                param.mul_(1.0 - group["lr"] * group["weight_decay"])  # decoupled weight decay
                if group["use_muon"]:
                    self._muon_update(param, group)
                else:
                    self._adamw_update(param, group)
        return None

    def _muon_update(self, param: torch.Tensor, group: Dict[str, Any]) -> None:
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param)
        buf = state["momentum_buffer"]
        buf.lerp_(param.grad, 1.0 - group["momentum"])
        update = param.grad.lerp(buf, group["momentum"]) if self.nesterov else buf
        split = group.get("muon_qkv_split")
        if split is None:
            orth = self.orthogonalize(param, update)
        else:  # fused QKV [groups/tp * (q + k + v), in]: Q, K and V orthogonalised one by one
            per_group = update.view(-1, sum(split), update.size(1))  # [groups/tp, q + k + v, in]
            parts = per_group.split(list(split), dim=1)
            orth_parts = [self.orthogonalize(param, part.reshape(-1, update.size(1))) for part in parts]
            orth = torch.cat([o.view(per_group.size(0), -1, update.size(1)) for o in orth_parts], dim=1)
        param.add_(orth.view_as(param), alpha=-group["lr"])

    def orthogonalize(self, param: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """Scaled Newton–Schulz of ``update`` (a matrix of ``param``'s local shard) under the TP mode."""
        dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
        group = None if self.tp_groups is None else self.tp_groups[is_expert_param(param)]
        world = 1 if group is None else dist.get_world_size(group)
        if self.tp_mode == "blockwise" or dim < 0 or world == 1:
            orth = newton_schulz(update, self.num_ns_steps, self.bf16_newton_schulz)
            return orth * muon_scale(update.size(0), update.size(1), self.scale_mode) * self.extra_scale_factor
        if self.tp_mode == "distributed":  # the shards as column blocks of the whole matrix (or of its transpose)
            orth = newton_schulz(update, self.num_ns_steps, self.bf16_newton_schulz, group=group, transpose=dim == 0)
            full_shape = [update.size(0), update.size(1)]
            full_shape[dim] *= world
            return orth * muon_scale(*full_shape, self.scale_mode) * self.extra_scale_factor
        shards = [torch.empty_like(update) for _ in range(world)]
        dist.all_gather(shards, update.contiguous(), group=group)
        full = torch.cat(shards, dim=dim)  # the whole matrix
        orth = newton_schulz(full, self.num_ns_steps, self.bf16_newton_schulz)
        scale = muon_scale(full.size(0), full.size(1), self.scale_mode) * self.extra_scale_factor
        return orth.chunk(world, dim=dim)[dist.get_rank(group)] * scale

    def _adamw_update(self, param: torch.Tensor, group: Dict[str, Any]) -> None:
        state = self.state[param]
        if "exp_avg" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = float(state["step"])
        state["exp_avg"].lerp_(param.grad, 1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1.0 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1.0 - beta2**step)).add_(group["eps"])
        param.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1.0 - beta1**step))


def make_muon(
    config: Any, groups: List[Dict[str, Any]], tp_groups: Optional[Tuple[dist.ProcessGroup, ...]]
) -> MuonWithAdamW:
    """``MuonWithAdamW`` from an ``OptimizerConfig``'s ``muon_*`` and Adam fields."""
    return MuonWithAdamW(
        groups,
        lr=config.lr or 0.0,
        weight_decay=config.weight_decay,
        momentum=config.muon_momentum,
        nesterov=config.muon_use_nesterov,
        num_ns_steps=config.muon_num_ns_steps,
        scale_mode=config.muon_scale_mode,
        extra_scale_factor=config.muon_extra_scale_factor,
        bf16_newton_schulz=config.muon_fp32_matmul_prec in ("low", "medium"),
        tp_mode=config.muon_tp_mode,
        tp_groups=tp_groups,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
    )


def split_muon_groups(
    param_groups: List[Dict[str, Any]], muon_ids: set, qkv_splits: Dict[int, Tuple[int, ...]]
) -> List[Dict[str, Any]]:
    """Each group split into Muon parts (the parameters whose id is in ``muon_ids``; the fused QKV weights of
    ``qkv_splits``, id -> rows of q, k, v per query group, in groups of their own) and the rest (AdamW)."""
    out = []
    for group in param_groups:
        muon = [p for p in group["params"] if id(p) in muon_ids]
        rest = [p for p in group["params"] if id(p) not in muon_ids]
        by_split: Dict[Optional[Tuple[int, ...]], List[torch.Tensor]] = {}
        for param in muon:
            by_split.setdefault(qkv_splits.get(id(param)), []).append(param)
        for split, params in by_split.items():
            out.append({**group, "params": params, "use_muon": True, "muon_qkv_split": split})
        if rest:
            out.append({**group, "params": rest, "use_muon": False, "muon_qkv_split": None})
    return out


def qkv_splits(model: torch.nn.Module) -> Dict[int, Tuple[int, int, int]]:
    """id(fused QKV weight) -> rows of (q, k, v) per query group, from the attention's ``TransformerConfig``."""
    out = {}
    for module in model.modules():
        weight = getattr(getattr(module, "linear_qkv", None), "weight", None)
        config = getattr(module, "config", None)
        if weight is None or config is None:
            continue
        if getattr(config, "attention_output_gate", False):
            raise ValueError(
                "muon_split_qkv=True with attention_output_gate=True: splitting the gated QKV weight is not "
                "supported yet (muon_split_qkv=False orthogonalises it as one matrix)"
            )
        head_dim = config.kv_channels
        heads_per_group = config.num_attention_heads // (config.num_query_groups or config.num_attention_heads)
        out[id(weight)] = (heads_per_group * head_dim, head_dim, head_dim)
    return out
