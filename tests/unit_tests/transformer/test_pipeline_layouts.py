"""Custom pipeline splits: ``PipelineParallelLayerLayout``, ``pipeline_model_parallel_layout`` and
``account_for_{embedding,loss}_in_pipeline_split``, checked against layouts written out by hand and, for
training, against the PP=1 model (loss, gradients and weights after SGD steps)."""

from __future__ import annotations

import pytest

from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from tests.dist_harness import run_distributed
from tests.model_utils import gpt2_style
from tests.unit_tests.pipeline_parallel.pipeline_parity import build_chunks, check_parity

E, T, M, L = LayerType.embedding, LayerType.decoder, LayerType.mtp, LayerType.loss


def _config(**kw):
    return TransformerConfig(**{**dict(num_layers=5, hidden_size=8, num_attention_heads=2), **kw})


def test_layout_strings_unroll_into_stages():
    assert PipelineParallelLayerLayout.parse_str_to_list("E,t*2|(tt|)*2m,L") == [[E, T, T], [T, T], [T, T], [M, L]]
    assert PipelineParallelLayerLayout.get_num_stages_from_str("Et||tL") == 3
    with pytest.raises(ValueError, match=r"unknown layer characters \['x'\]"):
        PipelineParallelLayerLayout.parse_str_to_list("Etx|L")


def test_layout_places_stages_chunk_major():
    # Running order: rank0/chunk0, rank1/chunk0, rank0/chunk1, rank1/chunk1.
    layout = PipelineParallelLayerLayout("Et|ttt||tL", pipeline_model_parallel_size=2)
    assert layout.virtual_pipeline_model_parallel_size == 2
    assert layout.layout == [[[E, T], []], [[T, T, T], [T, L]]]
    assert layout.flatten_layout == [E, T, T, T, T, T, L]
    expected = {(0, 0): [0], (1, 0): [1, 2, 3], (0, 1): [], (1, 1): [4]}  # decoder indices by (pp, vp)
    for (pp, vp), ids in expected.items():
        assert layout.get_layer_id_list(vp_stage=vp, pp_rank=pp) == ids
        assert layout.get_num_layers_to_build(vp_stage=vp, pp_rank=pp) == len(ids)
    assert layout.get_num_layers_to_build(LayerType.embedding, 0, 0) == 1
    assert layout.get_layer_offset(LayerType.loss, vp_stage=1, pp_rank=1) == 0
    assert "PP rank 0    embedding,decoder    (empty stage)" in layout.pretty_repr()
    with pytest.raises(ValueError, match="vp_stage must be given"):
        layout.get_num_layers_to_build(pp_rank=0)
    with pytest.raises(ValueError, match="not a multiple of pipeline_model_parallel_size=2"):
        PipelineParallelLayerLayout("Et|t|tL", 2)


@pytest.mark.parametrize(
    "text, mtp, problem",
    [
        ("tE|ttttL", None, "embedding"),
        ("Ettt|tLt", None, "loss"),
        ("Ett|tL", None, "3 decoder layers"),
        ("Etttt|mtL", 1, "decoder layers must come before"),
        ("Ettt|ttL", 1, "MTP"),
    ],
)
def test_layout_must_hold_the_model(text, mtp, problem):
    with pytest.raises(ValueError, match=problem):
        _config(pipeline_model_parallel_size=2, pipeline_model_parallel_layout=text, mtp_num_layers=mtp)


def test_config_reads_the_layout():
    config = _config(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|ttt||tL")
    assert isinstance(config.pipeline_model_parallel_layout, PipelineParallelLayerLayout)
    assert config.virtual_pipeline_model_parallel_size == 2  # from the layout
    counts = {(pp, vp): get_num_layers_to_build(config, vp_stage=vp, pp_rank=pp) for pp in (0, 1) for vp in (0, 1)}
    assert counts == {(0, 0): 1, (1, 0): 3, (0, 1): 0, (1, 1): 1}
    assert get_transformer_layer_offset(config, vp_stage=1, pp_rank=1) == 4
    with pytest.raises(ValueError, match="1 chunk"):
        _config(
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            pipeline_model_parallel_layout="Ett|tttL",
        )
    with pytest.raises(ValueError, match="cannot be combined"):
        _config(
            pipeline_model_parallel_size=2,
            pipeline_model_parallel_layout="Ett|tttL",
            num_layers_in_first_pipeline_stage=2,
        )


@pytest.mark.parametrize(
    "kw, counts",
    [
        (
            dict(num_layers=7, pipeline_model_parallel_size=4, account_for_embedding_in_pipeline_split=True),
            [1, 2, 2, 2],
        ),
        (
            dict(num_layers=6, pipeline_model_parallel_size=4, account_for_embedding_in_pipeline_split=True)
            | dict(account_for_loss_in_pipeline_split=True),
            [1, 2, 2, 1],
        ),
        (dict(num_layers=7, pipeline_model_parallel_size=2, account_for_loss_in_pipeline_split=True), [4, 3]),
    ],
)
def test_embedding_and_loss_count_as_layers(kw, counts):
    config = _config(**kw)
    assert [get_num_layers_to_build(config, pp_rank=r) for r in range(len(counts))] == counts


def test_embedding_slot_with_virtual_chunks_and_refusals():
    config = _config(
        num_layers=7,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        account_for_embedding_in_pipeline_split=True,
    )
    counts = [[get_num_layers_to_build(config, vp_stage=v, pp_rank=r) for v in (0, 1)] for r in (0, 1)]
    assert counts == [[1, 2], [2, 2]]  # 8 slots over 4 stages; the model's first stage gives one up
    with pytest.raises(ValueError, match="must be divisible"):
        get_num_layers_to_build(
            _config(num_layers=6, pipeline_model_parallel_size=4, account_for_loss_in_pipeline_split=True), pp_rank=0
        )
    with pytest.raises(ValueError, match="cannot be combined"):
        _config(
            pipeline_model_parallel_size=2, account_for_loss_in_pipeline_split=True, num_layers_in_last_pipeline_stage=1
        )


def _train_with_custom_splits(rank, world):
    groups = build_process_groups(ParallelLayout(world_size=world, pipeline_model_parallel_size=2))
    layout = {"pipeline_model_parallel_layout": "Et|ttt||tL"}  # an empty chunk on rank 0
    chunks = build_chunks(gpt2_style(num_layers=5), groups, 2, layout)
    assert [len(chunk.decoder.layers) for chunk in chunks] == [[1, 0], [3, 1]][rank]
    check_parity(gpt2_style(num_layers=5), groups, vp=2, num_mb=2, what="layout", iterations=2, chunk_extra=layout)
    slot = {"account_for_embedding_in_pipeline_split": True}  # 1 layer on rank 0, 2 on rank 1
    check_parity(
        gpt2_style(num_layers=3), groups, vp=1, num_mb=2, what="embedding slot", iterations=2, chunk_extra=slot
    )


def test_custom_pipeline_splits_train_like_one_rank():
    run_distributed(_train_with_custom_splits, 2)
