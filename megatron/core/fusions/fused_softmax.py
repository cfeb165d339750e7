"""Scale + mask + softmax of explicit attention scores (``--no-masked-softmax-fusion`` turns the fusion off).

SDPA serves the attention backends ``auto``, ``flash`` and ``fused``. The explicit-score path
(``DotProductAttention._unfused``: ``--attention-backend unfused``/``local``, or query-key layer scaling)
forms ``q k^T`` and then scales, upcasts, masks and normalises it: op by op, each a pass over the
``[b, heads, sq, sk]`` scores (``scale_mask_softmax``, the reference), or as one region compiled by
``torch.compile`` (``fused_scale_mask_softmax``, Megatron's ``FusedScaleMaskSoftmax``), whose backward is
the region's derivative compiled with it. Attention dropout stays outside either (the same RNG draws).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.fusions.jit import jit_fuser


def scale_mask_softmax(
    scores: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    coeff: float,
    in_fp32: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``softmax(scores * scale / coeff [-> fp32] * coeff [+ mask])`` ``[b, heads, sq, sk]`` in ``out_dtype``.

    ``coeff`` is query-key layer scaling's layer number (1 without it): the scores are divided by it in
    their own dtype and multiplied back after the fp32 upcast. ``mask`` (broadcastable to the scores) is
    boolean (True: blocked, filled with the dtype's minimum) or additive (a position bias with the blocked
    positions already at the minimum); None: nothing blocked.
    """
    scores = scores * (scale / coeff)
    if in_fp32:
        scores = scores.float()
    scores = scores * coeff
    if mask is not None and mask.is_floating_point():
        scores = scores + mask
    elif mask is not None:
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1).to(out_dtype)


fused_scale_mask_softmax = jit_fuser(scale_mask_softmax)
