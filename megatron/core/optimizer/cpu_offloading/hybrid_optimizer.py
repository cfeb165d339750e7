"""``HybridDeviceOptimizer``: part of the parameters is updated by an optimizer on the host.

Megatron-core's class and signature. Of the parameters on an accelerator, the first ones (in
param-group order) up to ``offload_fraction`` of their elements get a host copy that
``cpu_optimizer_cls`` updates: each ``step`` copies their gradients to the host, steps, and copies
the new values back. The other accelerator parameters are updated in place by
``gpu_optimizer_cls``; parameters already on the host go to ``cpu_optimizer_cls`` directly. When
every parameter is on the host (a machine without an accelerator), the host plays the accelerator:
the first ``offload_fraction`` of the elements get a separate host copy stepped by
``cpu_optimizer_cls`` and the others are stepped in place by ``gpu_optimizer_cls`` (upstream steps
them all in place with ``cpu_optimizer_cls``; the values are the same, and the split is observable).
With ``param_update_in_fp32`` a non-fp32 parameter is updated through an fp32 master copy (kept in
its state as ``master_param``).

``state``, ``param_groups``, ``state_dict`` and ``load_state_dict`` speak of the caller's parameters,
as for any torch optimizer; learning-rate changes to ``param_groups`` reach the inner optimizers at
the next ``step``. The copies are synchronous: ``overlap_cpu_optimizer_d2h_h2d`` (upstream's side
streams) and the pinning switches are accepted and change nothing here.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def _all_on_host(groups: List[Dict[str, Any]]) -> bool:
    return all(_on_host(p) for g in groups for p in g["params"])


class HybridDeviceOptimizer(torch.optim.Optimizer):
    """See the module docstring."""

    def __init__(
        self,
        params: Any,
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: Optional[Callable[..., torch.optim.Optimizer]] = None,
        gpu_optimizer_cls: Optional[Callable[..., torch.optim.Optimizer]] = None,
        param_update_in_fp32: bool = False,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        overlap_cpu_optimizer_d2h_h2d: bool = True,
        **kwargs: Any,
    ) -> None:
        if not 0.0 <= offload_fraction <= 1.0:
            raise ValueError(f"offload_fraction={offload_fraction}: must be in [0, 1]")
        defaults = dict(
            offload_fraction=offload_fraction,
            cpu_optimizer_cls=cpu_optimizer_cls,
            gpu_optimizer_cls=gpu_optimizer_cls,
            param_update_in_fp32=param_update_in_fp32,
            pin_cpu_grads=pin_cpu_grads,
            pin_cpu_params=pin_cpu_params,
            overlap_cpu_optimizer_d2h_h2d=overlap_cpu_optimizer_d2h_h2d,
            **kwargs,
        )
        super().__init__(params, defaults)
        self.offload_fraction, self.param_update_in_fp32 = offload_fraction, param_update_in_fp32
        self.cpu_optimizer_cls, self.gpu_optimizer_cls = cpu_optimizer_cls, gpu_optimizer_cls
        self.pin_cpu_grads, self.pin_cpu_params = pin_cpu_grads, pin_cpu_params
        self.overlap_cpu_optimizer_d2h_h2d = overlap_cpu_optimizer_d2h_h2d
        self.sub_optimizer_kwargs = kwargs
        self._init_sub_optimizers()

    def _inner_copy(self, param: torch.Tensor, offload: bool) -> torch.Tensor:
        """The tensor the inner optimizer updates for ``param``: itself, a host copy and/or an fp32 copy."""
        inner = param.detach().to("cpu", copy=True) if offload else param
        if self.param_update_in_fp32 and inner.dtype != torch.float32:
            inner = inner.detach().float()  # a copy: the master weights
        return inner

    def _init_sub_optimizers(self) -> None:
        """Split every group into a host part and an accelerator part and build the inner optimizers."""
        host_is_device = _all_on_host(self.param_groups)  # no accelerator: the host plays it

        def on_device(param: torch.Tensor) -> bool:
            return host_is_device or not _on_host(param)

        device_numel = sum(p.numel() for g in self.param_groups for p in g["params"] if on_device(p))
        budget, offloaded = device_numel * self.offload_fraction, 0
        self.offloaded_params: List[torch.Tensor] = []  # the caller's parameters updated through a host copy
        self.param_to_inner_param: Dict[torch.Tensor, torch.Tensor] = {}
        host_groups, device_groups = [], []
        self._group_pairs: List[Tuple[int, Dict[str, Any]]] = []  # (index in self.param_groups, inner group)
        for index, group in enumerate(self.param_groups):
            host, device = [], []
            for param in group["params"]:
                offload = on_device(param) and offloaded < budget
                offloaded += param.numel() if offload else 0
                inner = self._inner_copy(param, offload)
                self.param_to_inner_param[param] = inner
                if offload:
                    self.offloaded_params.append(param)
                to_host = offload or (_on_host(param) and not host_is_device)
                (host if to_host else device).append(inner)
            for inner_params, groups in ((host, host_groups), (device, device_groups)):
                if inner_params:
                    groups.append((index, {**self._hyper(group), "params": inner_params}))
        self.inner_param_to_orig_param = {v: k for k, v in self.param_to_inner_param.items()}
        self.cpu_optimizers = self._build(self.cpu_optimizer_cls, host_groups, "cpu_optimizer_cls")
        built = self._build(self.gpu_optimizer_cls, device_groups, "gpu_optimizer_cls")
        self.gpu_optimizer = built[0] if built else None

    def _build(self, cls: Optional[Callable], pairs: List[Tuple[int, Dict]], name: str) -> List[torch.optim.Optimizer]:
        if not pairs:
            return []
        if cls is None:
            raise ValueError(f"HybridDeviceOptimizer: {name} is None but parameters need it")
        optimizer = cls([group for _, group in pairs])
        # torch copies the group dicts: pair each HDO group index with the inner optimizer's own dict.
        self._group_pairs += [(index, inner) for (index, _), inner in zip(pairs, optimizer.param_groups)]
        return [optimizer]

    @staticmethod
    def build_cpu_optimizer_list(
        cpu_optimizer_cls: Callable[..., torch.optim.Optimizer], cpu_param_groups: List[Dict[str, Any]]
    ) -> List[torch.optim.Optimizer]:
        """One ``cpu_optimizer_cls`` per parameter, each with its group's settings (upstream's unit of overlap)."""
        optimizers = []
        for group in cpu_param_groups:
            params = group["params"]
            settings = {k: v for k, v in group.items() if k != "params"}
            for param in [params] if isinstance(params, torch.Tensor) else params:
                optimizers.append(cpu_optimizer_cls([{**settings, "params": [param]}]))
        return optimizers

    @torch.no_grad()
    def update_fp32_param_by_new_param(self) -> None:
        """Copy the parameters' current values into their host / fp32 copies (after the model was changed)."""
        for param, inner in self._copied_pairs():
            inner.copy_(param)

    @staticmethod
    def _hyper(group: Dict[str, Any]) -> Dict[str, Any]:
        skip = {"params", "cpu_optimizer_cls", "gpu_optimizer_cls", "offload_fraction", "param_update_in_fp32"}
        skip |= {"pin_cpu_grads", "pin_cpu_params", "overlap_cpu_optimizer_d2h_h2d"}
        return {k: v for k, v in group.items() if k not in skip}

    @property
    def sub_optimizers(self) -> List[torch.optim.Optimizer]:
        """The host optimizers, then the accelerator one (if any parameter stays there)."""
        return self.cpu_optimizers + ([self.gpu_optimizer] if self.gpu_optimizer is not None else [])

    def _copied_pairs(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        return [(p, inner) for p, inner in self.param_to_inner_param.items() if inner is not p]

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None) -> Optional[Any]:
        """Hyper-parameters to the inner groups, gradients to the copies, inner steps, values back."""
        for index, inner_group in self._group_pairs:
            inner_group.update(self._hyper(self.param_groups[index]))
        for param, inner in self._copied_pairs():
            grad = getattr(param, "decoupled_grad", None)
            grad = param.grad if grad is None else grad
            inner.grad = None if grad is None else grad.to(inner.device, inner.dtype)
        loss = None
        for optimizer in self.sub_optimizers:
            loss = optimizer.step(closure)
        for param, inner in self._copied_pairs():
            param.copy_(inner)
        self._sync_state_from_inner()
        return loss

    def _sync_state_from_inner(self) -> None:
        state: Dict[torch.Tensor, Dict[str, Any]] = {}
        for optimizer in self.sub_optimizers:
            for inner, inner_state in optimizer.state.items():
                param = self.inner_param_to_orig_param[inner]
                state[param] = inner_state
                if self.param_update_in_fp32 and inner is not param and inner.dtype == torch.float32:
                    inner_state["master_param"] = inner
        self.state = state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's load, onto the inner tensors (so fp32 masters keep fp32 state), handed to the inner optimizers.

        Host and fp32 copies are refreshed from the parameters first (a model may be loaded after the
        optimizer was built); a saved ``master_param`` then wins for the fp32 copy, as upstream.
        """
        originals = [list(group["params"]) for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [self.param_to_inner_param[p] for p in group["params"]]
        try:
            super().load_state_dict(state_dict)
        finally:
            for group, params in zip(self.param_groups, originals):
                group["params"] = params
        self.state = {self.inner_param_to_orig_param[inner]: st for inner, st in self.state.items()}
        self._sync_hdo_state_to_sub_optimizers()

    @torch.no_grad()
    def _sync_hdo_state_to_sub_optimizers(self) -> None:
        """Hand ``self.state`` (keyed by the caller's parameters, e.g. just loaded) to the inner optimizers.

        The host / fp32 copies are refreshed from the parameters first; a ``master_param`` in the
        state then wins for the fp32 copy. Moment tensors move to their copy's device, Adam's ``step``
        to where the inner group's kernel reads it (the device for fused / capturable, else the host).
        """
        self.update_fp32_param_by_new_param()
        owner = {p: (opt, g) for opt in self.sub_optimizers for g in opt.param_groups for p in g["params"]}
        for optimizer in self.sub_optimizers:
            optimizer.state.clear()
        for param, param_state in self.state.items():
            inner = self.param_to_inner_param[param]
            optimizer, group = owner[inner]
            master = param_state.pop("master_param", None)
            if master is not None:
                inner.copy_(master)
            on_device = group.get("fused") or group.get("capturable")
            optimizer.state[inner] = {
                k: v.to(inner.device if v.dim() > 0 or on_device else "cpu") if torch.is_tensor(v) else v
                for k, v in param_state.items()
            }
        self._sync_state_from_inner()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The caller's gradients (``decoupled_grad`` too) and the copies' gradients."""
        super().zero_grad(set_to_none)
        for param, inner in self._copied_pairs():
            inner.grad = None
            if getattr(param, "decoupled_grad", None) is not None:
                param.decoupled_grad = None if set_to_none else param.decoupled_grad.zero_()

    def dummy_step(self) -> None:
        """Create every parameter's optimizer state (e.g. before loading a checkpoint into it in place).

        Upstream steps on random gradients; here the parameters (and their copies) are put back
        afterwards, so only the state's existence changes, not the model.
        """
        saved = {p: p.detach().clone() for g in self.param_groups for p in g["params"]}
        for param in saved:
            param.grad = torch.randn_like(param)
        self.step()
        with torch.no_grad():
            for param, value in saved.items():
                param.copy_(value)
                self.param_to_inner_param[param].copy_(value)
        self.zero_grad()
