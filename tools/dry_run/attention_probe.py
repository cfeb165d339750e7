"""Which attention kernel each call could use on a GPU.

Rule for "flash-eligible" (PyTorch's flash-attention backend of
``scaled_dot_product_attention`` on sm80+): no explicit ``attn_mask`` (none, or
``is_causal=True``), query/key/value in fp16 or bf16, head dim at most 256 and a multiple
of 8, the last dimension contiguous, and on CUDA. Dropout is allowed. Any other SDPA call
falls back to the memory-efficient or math kernel; the unfused path
(``DotProductAttention._unfused``: explicit softmax over ``[b, heads, s, s]`` scores) is
never flash.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F

from tools.dry_run.fake_cuda import Patcher
from tools.dry_run.report import Recorder

FLASH_HEAD_DIM_MAX = 256


def flash_verdict(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
) -> Tuple[bool, str]:
    """(eligible, reasons it is not) for one SDPA call (see the module docstring)."""
    reasons: List[str] = []
    if attn_mask is not None:
        reasons.append(f"explicit attn_mask {list(attn_mask.shape)}")
    if query.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"dtype {str(query.dtype).replace('torch.', '')}")
    head_dim = query.shape[-1]
    if head_dim > FLASH_HEAD_DIM_MAX or head_dim % 8:
        reasons.append(f"head dim {head_dim} (needs <= {FLASH_HEAD_DIM_MAX}, multiple of 8)")
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        reasons.append("last dimension not contiguous")
    if query.device.type != "cuda":
        reasons.append(f"on {query.device}")
    return not reasons, "; ".join(reasons)


def install_attention_probe(patcher: Patcher, recorder: Recorder) -> None:
    """Record every SDPA call with its flash verdict, and every unfused attention call."""
    from megatron.core.transformer.attention import DotProductAttention

    original_sdpa = F.scaled_dot_product_attention
    original_unfused = DotProductAttention._unfused

    def scaled_dot_product_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: Optional[float] = None,
        **kwargs: Any,
    ) -> Any:
        eligible, why = flash_verdict(query, key, value, attn_mask)
        shape = f"q{list(query.shape)} {str(query.dtype).replace('torch.', '')}"
        recorder.add(
            "attention",
            "SDPA: flash" if eligible else f"SDPA: not flash ({why})",
            {"flash": eligible, "shape": shape, "is_causal": is_causal, "dropout_p": dropout_p},
        )
        return original_sdpa(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs
        )

    def unfused(self: Any, q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        recorder.add("attention", "unfused softmax: not flash", {"flash": False, "shape": f"q{list(q.shape)}"})
        return original_unfused(self, q, *args, **kwargs)

    patcher.set(F, "scaled_dot_product_attention", scaled_dot_product_attention)
    patcher.set(DotProductAttention, "_unfused", unfused)
