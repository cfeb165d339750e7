"""T5Model construction: Megatron-core's signatures and state-dict names, the specs, the refused
options (pipeline and context parallelism, inference), the mask conventions, and the outputs that
the parity tests do not cover (encoder only, given encoder states, add_encoder/add_decoder, rope)."""

import inspect

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.models import T5 as t5
from megatron.core.models import T5Model
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.parallel_state import ParallelLayout, build_process_groups
from megatron.core.transformer.cross_attention import CrossAttention
from megatron.core.transformer.norms import LayerNorm, RMSNorm
from megatron.core.transformer.transformer_layer import TransformerLayer
from tests.dist_harness import run_distributed
from tests.model_utils import T5_DEC, T5_ENC, build_t5, t5_batch, t5_config

# Megatron-core 0.16's T5Model.__init__ and forward parameters, in order.
MCORE_INIT = [
    "config",
    "encoder_config",
    "transformer_encoder_layer_spec",
    "transformer_decoder_layer_spec",
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
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
    "add_encoder",
    "add_decoder",
    "pg_collection",
]
MCORE_FORWARD = [
    "encoder_input_ids",
    "decoder_input_ids",
    "encoder_attn_mask",
    "decoder_attn_mask",
    "encoder_decoder_attn_mask",
    "lm_labels",
    "encoder_hidden_states",
    "output_encoder_hidden_only",
    "inference_context",
    "packed_seq_params",
    "inference_params",
]
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
_WB = ("weight", "bias")
# Megatron-core's names of a 1+1-layer T5Model with the local specs, tied head (lm_head.output_layer has
# only its bias): ``output_layer`` is an alias of ``lm_head.output_layer``, listed once.
MCORE_KEYS = {
    "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight",
    "lm_head.output_layer.bias",
    *(f"{s}.final_layernorm.{p}" for s in ("encoder", "decoder") for p in _WB),
    *(f"{s}.layers.0.{m}.{p}" for s in ("encoder", "decoder") for m in _LINEARS for p in _WB),
    *(
        f"{s}.layers.0.{m}.{p}"
        for s in ("encoder", "decoder")
        for m in ("input_layernorm", "pre_mlp_layernorm")
        for p in _WB
    ),
    *(
        f"decoder.layers.0.{m}.{p}"
        for m in ("pre_cross_attn_layernorm", "cross_attention.linear_q", "cross_attention.linear_kv")
        for p in _WB
    ),
    *(f"decoder.layers.0.cross_attention.linear_proj.{p}" for p in _WB),
}


def test_signatures_are_megatron_cores():
    assert list(inspect.signature(T5Model.__init__).parameters)[1:] == MCORE_INIT
    assert list(inspect.signature(T5Model.forward).parameters)[1:] == MCORE_FORWARD


def test_specs():
    for n in (1, 3):
        for local, te in (
            (t5.get_t5_encoder_with_local_block_spec(n), t5.get_t5_encoder_with_transformer_engine_block_spec(n)),
            (t5.get_t5_decoder_with_local_block_spec(n), t5.get_t5_decoder_with_transformer_engine_block_spec(n)),
        ):
            assert len(local.layer_specs) == n and local == te
    encoder, decoder = t5.get_t5_v11_encoder_block_spec(1), t5.get_t5_v11_decoder_block_spec(1)
    assert encoder.layer_specs[0].submodules.cross_attention is None
    assert decoder.layer_specs[0].submodules.cross_attention.module is CrossAttention
    assert decoder.layer_specs[0].submodules.pre_cross_attn_layernorm is RMSNorm
    config = t5.t5_v11_config(num_layers=1, hidden_size=16, num_attention_heads=2)
    assert (config.normalization, config.add_bias_linear, config.gated_linear_unit) == ("RMSNorm", False, True)
    assert config.softmax_scale == 1.0 and config.layernorm_epsilon == 1e-6


def _single_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    config = t5_config(groups, v11=False, num_layers=1)
    specs = (t5.get_t5_encoder_with_local_block_spec(1), t5.get_t5_decoder_with_local_block_spec(1))
    model = T5Model(config, config, *specs, 96, 32, share_embeddings_and_output_weights=True, pg_collection=groups)
    assert set(model.state_dict()) == MCORE_KEYS
    # Without pg_collection the model takes the groups initialize_model_parallel set up.
    default = T5Model(config, config, *specs, 96, 32, share_embeddings_and_output_weights=True)
    assert default.pg_collection.size_of("tp") == 1 and set(default.state_dict()) == MCORE_KEYS
    assert isinstance(model.decoder.final_layernorm, LayerNorm) and model.output_layer is model.lm_head.output_layer
    assert not hasattr(model, "encoder_relative_pos_emb")
    # Upstream's "neither on this stage" (None, None): no encoder, no decoder; given states pass through.
    neither = T5Model(config, config, *specs, 96, 32, add_encoder=None, add_decoder=None, pg_collection=groups)
    states = torch.randn(4, 2, config.hidden_size)
    assert neither.encoder is None and neither.decoder is None
    assert neither(None, None, None, None, None, encoder_hidden_states=states) is states
    with pytest.raises(ValueError, match="pass encoder_hidden_states"):
        neither(torch.zeros(2, 4, dtype=torch.long), None, None, None, None)
    with pytest.raises(TypeError, match="not_an_argument"):
        T5Model(config, config, *specs, 96, 32, pg_collection=groups, not_an_argument=1)
    with pytest.raises(NotImplementedError, match="pipeline parallelism.*pre_process=False"):
        T5Model(config, config, *specs, 96, 32, pre_process=False, pg_collection=groups)
    with pytest.raises(ValueError, match="position_embedding_type"):
        T5Model(config, config, *specs, 96, 32, position_embedding_type="alibi", pg_collection=groups)
    # A GPT layer builds no cross-attention: its state dict is unchanged.
    gpt_layer = TransformerLayer(
        t5_config(groups, v11=False), get_gpt_layer_local_spec().submodules, pg_collection=groups
    )
    assert gpt_layer.cross_attention is None and not any("cross" in k for k in gpt_layer.state_dict())


def _forward_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    model = build_t5(groups).eval()
    data = t5_batch()
    enc_mask, dec_mask, cross = t5.t5_padding_attention_masks(data["enc_pad"], data["dec_pad"])
    args = (data["enc"], data["dec"], enc_mask, dec_mask, cross)
    with torch.no_grad():
        logits = model(*args)
        assert logits.shape == (3, T5_DEC, 96)
        with pytest.raises(TypeError, match="not_an_argument"):
            model(*args, not_an_argument=1)
        with pytest.raises(NotImplementedError, match="packed_seq_params="):
            model(*args, packed_seq_params=object())
        with pytest.raises(NotImplementedError, match="inference_context with a decoder_attn_mask"):
            model(*args, inference_context=object())  # generation is causal over the cache: no decoder mask
        with pytest.raises(ValueError, match="boolean"):
            model(data["enc"], data["dec"], data["enc_pad"], None, None)
        # The decoder is causal whatever mask it gets: keys only, or None (nothing but causal).
        keys_only = (data["dec_pad"] < 0.5)[:, None, None, :]  # [b, 1, 1, s_dec]
        torch.testing.assert_close(model(data["enc"], data["dec"], enc_mask, keys_only, cross), logits)
        no_pad = model(data["enc"][:1], data["dec"][:1], None, None, None)
        torch.testing.assert_close(
            model(data["enc"][:1], data["dec"][:1], None, dec_mask[:1, :, :, :] & False, None), no_pad
        )
        # Megatron-core's [b, sq, sk] helper.
        assert [m.shape for m in t5.t5_extended_attention_mask([torch.zeros(3, 4, 5), None])[:1]] == [(3, 1, 4, 5)]
        encoded = model(*args, output_encoder_hidden_only=True)  # [s_enc, b, h]
        assert encoded.shape == (T5_ENC, 3, 32)
        torch.testing.assert_close(model(*args, encoder_hidden_states=encoded), logits)
        decoder_only = build_t5(groups, add_encoder=False).eval()
        decoder_only.load_state_dict(
            {k: v for k, v in model.state_dict().items() if not k.startswith("encoder.")}, strict=True
        )
        torch.testing.assert_close(decoder_only(*args, encoder_hidden_states=encoded), logits)
        with pytest.raises(ValueError, match="encoder_hidden_states"):
            decoder_only(*args)
        encoder_only = build_t5(groups, add_decoder=False).eval()
        assert encoder_only.decoder is None and encoder_only(*args).shape == (T5_ENC, 3, 32)
        rope = build_t5(groups, v11=False, position_embedding_type="rope").eval()
        assert rope.embedding.position_embeddings is None and rope(*args).shape == (3, T5_DEC, 96)
        model.set_input_tensor([None])
        with pytest.raises(NotImplementedError, match="pipeline"):
            model.set_input_tensor(encoded)


def _parallel_refused_body(rank, world_size):
    for layout in (dict(pipeline_model_parallel_size=2), dict(context_parallel_size=2)):
        groups = build_process_groups(ParallelLayout(world_size=world_size, **layout))
        config = t5_config(groups, **{k: v for k, v in layout.items()})
        with pytest.raises(NotImplementedError, match=next(iter(layout))):
            build_t5(groups, config=config)


def test_construction_single_rank():
    run_distributed(_single_body, 1)


def test_forward_options():
    run_distributed(_forward_body, 1)


def test_pipeline_and_context_parallel_refused():
    run_distributed(_parallel_refused_body, 2)
