"""GPTModel.forward and the GPT layer specs take Megatron-core's arguments and nothing else.

An unknown keyword is a ``TypeError`` naming it; an accepted argument we do not implement is
refused unless it has its default; the ones that work change what is built or returned.
"""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.models import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from tests.dist_harness import run_distributed


def _config(**overrides) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, tensor_model_parallel_size=2, **overrides
    )


def _model(config: TransformerConfig, **spec_kwargs) -> GPTModel:
    spec = get_gpt_layer_local_spec(**spec_kwargs)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=8)


def _forward_body(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1)
    model = _model(_config()).eval()  # no dropout: calls are compared
    tokens = torch.randint(0, 64, (2, 8))
    with pytest.raises(TypeError, match="not_an_argument"):
        model(tokens, not_an_argument=1)
    with pytest.raises(NotImplementedError, match="not supported yet: inference_params="):
        model(tokens, packed_seq_params=object(), inference_params=object())
    with pytest.raises(NotImplementedError, match="extra_block_kwargs"):
        model(tokens, extra_block_kwargs={"context": None})
    assert model(tokens, extra_block_kwargs={}).shape == (2, 8, 32)  # an empty dict asks for nothing
    assert model(tokens).shape == (2, 8, 32)  # parallel_output: this rank's half of the vocabulary
    full = model(tokens, runtime_gather_output=True)  # [b, s, vocab]
    assert full.shape == (2, 8, 64)
    torch.testing.assert_close(full[..., rank * 32 : (rank + 1) * 32], model(tokens))
    labels = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(model(tokens, labels=labels, loss_mask=torch.ones(2, 8)), model(tokens, labels=labels))


def _qk_layernorm_body(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1)
    attention = lambda m: m.decoder.layers[0].self_attention  # noqa: E731
    assert attention(_model(_config())).q_layernorm is None
    assert attention(_model(_config(), qk_layernorm=True)).q_layernorm is not None  # the spec asks for them
    assert attention(_model(_config(qk_layernorm=True))).k_layernorm is not None  # the spec's None: the config's
    with pytest.raises(ValueError, match="qk_layernorm=False but TransformerConfig.qk_layernorm=True"):
        _model(_config(qk_layernorm=True), qk_layernorm=False)


def test_gpt_forward_arguments():
    run_distributed(_forward_body, 2)


def test_spec_qk_layernorm_builds_the_norms():
    run_distributed(_qk_layernorm_body, 2)


def test_spec_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="not_an_argument"):
        get_gpt_layer_local_spec(not_an_argument=True)
    with pytest.raises(TypeError, match="not_an_argument"):
        get_gpt_decoder_block_spec(_config(), not_an_argument=True)
    with pytest.raises(TypeError, match="normalization"):  # a local-spec argument the TE spec does not take
        get_gpt_layer_with_transformer_engine_spec(normalization="RMSNorm")


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"qk_l2_norm": True, "use_kitchen": True}, "qk_l2_norm=True, use_kitchen=True"),
        ({"kitchen_attention_backend": "fa"}, "kitchen_attention_backend='fa'"),
    ],
)
def test_spec_refuses_what_it_cannot_build(kwargs, named):
    with pytest.raises(NotImplementedError, match=f"not supported yet: {named}"):
        get_gpt_layer_local_spec(**kwargs)
    with pytest.raises(NotImplementedError, match=named):
        get_gpt_layer_with_transformer_engine_spec(**kwargs)


def test_spec_multi_latent_attention():
    """``multi_latent_attention=True`` builds Megatron's MLA self-attention, in both specs."""
    for spec in (get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec):
        assert spec(multi_latent_attention=True).submodules.self_attention.module is MLASelfAttention


def test_spec_grouped_gemm_is_the_sequential_experts():
    """Megatron's grouped GEMM is a kernel for the same experts: the spec is the same."""
    plain = get_gpt_layer_local_spec(num_experts=4)
    grouped = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True)
    assert grouped.submodules.mlp == plain.submodules.mlp
    with pytest.raises(ValueError, match="normalization='BatchNorm'"):
        get_gpt_layer_local_spec(normalization="BatchNorm")
    with pytest.warns(UserWarning, match="fp8 argument is deprecated"):
        get_gpt_layer_local_spec(fp8="hybrid")
