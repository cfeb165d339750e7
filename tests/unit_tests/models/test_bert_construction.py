"""BertModel construction: Megatron-core's signatures and submodule names, the two layer layouts,
the refused options, and the outputs that the parity tests do not cover (return_embeddings, rope,
a non-last pipeline stage)."""

import inspect

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.models import BertModel
from megatron.core.models.bert import (
    bert_layer_local_spec,
    bert_layer_post_ln_spec,
    get_bert_layer_with_transformer_engine_spec,
)
from megatron.core.models.bert.bert_layer_specs import is_post_ln_spec
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.norms import LayerNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from tests.dist_harness import run_distributed
from tests.model_utils import SEQ, bert_batch, bert_config, build_bert

# Megatron-core 0.16's BertModel.__init__ and forward parameters, in order.
MCORE_INIT = [
    "config",
    "num_tokentypes",
    "transformer_layer_spec",
    "vocab_size",
    "max_sequence_length",
    "pre_process",
    "post_process",
    "fp16_lm_cross_entropy",
    "parallel_output",
    "share_embeddings_and_output_weights",
    "position_embedding_type",
    "rotary_percent",
    "seq_len_interpolation_factor",
    "add_binary_head",
    "return_embeddings",
    "vp_stage",
    "pg_collection",
]
MCORE_FORWARD = ["input_ids", "attention_mask", "tokentype_ids", "lm_labels", "inference_context", "inference_params"]

# Megatron-core's state-dict names of a one-layer BertModel with bert_layer_local_spec (untied).
MCORE_PRE_LN_KEYS = {
    "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight",
    "embedding.tokentype_embeddings.weight",
    *(f"encoder.layers.0.{m}.{p}" for m in ("input_layernorm", "pre_mlp_layernorm") for p in ("weight", "bias")),
    *(
        f"encoder.layers.0.{m}.{p}"
        for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
        for p in ("weight", "bias")
    ),
    *(
        f"{m}.{p}"
        for m in ("encoder.final_layernorm", "lm_head.dense", "lm_head.layer_norm")
        for p in ("weight", "bias")
    ),
    *(f"{m}.{p}" for m in ("output_layer", "binary_head", "pooler.dense") for p in ("weight", "bias")),
}


def test_signatures_are_megatron_cores():
    assert list(inspect.signature(BertModel.__init__).parameters)[1:] == MCORE_INIT
    assert list(inspect.signature(BertModel.forward).parameters)[1:] == MCORE_FORWARD
    assert inspect.signature(BertModel.forward).parameters["inference_params"].kind is inspect.Parameter.KEYWORD_ONLY


def test_specs_say_which_layout():
    assert not is_post_ln_spec(bert_layer_local_spec)
    assert is_post_ln_spec(bert_layer_post_ln_spec)
    assert get_bert_layer_with_transformer_engine_spec() is bert_layer_local_spec
    with pytest.raises(ValueError, match="mix post-LN and pre-LN"):
        is_post_ln_spec(TransformerBlockSubmodules(layer_specs=[bert_layer_local_spec, bert_layer_post_ln_spec]))


def _layouts_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    config = bert_config(groups, num_layers=1)
    pre = BertModel(config, 2, bert_layer_local_spec, 64, SEQ, pg_collection=groups)
    assert set(pre.state_dict()) == MCORE_PRE_LN_KEYS
    assert isinstance(pre.encoder.final_layernorm, LayerNorm) and pre.embedding.embedding_layernorm is None
    layer = pre.encoder.layers[0]
    assert isinstance(layer.input_layernorm, LayerNorm) and layer.post_mlp_layernorm is None
    assert layer.self_attention.core_attention.attn_mask_type.name == "padding"

    post = BertModel(config, 2, bert_layer_post_ln_spec, 64, SEQ, pg_collection=groups)
    assert post.encoder.final_layernorm is None and isinstance(post.embedding.embedding_layernorm, LayerNorm)
    layer = post.encoder.layers[0]
    assert isinstance(layer.input_layernorm, IdentityOp) and isinstance(layer.pre_mlp_layernorm, IdentityOp)
    assert isinstance(layer.post_self_attn_layernorm, LayerNorm) and isinstance(layer.post_mlp_layernorm, LayerNorm)

    # Without groups the model uses the ones initialize_model_parallel built.
    assert (
        BertModel(config, 0, bert_layer_local_spec, 64, SEQ).pg_collection
        is ps.ProcessGroupCollection.use_mpu_process_groups()
    )
    with pytest.raises(TypeError, match="not_an_argument"):
        BertModel(config, 2, bert_layer_local_spec, 64, SEQ, pg_collection=groups, not_an_argument=1)
    with pytest.raises(ValueError, match="return_embeddings"):
        BertModel(config, 2, bert_layer_local_spec, 64, SEQ, add_binary_head=False, return_embeddings=True)


def _forward_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    data = bert_batch()
    model = build_bert(groups).eval()
    args = (data["tokens"], data["padding"], data["types"])
    with pytest.raises(TypeError, match="not_an_argument"):
        model(*args, not_an_argument=1)
    with pytest.raises(NotImplementedError, match="inference_context=1"):
        model(*args, inference_context=1)
    with pytest.raises(NotImplementedError, match="inference_params=1"):
        model(*args, inference_params=1)
    with pytest.raises(ValueError, match="tokentype_ids must be given"):
        model(data["tokens"], data["padding"])
    lm_loss, binary = model(*args, lm_labels=data["labels"])
    b, s = data["tokens"].shape
    assert lm_loss.shape == (b, s) and binary.shape == (b, 2)

    # return_embeddings: the fp32 mean of the last hidden states between [CLS] and the last real token.
    embedder = build_bert(groups, return_embeddings=True).eval()
    captured = {}
    embedder.encoder.register_forward_hook(lambda module, inputs, out: captured.update(hidden=out))
    means = embedder(*args)
    hidden = captured["hidden"].transpose(0, 1)  # [b, s, h]
    lengths = data["padding"].sum(1)
    expected = torch.stack([hidden[i, 1 : lengths[i] - 1].mean(0) for i in range(b)])
    assert means.dtype == torch.float32 and means.shape == (b, hidden.shape[-1])
    torch.testing.assert_close(means, expected, rtol=1e-6, atol=1e-6)

    # RoPE instead of learned positions: without positions a bidirectional encoder is equivariant
    # to rolling the tokens (checked with "none"); RoPE breaks that.
    ones, zeros = torch.ones_like(data["padding"]), torch.zeros_like(data["types"])
    for kind in ("none", "rope"):
        config = bert_config(groups, init_method_std=0.3)  # sharp attention: positions matter
        model = build_bert(groups, config=config, position_embedding_type=kind).eval()
        assert model.embedding.position_embeddings is None
        logits, _ = model(data["tokens"], ones, zeros)
        rolled, _ = model(data["tokens"].roll(1, dims=1), ones, zeros)
        assert logits.shape == (b, s, 128)
        equivariant = torch.allclose(rolled, logits.roll(1, dims=1), atol=1e-5)
        assert equivariant == (kind == "none"), kind


def _stage_body(rank, world_size):
    groups = build_process_groups(ParallelLayout(world_size=world_size, pipeline_model_parallel_size=world_size))
    data = bert_batch()
    model = build_bert(groups, pre_process=rank == 0, post_process=rank == 1, share_embeddings_and_output_weights=True)
    if rank == 0:
        hidden = model(data["tokens"], data["padding"], data["types"])
        assert hidden.shape == (SEQ, data["tokens"].shape[0], model.config.hidden_size)  # [s, b, h]
        assert not hasattr(model, "lm_head") and model.shared_embedding_or_output_weight() is not None
    else:
        assert model.output_layer.weight.shared_embedding and not hasattr(model, "embedding")
        assert model.shared_embedding_or_output_weight() is model.output_layer.weight
    torch.distributed.barrier()  # neither rank leaves while the other may still use the groups


def test_layouts_and_names():
    run_distributed(_layouts_body, 1)


def test_forward_outputs_and_refusals():
    run_distributed(_forward_body, 1)


def test_pipeline_stages():
    run_distributed(_stage_body, 2)


def test_context_parallel_refused():
    run_distributed(_cp_body, 2)


def _cp_body(rank, world_size):
    groups = build_process_groups(ParallelLayout(world_size=world_size, context_parallel_size=world_size))
    with pytest.raises(NotImplementedError, match="context_parallel_size=2"):
        build_bert(groups, config=bert_config(groups, context_parallel_size=world_size))
    torch.distributed.barrier()
