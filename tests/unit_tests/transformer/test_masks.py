"""The one attention-mask builder, against a double loop over (query, key) written from the definition."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.core.context_parallel import cp_chunk_positions
from megatron.core.transformer.masks import build_attention_mask

ROOT = Path(__file__).resolve().parents[3]


def reference(positions, key_length, causal, window):
    """True where query at ``positions[i]`` may not see key ``j``, spelled out case by case."""
    out = torch.zeros(len(positions), key_length, dtype=torch.bool)
    for i, p in enumerate(positions.tolist()):
        for j in range(key_length):
            if causal and j > p:
                out[i, j] = True
            if window is not None and window[0] >= 0 and j < p - window[0]:
                out[i, j] = True
            if window is not None and window[1] >= 0 and j > p + window[1]:
                out[i, j] = True
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, (2, 0), (3, 1), (-1, 2), (1, -1)])
def test_whole_sequence(causal, window):
    got = build_attention_mask(7, 7, causal, window)
    if not causal and window is None:
        assert got is None
        return
    assert torch.equal(got, reference(torch.arange(7), 7, causal, window))


@pytest.mark.parametrize("cp_size, cp_rank", [(2, 0), (2, 1), (4, 2)])
@pytest.mark.parametrize("window", [None, (3, 0)])
def test_context_parallel_queries(cp_size, cp_rank, window):
    """A CP rank's queries are two chunks of the sequence; its keys the whole sequence."""
    positions = cp_chunk_positions(16, cp_size, cp_rank)  # [16/cp]
    got = build_attention_mask(len(positions), 16, True, window, query_positions=positions)
    assert torch.equal(got, reference(positions, 16, True, window))


def test_plain_causal_is_sdpa_causal():
    """The default is the mask SDPA's ``is_causal`` applies (top-left aligned)."""
    q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)  # [b, heads, s, d]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~build_attention_mask(5, 5))
    torch.testing.assert_close(got, expected)


def test_query_positions_shape_is_checked():
    with pytest.raises(ValueError, match=r"query_positions has shape \(3,\), expected \(4,\)"):
        build_attention_mask(4, 8, query_positions=torch.arange(3))


def test_no_other_mask_builder():
    """Causal masks are built in ``transformer/masks.py`` only (no ``triu``/``tril`` elsewhere in megatron/)."""
    builders = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "megatron").rglob("*.py"))
        if path.name != "masks.py" and any(f".{name}(" in path.read_text() for name in ("triu", "tril"))
    ]
    assert builders == []
