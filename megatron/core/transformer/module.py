"""MegatronModule: the base of every core module, holding its config."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.state_dict import module_sharded_state_dict
from megatron.core.quantization.recipes import LinearQuantizer
from megatron.core.transformer.transformer_config import TransformerConfig


class MegatronModule(torch.nn.Module):
    """A ``torch.nn.Module`` built from a ``TransformerConfig``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: Tuple[Tuple[int, int, int], ...] = (), metadata: Optional[dict] = None
    ) -> ShardedStateDict:
        """Megatron-core's sharded state dict of this module, for ``dist_checkpointing.save`` / ``load``.

        Keyed by ``prefix`` + this module's ``state_dict`` names (so the dict ``load`` returns goes into
        ``load_state_dict``); each ShardedTensor's key is layout-free (global layer and expert indices),
        sharded over the process groups the module was built with (``self.pg_collection``).

        Args:
            prefix: prepended to every name and checkpoint key.
            sharded_offsets: not supported yet (Megatron-core's extra leading axes); must be empty.
            metadata: Megatron-core's checkpoint-format switches; none is supported yet, so None or {}.

        Raises:
            NotImplementedError: ``sharded_offsets`` or ``metadata`` given.
            ValueError: the module has no ``pg_collection``.
        """
        if tuple(sharded_offsets) or metadata:
            raise NotImplementedError(
                f"{type(self).__name__}.sharded_state_dict: not supported yet: "
                f"sharded_offsets={sharded_offsets!r}, metadata={metadata!r}"
            )
        return module_sharded_state_dict(self, prefix)

    def set_is_first_microbatch(self) -> None:
        """Megatron's new-step mark: quantized weights cached for the step are quantized again at
        their next use (``LinearQuantizer.invalidate_weight_cache``; TE linears: ``is_first_microbatch``)."""
        for module in self.modules():
            if isinstance(module, LinearQuantizer):
                module.invalidate_weight_cache()
            elif getattr(module, "te_parallel_mode", None):  # a Transformer Engine linear: cast its weight again
                module.is_first_microbatch = True


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """Megatron-core's test: False for a parameter marked ``shared`` (counted once elsewhere)."""
    return not getattr(param, "shared", False)


def conversion_helper(val: Any, conversion: Any) -> Any:
    """``conversion`` applied to every leaf of nested tuples and lists (Megatron-core's helper)."""
    if isinstance(val, (tuple, list)):
        converted = [conversion_helper(v, conversion) for v in val]
        return tuple(converted) if isinstance(val, tuple) else converted
    return conversion(val)


def fp32_to_float16(val: Any, float16_convertor: Any) -> Any:
    """fp32 tensors (nested in tuples and lists) passed through ``float16_convertor``; others as they are."""
    return conversion_helper(
        val, lambda v: float16_convertor(v) if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v
    )


def float16_to_fp32(val: Any) -> Any:
    """fp16 and bf16 tensors (nested in tuples and lists) made fp32; others as they are."""
    half = (torch.float16, torch.bfloat16)
    return conversion_helper(val, lambda v: v.float() if isinstance(v, torch.Tensor) and v.dtype in half else v)


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor (in tuples, lists and dicts too) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


class Float16Module(MegatronModule):
    """Megatron-core's half-precision wrapper: the module's parameters in fp16 or bf16.

    ``config.fp16`` or ``config.bf16`` picks the dtype. The wrapped module's first pipeline stage
    (``pre_process``) gets its floating-point inputs cast to it; its last stage (``post_process``)
    returns floating-point outputs in fp32 unless ``fp32_output=False``. The stage is read from the
    module itself, not from ``parallel_state``. State dicts are the wrapped module's (no ``module.``
    prefix), as in Megatron-core.

    Raises:
        ValueError: neither ``config.fp16`` nor ``config.bf16`` is set.
    """

    def __init__(self, config: TransformerConfig, module: torch.nn.Module) -> None:
        super().__init__(config)
        if not (config.fp16 or config.bf16):
            raise ValueError("Float16Module: config.fp16 or config.bf16 must be True (both are False)")
        self.fp16, self.bf16 = config.fp16, config.bf16
        self.dtype = torch.float16 if config.fp16 else torch.bfloat16
        self.module = module.to(self.dtype)
        self.vp_stage = getattr(module, "vp_stage", None)
        self.pg_collection = getattr(module, "pg_collection", None)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Hand the previous pipeline stage's activation to the wrapped module."""
        self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs: Any, fp32_output: bool = True, **kwargs: Any) -> Any:
        """Run the wrapped module in half precision (see the class docstring)."""
        if getattr(self.module, "pre_process", True):
            inputs, kwargs = _cast_floats(inputs, self.dtype), _cast_floats(kwargs, self.dtype)
        outputs = self.module(*inputs, **kwargs)
        if fp32_output and getattr(self.module, "post_process", True):
            outputs = _cast_floats(outputs, torch.float32)
        return outputs

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The wrapped module's state dict."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True) -> Any:
        """Load into the wrapped module."""
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, prefix: str = "", *args: Any, **kwargs: Any) -> ShardedStateDict:
        """The wrapped module's sharded state dict."""
        return self.module.sharded_state_dict(prefix, *args, **kwargs)
