"""Megatron optimizers: a torch optimizer over fp32 main parameters, with loss scaling and clipping.

``MegatronOptimizer.step()`` does, in order: collect the model gradients into the fp32
main gradients (``param.main_grad`` from the data-parallel wrapper when present, else
``param.grad``), unscale them and look for inf/NaN when a loss scaler is active (a hit
skips the step), compute the global gradient norm over the ranks named in
``clip_grads``, clip by it, step the torch optimizer, and write the main parameters
back into the model.

Each main parameter is linked to the model parameter it updates (``MainLink``):

* ``FP32Optimizer``: the main parameter *is* the fp32 model parameter.
* ``Float16OptimizerWithFloat16Params``: an fp32 copy of each bf16/fp16 parameter
  (fp32 model parameters are used directly).
* ``DistributedOptimizer`` (``distrib_optimizer.py``): an fp32 slice of the flattened
  parameter covering only this data-parallel rank's shard.

Checkpoint contract (``state_dict_by_param_name``)::

    {
      "<param name>": {"exp_avg": T, "exp_avg_sq": T,      # Adam
                       "momentum_buffer": T,               # SGD with momentum
                       "main_param": T},                   # only for bf16/fp16 params (fp32 copy)
      ...,
      "param_groups": [{"lr", "weight_decay", "wd_mult", "lr_mult", "is_decoupled_lr",
                        "max_lr", "min_lr", "betas", "eps", "momentum"...}],   # plain scalars
      "step": int,                                         # optimizer steps taken
      "loss_scaler": {"scale": float, ...} or None,
    }

``<param name>`` is ``megatron.core.utils.named_model_params``' name: the one in
``unwrap_model(chunk).named_parameters()``, prefixed ``"chunk{i}."`` with several model chunks
(virtual pipeline).
Every tensor has the parameter's *local* shape (this rank's TP shard, fp32), so the
checkpoint code shards it exactly like the parameter (same global shape, same slice).
The distributed optimizer gathers its DP slices so that it honours the same contract.
Entries are absent for parameters without state yet (before the first step).
``load_state_dict_by_param_name(model_chunks, state)`` restores from the same structure; an entry
may instead hold tensors covering only flat elements ``[flat_start, flat_start + numel)`` of the
parameter, with ``"flat_start": int`` (what ``DistributedOptimizer.sharded_state_template`` reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.optimizer.chained_optimizer import ChainedOptimizer, ProxyDict  # noqa: F401 - re-exported
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    counts_for_norm,
    get_grad_norm_fp32,
    unscale_and_find_nonfinite,
)
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.muon import make_muon
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.quantization.fp8_params import is_fp8_param
from megatron.core.tensor_parallel.layers import copy_tensor_model_parallel_attributes, is_expert_param
from megatron.core.utils import named_model_params

# Keys of a param group that describe it (kept in state dicts); 'params' is not one.
GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "max_lr", "min_lr")
_RESERVED = ("param_groups", "step", "loss_scaler")


@dataclass
class MainLink:
    """One fp32 tensor the torch optimizer updates, and the model parameter it belongs to.

    ``flat_range`` is ``(start, end)`` into ``model.view(-1)`` when the main tensor covers
    only a slice (distributed optimizer), else None. ``is_copy`` says the main tensor has
    its own storage and must be written back into the model after each step. ``grad_source`` and
    ``data_source`` (Megatron-FSDP's sharded gradients and parameters) hold the covered elements'
    gradient and model values instead of ``model.main_grad`` and ``model``.
    """

    main: torch.Tensor
    model: torch.nn.Parameter
    flat_range: Optional[Tuple[int, int]] = None
    is_copy: bool = False
    grad_source: Optional[torch.Tensor] = None
    data_source: Optional[torch.Tensor] = None

    def _covered(self, tensor: torch.Tensor, source: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The covered elements of ``tensor`` (shaped like the model; ``source``: them, already cut out),
        shaped like ``main`` once it exists (a slice is flat, a whole Muon matrix keeps its shape)."""
        if source is None:
            source = tensor if self.flat_range is None else tensor.view(-1)[self.flat_range[0] : self.flat_range[1]]
        return source if self.main is None else source.view(self.main.shape)

    def model_grad(self) -> Optional[torch.Tensor]:
        """The model's gradient for the covered elements (``main_grad`` preferred)."""
        grad = getattr(self.model, "main_grad", None)
        if grad is None:
            grad = self.model.grad
        if grad is None and self.grad_source is None:
            return None
        return self._covered(grad, self.grad_source)

    def model_data(self) -> torch.Tensor:
        return self._covered(self.model.data, self.data_source)

    def model_values(self) -> torch.Tensor:
        """The covered elements' real values in fp32 (an FP8 weight's bytes times its scale)."""
        if not is_fp8_param(self.model):
            return self.model_data().float()
        return self._covered(self.model.data.float() * self.model.fp8_meta.scale_inv)  # [out, in] -> covered


def _fused_adam_available(groups: List[Dict[str, Any]]) -> bool:
    """Torch's fused AdamW takes fp32 tensors on CPU or CUDA (torch >= 2.4)."""
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.dtype == torch.float32 and p.device.type in ("cpu", "cuda") for p in params)


def make_torch_optimizer(
    config: OptimizerConfig, groups: List[Dict[str, Any]], tp_groups: Optional[Tuple[dist.ProcessGroup, ...]] = None
) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay), SGD with momentum, or Muon (``tp_groups``: its TP gathers) over ``groups``;
    with ``config.optimizer_cpu_offload`` the AdamW / SGD runs inside a ``HybridDeviceOptimizer``."""
    if config.optimizer == "muon":
        return make_muon(config, groups, tp_groups)
    cls, settings = _torch_optimizer_settings(config, groups)
    if config.optimizer_cpu_offload:
        return HybridDeviceOptimizer(
            groups,
            offload_fraction=config.optimizer_offload_fraction,
            cpu_optimizer_cls=cls,
            gpu_optimizer_cls=cls,
            param_update_in_fp32=True,
            pin_cpu_grads=config.pin_cpu_grads,
            pin_cpu_params=config.pin_cpu_params,
            overlap_cpu_optimizer_d2h_h2d=config.overlap_cpu_optimizer_d2h_h2d,
            **settings,
        )
    return cls(groups, **settings)


def _torch_optimizer_settings(config: OptimizerConfig, groups: List[Dict[str, Any]]) -> Tuple[type, Dict[str, Any]]:
    """The torch class and constructor settings of ``config.optimizer`` (adam or sgd) over ``groups``."""
    if config.optimizer == "adam":
        # Megatron always steps a fused Adam (TE / apex). Torch's fused AdamW makes one pass per
        # tensor: 6-8x faster than its reference loop on GPT-2 small's 124M fp32 parameters on a
        # 2-core CPU; equal to it up to rounding, and elementwise, so
        # bit-identical however the distributed optimizer shards a parameter.
        settings = dict(
            lr=config.lr or 0.0, weight_decay=config.weight_decay, betas=(config.adam_beta1, config.adam_beta2)
        )
        settings["eps"] = config.adam_eps
        if _fused_adam_available(groups):
            settings["fused"] = True
        return torch.optim.AdamW, settings
    return torch.optim.SGD, dict(lr=config.lr or 0.0, weight_decay=config.weight_decay, momentum=config.sgd_momentum)


GROUP_KIND_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "use_muon", "muon_qkv_split")


def restore_group_settings(groups: List[Dict[str, Any]], saved: Sequence[Dict[str, Any]]) -> None:
    """Saved hyper-parameters onto the group of the same kind (``GROUP_KIND_KEYS``), not position.

    Groups are ordered by their first parameter, so pipeline stages order them differently,
    and the saved list is one rank's (checkpoints keep rank 0's). A kind this rank has and
    the list lacks keeps its settings: they come from the same flags, and the LR scheduler
    recomputes lr and weight decay from them when it is restored.
    """
    by_kind = {tuple(g.get(k) for k in GROUP_KIND_KEYS): g for g in saved}
    for group in groups:
        match = by_kind.get(tuple(group.get(k) for k in GROUP_KIND_KEYS))
        if match is not None:
            group.update({k: v for k, v in match.items() if k != "params"})


class MegatronOptimizer:
    """Base: links, the torch optimizer, and the shared step / clip / state logic.

    Args:
        config: optimizer settings.
        param_groups: groups of *model* parameters with Megatron's keys (``GROUP_KEYS``).
        tp_rank: this rank's tensor-parallel rank (replicated params count on rank 0 only).
        stat_groups: process groups the gradient norm, zero count and inf check are summed over.
        grad_scaler: loss scaler, or None (fp32 and bf16).
        expert_stat_groups: the groups for expert parameters (``allreduce = False``), which differ
            across expert-parallel ranks; None: experts are summed over ``stat_groups`` too.
        tp_groups: the (dense, expert) tensor-parallel groups Muon gathers a sharded update over.
    """

    def __init__(
        self,
        config: OptimizerConfig,
        param_groups: List[Dict[str, Any]],
        tp_rank: int,
        stat_groups: Sequence[dist.ProcessGroup],
        grad_scaler: Optional[MegatronGradScaler] = None,
        expert_stat_groups: Optional[Sequence[dist.ProcessGroup]] = None,
        tp_groups: Optional[Tuple[dist.ProcessGroup, ...]] = None,
    ) -> None:
        self.config = config
        self.tp_rank = tp_rank
        self.stat_groups = list(stat_groups)
        self.expert_stat_groups = None if expert_stat_groups is None else list(expert_stat_groups)
        self.grad_scaler = grad_scaler
        self.links: List[MainLink] = []
        main_groups = []
        for group in param_groups:
            links = [link for p in group["params"] for link in self._links_for(p)]
            self.links.extend(links)
            main_groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": [link.main for link in links]}
            )
        self.optimizer = make_torch_optimizer(config, main_groups, tp_groups)
        self._link_of_main = {id(link.main): link for link in self.links}
        if self.grad_scaler is not None:
            self.grad_scaler.to(self.device)  # scale and unscale without host copies

    # --- what subclasses decide -------------------------------------------------------
    def _links_for(self, param: torch.nn.Parameter) -> List[MainLink]:
        raise NotImplementedError

    def _after_step(self) -> None:
        """Write updated main params back into the model (and gather them, if sharded)."""
        with torch.no_grad():
            for link in self.links:
                if link.is_copy and not is_fp8_param(link.model):  # FP8 weights: DistributedOptimizer casts
                    link.model_data().copy_(link.main)

    # --- public API -----------------------------------------------------------------
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Dict[torch.Tensor, Dict[str, Any]]:
        return self.optimizer.state

    @property
    def device(self) -> torch.device:
        """Where the main parameters live (the CPU when this rank updates none)."""
        return self.links[0].main.device if self.links else torch.device("cpu")

    def get_loss_scale(self) -> torch.Tensor:
        """The loss scale ``[1]`` on the parameters' device (ones without a scaler)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else torch.ones(1, device=self.device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (``loss`` itself without a scaler): the training loop sets
        ``config.grad_scale_func`` to this, so it runs every microbatch and never copies to the device."""
        if self.grad_scaler is None:
            return loss
        return loss * self.grad_scaler.scale.to(loss.device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model ``.grad`` and main-param grads (the DDP buffer is zeroed by the wrapper)."""
        for link in self.links:
            for tensor in (link.model, link.main):
                if tensor.grad is not None:
                    if set_to_none:
                        tensor.grad = None
                    else:
                        tensor.grad.detach_().zero_()

    def main_grads(self) -> List[torch.Tensor]:
        return [link.main.grad for link in self.links if link.main.grad is not None]

    def grads_for_norm(self) -> List[torch.Tensor]:
        """Every gradient this rank counts in global statistics (dense and expert)."""
        return [
            link.main.grad
            for link in self.links
            if link.main.grad is not None and counts_for_norm(link.model, self.tp_rank)
        ]

    def _split_grads_for_norm(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """(dense, expert) counted gradients; all dense when experts share the dense groups."""
        if self.expert_stat_groups is None:
            return self.grads_for_norm(), []
        dense, expert = [], []
        for link in self.links:
            if link.main.grad is not None and counts_for_norm(link.model, self.tp_rank):
                (expert if is_expert_param(link.model) else dense).append(link.main.grad)
        return dense, expert

    def _expert_groups(self) -> List[dist.ProcessGroup]:
        return self.expert_stat_groups or []

    def get_grad_norm(self) -> float:
        dense, expert = self._split_grads_for_norm()
        return get_grad_norm_fp32(dense, self.stat_groups, expert, self._expert_groups())

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Global L2 norm of the gradients; clip them in place to ``clip_grad`` (if > 0)."""
        norm = self.get_grad_norm()
        if clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(self.main_grads(), clip_grad, norm)
        return norm

    def count_zeros(self) -> int:
        dense, expert = self._split_grads_for_norm()
        return count_zeros_fp32(dense, self.stat_groups, expert, self._expert_groups())

    def prepare_grads(self) -> bool:
        """Point main grads at the model grads, unscale; return True if an inf/NaN was found."""
        for link in self.links:
            grad = link.model_grad()
            link.main.grad = None if grad is None else grad.to(torch.float32)
        if self.grad_scaler is None:
            return False
        found_inf = unscale_and_find_nonfinite(
            self.main_grads(), self.grad_scaler.inv_scale, self.stat_groups + self._expert_groups()
        )
        self.grad_scaler.update(found_inf)
        return found_inf

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        """One update. Returns (update_successful, grad_norm, num_zeros_in_grad)."""
        if self.prepare_grads():
            return False, None, None
        grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        return self.step_with_ready_grads(), grad_norm, num_zeros

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Step the torch optimizer on main grads already prepared (and clipped); update the model."""
        self.optimizer.step()
        self._after_step()
        return True

    def get_parameters(self) -> List[torch.nn.Parameter]:
        """The main parameters the torch optimizer updates, group by group."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        """Megatron-core's name for ``grads_for_norm``."""
        return self.grads_for_norm()

    @torch.no_grad()
    def reload_model_params(self, state_dict: Optional[Dict[str, Any]] = None) -> None:
        """Copy the model parameters into the fp32 main copies (after loading a model checkpoint).

        ``state_dict`` (upstream: main parameters for fp8 models) is not supported yet.
        """
        if state_dict is not None:
            raise NotImplementedError("reload_model_params(state_dict=...) is not supported yet")
        for link in self.links:
            if link.is_copy:
                link.main.copy_(link.model_values())

    # --- state ------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Positional state (same layout only); checkpoints should use the by-name form."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
            "main_params": [link.main.detach().clone() for link in self.links if link.is_copy],
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        copies = [link for link in self.links if link.is_copy]
        with torch.no_grad():
            for link, saved in zip(copies, state_dict.get("main_params", [])):
                link.main.copy_(saved)

    def _param_state(self, link: MainLink) -> Dict[str, torch.Tensor]:
        """This link's tensors for the by-name contract (``main_param`` only for copies)."""
        state = {
            k: v
            for k, v in self.optimizer.state.get(link.main, {}).items()
            if torch.is_tensor(v) and v.shape == link.main.shape and k != "master_param"  # HDO's host copy
        }
        if link.is_copy and state:
            state["main_param"] = link.main
        return state

    def _step_count(self) -> int:
        for state in self.optimizer.state.values():
            if "step" in state:
                return int(state["step"])
        return 0

    def _scalars(self) -> Dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        scaler = None if self.grad_scaler is None else self.grad_scaler.state_dict()
        return {"param_groups": groups, "step": self._step_count(), "loss_scaler": scaler}

    def state_dict_by_param_name(
        self, model_chunks: Sequence[torch.nn.Module], all_ranks: bool = False
    ) -> Dict[str, Any]:
        """Optimizer state keyed by parameter name, local (TP-shard) shapes, CPU tensors; see the module
        docstring. Collective over data parallelism for the distributed optimizer, where only the ranks
        that write the state to a checkpoint (DP rank 0 of each buffer) get the per-parameter entries,
        unless ``all_ranks``."""
        full = self._full_param_states(all_ranks)
        out: Dict[str, Any] = {}
        for name, param in named_model_params(model_chunks):
            if full.get(id(param)):
                out[name] = full[id(param)]
        out.update(self._scalars())
        return out

    def _full_param_states(self, all_ranks: bool) -> Dict[int, Dict[str, torch.Tensor]]:
        """id(model param) -> CPU copies of its state tensors in the parameter's local shape (a copy on
        the device would double the optimizer's device memory while a checkpoint is written)."""
        return {
            id(link.model): {k: v.detach().to("cpu", copy=True) for k, v in self._param_state(link).items()}
            for link in self.links
        }

    def load_state_dict_by_param_name(self, model_chunks: Sequence[torch.nn.Module], state: Dict[str, Any]) -> None:
        """Restore what ``state_dict_by_param_name`` produced (any DP size; same TP/PP shapes)."""
        by_model = {}
        for link in self.links:
            by_model.setdefault(id(link.model), []).append(link)
        step = int(state.get("step", 0))
        with torch.no_grad():
            for name, param in named_model_params(model_chunks):
                if name in state and name not in _RESERVED:
                    for link in by_model.get(id(param), []):
                        self._load_link(link, state[name], step)
            if isinstance(self.optimizer, HybridDeviceOptimizer):
                self.optimizer._sync_hdo_state_to_sub_optimizers()  # the entries into its inner optimizers
        restore_group_settings(self.optimizer.param_groups, state.get("param_groups", []))
        if self.grad_scaler is not None and state.get("loss_scaler") is not None:
            self.grad_scaler.load_state_dict(state["loss_scaler"])

    def _load_link(self, link: MainLink, saved: Dict[str, Any], step: int) -> None:
        start = int(saved.get("flat_start", 0))
        entry = {k: _piece_of(link, v, start) for k, v in saved.items() if torch.is_tensor(v) and k != "main_param"}
        if entry:
            entry["step"] = self._step_state(link, step)
            self.optimizer.state[link.main] = entry
        if link.is_copy:
            main = saved.get("main_param")
            link.main.copy_(_piece_of(link, main, start) if main is not None else link.model_values())

    def _step_state(self, link: MainLink, step: int) -> torch.Tensor:
        """Adam's ``step`` as torch keeps it: on the parameter's device for the fused (or capturable)
        kernel, which requires it there, else a CPU scalar (the reference loop reads it on the host)."""
        group = next(g for g in self.optimizer.param_groups if any(p is link.main for p in g["params"]))
        device = link.main.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
        return torch.full((), float(step), dtype=torch.float32, device=device)


def _piece_of(link: MainLink, tensor: torch.Tensor, flat_start: int = 0) -> torch.Tensor:
    """``link``'s part of a saved tensor covering the flattened parameter from ``flat_start`` on (the
    whole parameter, or the box ``DistributedOptimizer.sharded_state_template`` read; a checkpoint
    loads on the CPU): an fp32 copy of its own on the main parameter's device, shaped like it."""
    flat = tensor.reshape(-1)  # [numel covered]
    if link.flat_range is not None:
        flat = flat[link.flat_range[0] - flat_start : link.flat_range[1] - flat_start]  # this DP rank's slice
    return flat.to(device=link.main.device, dtype=torch.float32, copy=True).view(link.main.shape)


class FP32Optimizer(MegatronOptimizer):
    """fp32 model parameters updated in place; no loss scaling."""

    def _links_for(self, param: torch.nn.Parameter) -> List[MainLink]:
        return [MainLink(main=param, model=param)]


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """bf16/fp16 model parameters with fp32 main copies (fp32 parameters used directly)."""

    def _links_for(self, param: torch.nn.Parameter) -> List[MainLink]:
        if param.dtype == torch.float32:
            return [MainLink(main=param, model=param)]
        main = torch.nn.Parameter(param.detach().clone().float())
        copy_tensor_model_parallel_attributes(main, param)  # Muon's TP gather reads partition_dim ...
        main.allreduce = getattr(param, "allreduce", True)  # ... and expertness (its TP group)
        return [MainLink(main=main, model=param, is_copy=True)]
