"""Core attention's SDPA calls: grouped-query heads through ``enable_gqa`` (same result as repeated
heads, bitwise on the CPU math kernel), repeated heads where an explicit mask is needed, and
``attention_backend=flash`` pinning SDPA to flash attention where flash can run.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer import dot_product_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.gpu.fake_cuda import FakeCuda

S, B, HEADS, GROUPS, D = 6, 2, 8, 2, 4


def _attention(backend: str = "auto", **kw: Any) -> DotProductAttention:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * D,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        attention_backend=backend,
        **kw,
    )
    return DotProductAttention(config, layer_number=1).eval()


def _qkv(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, HEADS, D, generator=g)  # [s, b, heads, d]
    k, v = (torch.randn(S, B, GROUPS, D, generator=g) for _ in range(2))  # [s, b, groups, d]
    return q, k, v


def _recorded_sdpa(monkeypatch) -> List[Dict[str, Any]]:
    calls: List[Dict[str, Any]] = []
    sdpa = F.scaled_dot_product_attention

    def record(q, k, v, **kwargs):
        calls.append(dict(kwargs, kv_heads=k.shape[1]))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    return calls


@pytest.mark.parametrize("masked", [False, True])
def test_grouped_query_attention_equals_repeated_heads(monkeypatch, masked):
    q, k, v = _qkv()
    mask = torch.ones(S, S, dtype=torch.bool).triu(1) if masked else None  # True = blocked
    attn = _attention()
    repeat = HEADS // GROUPS
    expected = attn(q, k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2), mask)
    calls = _recorded_sdpa(monkeypatch)
    assert torch.equal(attn(q, k, v, mask), expected)
    # No explicit mask: is_causal and the groups as they are (flash-eligible); a mask: repeated heads.
    assert calls[0]["enable_gqa"] == (not masked) and calls[0]["kv_heads"] == (HEADS if masked else GROUPS)
    assert calls[0]["is_causal"] == (not masked)


def test_flash_backend_pins_flash_only_where_it_can_run(monkeypatch):
    pinned: List[Any] = []
    monkeypatch.setattr(
        dot_product_attention, "sdpa_kernel", lambda backends: pinned.append(backends) or contextlib.nullcontext()
    )
    with FakeCuda():
        cuda_bf16 = torch.zeros(B, HEADS, S, D, device="cuda", dtype=torch.bfloat16)
        cuda_fp32 = torch.zeros(B, HEADS, S, D, device="cuda")
    mask = torch.zeros(S, S, dtype=torch.bool)
    flash, auto = _attention("flash"), _attention("auto")
    for module, q, m in (
        (flash, cuda_bf16, None),
        (flash, cuda_bf16, mask),
        (flash, cuda_fp32, None),
        (flash, torch.zeros(B, HEADS, S, D, dtype=torch.bfloat16), None),
        (auto, cuda_bf16, None),
    ):
        with module._sdpa_kernel(q, m):
            pass
    assert pinned == [[torch.nn.attention.SDPBackend.FLASH_ATTENTION]]  # only the first: CUDA, bf16, no mask


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_gqa_on_cuda_matches_math():
    q, k, v = (t.cuda().bfloat16() for t in _qkv())
    got = _attention("flash").cuda()(q, k, v, None)  # runs pinned to flash (raises if flash cannot)
    repeat = HEADS // GROUPS
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        expected = _attention().cuda()(
            q.float(), k.float().repeat_interleave(repeat, 2), v.float().repeat_interleave(repeat, 2), None
        )
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def _flash_warnings(run) -> List[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "attention" in str(w.message)]


def test_flash_backend_checks_the_value_head_size_on_the_attention_path(monkeypatch):
    """MLA's values are narrower than its queries and keys: flash is not pinned, and the reason says so."""
    monkeypatch.setattr(dot_product_attention, "_flash_warnings", set())
    q, k, v = (t.transpose(1, 2) for t in _qkv())  # [b, heads, s, d]
    got = _flash_warnings(lambda: _attention("flash")._sdpa(q, k[..., :D], v[..., : D - 2], None, True, 0.0))
    assert len(got) == 1 and f"value head dim {D - 2} != query/key head dim {D}" in got[0], got


def test_flash_backend_warns_once_on_cpu_and_auto_stays_silent(monkeypatch):
    monkeypatch.setattr(dot_product_attention, "_flash_warnings", set())
    q, k, v = _qkv()
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)
    flash, auto = _attention("flash"), _attention("auto")
    assert _flash_warnings(lambda: [auto(q, k, v, m) for m in (None, mask)]) == []
    got = _flash_warnings(lambda: [flash(q, k, v, m) for m in (None, mask, None, mask)])
    assert len(got) == 1, got  # a CPU run: one warning, not one per call or per layer
    assert got[0].startswith("attention_backend=flash") and "tensors on cpu" in got[0], got


def test_flash_backend_names_why_flash_cannot_run(monkeypatch):
    monkeypatch.setattr(dot_product_attention, "sdpa_kernel", lambda backends: contextlib.nullcontext())
    monkeypatch.setattr(dot_product_attention, "_flash_warnings", set())
    with FakeCuda():
        bf16, fp32 = (torch.zeros(B, HEADS, S, D, device="cuda", dtype=t) for t in (torch.bfloat16, torch.float32))
        wide = torch.zeros(B, HEADS, S, 264, device="cuda", dtype=torch.bfloat16)
    flash, mask = _attention("flash"), torch.zeros(S, S, dtype=torch.bool)

    def enter(q, m):
        with flash._sdpa_kernel(q, m):
            pass

    assert _flash_warnings(lambda: enter(bf16, None)) == []
    for q, m, why in (
        (bf16, mask, "explicit attention mask"),
        (fp32, None, "dtype float32"),
        (wide, None, "head dim 264"),
    ):
        got = _flash_warnings(lambda: [enter(q, m), enter(q, m)])
        assert len(got) == 1 and why in got[0] and "attention_backend=flash" in got[0], (why, got)
    with FakeCuda():
        narrow_v = torch.zeros(B, HEADS, S, D - 2, device="cuda", dtype=torch.bfloat16)  # MLA: dv != dqk
    got = _flash_warnings(lambda: [flash._sdpa_kernel(bf16, None, narrow_v).__enter__() for _ in range(2)])
    assert len(got) == 1 and f"value head dim {D - 2} != query/key head dim {D}" in got[0], got
    got = _flash_warnings(lambda: _attention("flash", apply_query_key_layer_scaling=True))
    assert len(got) == 1 and "apply_query_key_layer_scaling=True" in got[0], got
