"""Loss scalers for fp16 training: a constant scale, or Megatron's dynamic scale.

Dynamic rule (Megatron's): on a step with an inf/NaN gradient the step is skipped,
the growth counter restarts and the hysteresis counter drops by one; once it reaches
zero the scale is multiplied by ``backoff_factor`` (not below ``min_scale``). After
``growth_interval`` consecutive clean steps the scale is multiplied by
``growth_factor`` and the hysteresis counter is refilled.

The scale lives on the parameters' device (``to(device)``, called by the optimizer), so
scaling a loss and unscaling gradients never copy between host and device; the step reads
the found-inf flag once, and ``update`` takes that Python bool.
"""

from __future__ import annotations

from typing import Any, Dict

import torch


class MegatronGradScaler:
    """Holds the current loss scale (a float32 tensor ``[1]``) and updates it after each step."""

    def __init__(self, initial_scale: float) -> None:
        if initial_scale <= 0:
            raise ValueError(f"initial_scale={initial_scale}: must be > 0")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32)

    def to(self, device: torch.device) -> MegatronGradScaler:
        """Keep the scale on ``device`` (the parameters' device) from now on; returns self."""
        self._scale = self._scale.to(device)
        return self

    @property
    def device(self) -> torch.device:
        return self._scale.device

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        raise NotImplementedError


class ConstantGradScaler(MegatronGradScaler):
    """A fixed scale (``--loss-scale``); inf/NaN steps are still skipped."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": float(self._scale.item())}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        pass  # the flag wins over the checkpoint for a constant scale


class DynamicGradScaler(MegatronGradScaler):
    """Backs off on overflow (after ``hysteresis`` overflows), grows after a clean window."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        super().__init__(initial_scale)
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"min_scale={min_scale}: must be in (0, initial_scale={initial_scale}]")
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"growth_factor={growth_factor} must be > 1 and backoff_factor={backoff_factor} in (0, 1)")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"growth_interval={growth_interval}, hysteresis={hysteresis}: must be >= 1")
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.clamp(self._scale * self.backoff_factor, min=self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale = self._scale * self.growth_factor

    def state_dict(self) -> Dict[str, Any]:
        return {
            "scale": float(self._scale.item()),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._scale = torch.tensor([float(state_dict["scale"])], dtype=torch.float32, device=self.device)
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
