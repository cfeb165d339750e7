"""Several optimizers stepped as one (Megatron-core's ``ChainedOptimizer``) and the ``ProxyDict`` that joins their
state; ``megatron.core.optimizer.optimizer`` re-exports both."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32


class ProxyDict:
    """Several dicts seen as one keyed by ``(index of the dict, its key)`` (Megatron-core's class).

    ``ProxyDict([{"a": 1}, {"b": 2}])`` holds ``(0, "a") -> 1`` and ``(1, "b") -> 2``; writes go
    to the inner dict, reads of an absent key give None (as upstream).
    """

    def __init__(self, inner_dicts: List[dict]) -> None:
        self._inner_dicts = inner_dicts

    def __getitem__(self, key: Tuple[int, Any]) -> Any:
        index, inner_key = key
        return self._inner_dicts[index].get(inner_key)

    def __setitem__(self, key: Tuple[int, Any], value: Any) -> None:
        index, inner_key = key
        self._inner_dicts[index][inner_key] = value

    def __len__(self) -> int:
        return sum(len(inner) for inner in self._inner_dicts)

    def __iter__(self) -> Iterator[Tuple[int, Any]]:
        return ((index, key) for index, inner in enumerate(self._inner_dicts) for key in inner)

    def items(self) -> Iterator[Tuple[Tuple[int, Any], Any]]:
        """``((index, key), value)`` over every inner dict."""
        return (((index, key), v) for index, inner in enumerate(self._inner_dicts) for key, v in inner.items())


class ChainedOptimizer:
    """Several optimizers over disjoint parameters stepped as one (Megatron-core's class).

    ``get_megatron_optimizer`` returns one optimizer for dense and expert parameters (its norm
    already spans both), so this is for callers that build their own list. As upstream, the
    optimizers may be plain torch optimizers (no ``config``): ``param_groups``, ``state`` (a
    ``ProxyDict`` keyed by ``(optimizer index, parameter)``), ``zero_grad``, ``state_dict`` /
    ``load_state_dict`` and the list itself work for any; ``step`` needs ``MegatronOptimizer``s. The
    gradient norm is the root of the sum of each optimizer's squared global norm; an inf/NaN in any
    skips every step; the clip threshold is the shared ``config.clip_grad``. An empty list is a stub
    (a rank without trainable parameters).
    """

    def __init__(self, chained_optimizers: Sequence[Any]) -> None:
        self.chained_optimizers = list(chained_optimizers)
        self.config = getattr(self.chained_optimizers[0], "config", None) if self.chained_optimizers else None
        if any(getattr(opt, "config", None) != self.config for opt in self.chained_optimizers):
            raise ValueError("ChainedOptimizer: every chained optimizer must have the same config")
        self.model_chunks: List[torch.nn.Module] = []
        for opt in self.chained_optimizers:
            self.model_chunks += [c for c in getattr(opt, "model_chunks", []) if c not in self.model_chunks]
        self.is_stub_optimizer = all(getattr(opt, "is_stub_optimizer", False) for opt in self.chained_optimizers)

    @property
    def optimizer(self) -> Any:
        """The single chained optimizer's inner torch optimizer (upstream's backward-compatible alias)."""
        if len(self.chained_optimizers) != 1:
            raise ValueError(f"ChainedOptimizer.optimizer: {len(self.chained_optimizers)} optimizers chained, not 1")
        return self.chained_optimizers[0].optimizer

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return [group for opt in self.chained_optimizers for group in opt.param_groups]

    @property
    def state(self) -> ProxyDict:
        return ProxyDict([opt.state for opt in self.chained_optimizers])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.chained_optimizers:
            opt.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        if not self.chained_optimizers:  # a stub: no loss scaling
            return torch.tensor([1.0], dtype=torch.float32)
        return self.chained_optimizers[0].get_loss_scale()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.chained_optimizers[0].scale_loss(loss)

    def reload_model_params(self, state_dict: Optional[Dict[str, Any]] = None) -> None:
        for opt in self.chained_optimizers:
            opt.reload_model_params(state_dict)

    def state_dict(self) -> Union[Dict[str, Any], List[Dict[str, Any]]]:
        """The one optimizer's state dict, or the list of them (upstream's shapes)."""
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].state_dict()
        return [opt.state_dict() for opt in self.chained_optimizers]

    def load_state_dict(self, state_dict: Union[Dict[str, Any], Sequence[Dict[str, Any]]]) -> None:
        if len(self.chained_optimizers) == 1:
            self.chained_optimizers[0].load_state_dict(state_dict)
            return
        if isinstance(state_dict, dict):  # {index: state} as some writers key them
            state_dict = [v for _, v in sorted(state_dict.items())]
        if len(state_dict) != len(self.chained_optimizers):
            raise ValueError(f"{len(state_dict)} states for {len(self.chained_optimizers)} chained optimizers")
        for opt, state in zip(self.chained_optimizers, state_dict):
            opt.load_state_dict(state)

    def prepare_grads(self) -> bool:
        """Prepare every optimizer's grads (each runs its collectives); True if any found inf/NaN."""
        found = [opt.prepare_grads() for opt in self.chained_optimizers]
        return any(found)

    def get_grad_norm(self) -> float:
        return sum(opt.get_grad_norm() ** 2 for opt in self.chained_optimizers) ** 0.5

    def count_zeros(self) -> int:
        return sum(opt.count_zeros() for opt in self.chained_optimizers)

    def step_with_ready_grads(self) -> bool:
        return all([opt.step_with_ready_grads() for opt in self.chained_optimizers])

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        """One update of every optimizer. Returns (update_successful, grad_norm, num_zeros_in_grad)."""
        if self.config is None:
            raise ValueError("ChainedOptimizer.step needs MegatronOptimizers (a config); step plain torch optimizers")
        if self.prepare_grads():
            return False, None, None
        grad_norm = self.get_grad_norm()
        if self.config.clip_grad > 0.0:
            for opt in self.chained_optimizers:
                clip_grad_by_total_norm_fp32(opt.main_grads(), self.config.clip_grad, grad_norm)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        return self.step_with_ready_grads(), grad_norm, num_zeros
