"""TransformerConfig validation and derived defaults; pipeline layer layout as data."""

import warnings

import pytest

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.layer_layout import pipeline_layer_assignment


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8)
    base.update(kw)
    return TransformerConfig(**base)


@pytest.mark.parametrize(
    "kw, words",
    [
        (
            dict(num_attention_heads=6, tensor_model_parallel_size=4),
            ["num_attention_heads=6", "tensor_model_parallel_size=4"],
        ),
        (
            dict(num_query_groups=2, tensor_model_parallel_size=4),
            ["num_query_groups=2", "tensor_model_parallel_size=4"],
        ),
        (dict(hidden_size=60, num_attention_heads=8), ["hidden_size=60", "num_attention_heads=8"]),
        (dict(num_query_groups=3), ["num_attention_heads=8", "num_query_groups=3"]),
        (dict(normalization="BatchNorm"), ["normalization='BatchNorm'"]),
        (dict(hidden_dropout=1.5), ["hidden_dropout=1.5"]),
        (dict(fp16=True, bf16=True), ["fp16", "bf16"]),
        (dict(num_layers=0), ["num_layers=0"]),
        (dict(recompute_granularity="full"), ["recompute_method=None"]),
        (dict(ffn_hidden_size=30, tensor_model_parallel_size=4), ["ffn_hidden_size=30"]),
        (dict(window_size=(4,)), ["window_size=(4,)", "(left, right)"]),
        (dict(window_size=(4, -2)), ["window_size=(4, -2)"]),
    ],
)
def test_invalid_settings_name_the_field(kw, words):
    with pytest.raises(ValueError) as info:
        _cfg(**kw)
    for word in words:
        assert word in str(info.value)


def test_derived_defaults():
    c = _cfg()
    assert c.kv_channels == 64 // 8 and c.ffn_hidden_size == 4 * 64 and c.num_query_groups == 8


def test_sequence_parallel_without_tp_warns_and_disables():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = _cfg(sequence_parallel=True, tensor_model_parallel_size=1)
    assert not c.sequence_parallel
    assert any("sequence_parallel" in str(w.message) for w in caught)


def _flatten_in_model_order(layout):
    vp = len(layout[0])
    return [n for chunk in range(vp) for rank in range(len(layout)) for n in layout[rank][chunk]]


@pytest.mark.parametrize(
    "layers, pp, vp, first, last",
    [
        (8, 1, None, None, None),
        (8, 2, None, None, None),
        (8, 4, 2, None, None),
        (10, 4, None, 1, 3),
        (12, 2, 3, None, None),
        (7, 3, None, 3, None),
    ],
)
def test_layer_layout_covers_every_layer_once_in_order(layers, pp, vp, first, last):
    layout = pipeline_layer_assignment(layers, pp, vp, first, last)
    assert _flatten_in_model_order(layout) == list(range(1, layers + 1))
    if first is not None:
        assert sum(len(c) for c in layout[0]) == first
    if last is not None:
        assert sum(len(c) for c in layout[-1]) == last


@pytest.mark.parametrize(
    "layers, pp, vp, first, last, word",
    [
        (7, 2, None, None, None, "num_layers=7"),
        (8, 2, 3, None, None, "virtual pipeline"),
        (10, 4, None, 1, 2, "num_layers_in_first_pipeline_stage=1"),
    ],
)
def test_impossible_layer_layouts_fail_clearly(layers, pp, vp, first, last, word):
    with pytest.raises(ValueError, match=word):
        pipeline_layer_assignment(layers, pp, vp, first, last)


V4_ATTENTION = dict(
    compressed_attention_layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
    q_lora_rank=16, attention_output_groups=2, attention_output_lora_rank=8, window_size=(7, 0),
    normalization="RMSNorm", dsa_indexer_n_heads=2, dsa_indexer_head_dim=8, dsa_indexer_topk=4,
)  # fmt: skip


@pytest.mark.parametrize(
    "kw, words",
    [
        (
            dict(compressed_attention_layer_types=["compressed_sparse_attention"]),
            ["compressed_attention_layer_types", "per layer"],
        ),
        (dict(window_size=None), ["window_size=None", "(W - 1, 0)"]),
        (dict(attention_output_groups=3), ["num_attention_heads=8", "attention_output_groups=3"]),
        (dict(dsa_indexer_topk=None), ["dsa_indexer_topk=None"]),
        (dict(context_parallel_size=2), ["context_parallel_size=2", "CP splits"]),
        (dict(multi_latent_attention=True), ["replaces multi-latent attention"]),
        (dict(moe_num_hash_layers=1), ["moe_num_hash_layers=1", "num_moe_experts"]),
    ],
)
def test_deepseek_v4_settings_are_checked(kw, words):
    """DeepSeek-V4's fields (deepseek_v4_checks.py): each broken rule names the field, its value and the rule."""
    _cfg(**V4_ATTENTION)  # the base is valid
    with pytest.raises(ValueError) as info:
        _cfg(**dict(V4_ATTENTION, **kw))
    for word in words:
        assert word in str(info.value)
