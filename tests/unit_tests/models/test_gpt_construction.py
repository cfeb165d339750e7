"""Both GPTModel construction styles, and the config checked against the process groups."""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.models import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from tests.dist_harness import run_distributed


def _construction_body(rank, world_size):
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(123)  # per-rank init draws from the model-parallel RNG
    short = GPTModel(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1,
        vocab_size=64,
        max_sequence_length=8,
        position_embedding_type="rope",
        rotary_base=1000,
        rotary_percent=0.5,
        share_embeddings_and_output_weights=True,
        normalization="RMSNorm",
    )
    assert short.config.normalization == "RMSNorm" and short.rotary_pos_emb is not None
    assert short.output_layer.weight is None  # tied: the output reuses the word embeddings
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=2)
    full = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8
    )
    assert full.embedding.word_embeddings.weight.shape == (32, 32)  # [vocab/tp, h]
    logits = full(torch.randint(0, 64, (2, 8)))
    assert logits.shape == (2, 8, 32)
    # A size left at its default is taken from parallel_state (Megatron-core's callers leave it unset);
    # a size that was set must agree.
    assert (
        GPTModel(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64).config.tensor_model_parallel_size
        == 2
    )
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 in the config"):
        GPTModel(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, tensor_model_parallel_size=4)
    with pytest.raises(TypeError, match="not_a_field"):
        GPTModel(num_layers=1, hidden_size=32, num_attention_heads=4, not_a_field=3)
    with pytest.raises(TypeError, match="either config"):
        GPTModel(config=config, num_layers=3)


def test_construction_styles():
    run_distributed(_construction_body, 2)


def _initialisers_body(rank, world_size):
    """--embedding-init-method-std scales only the embeddings; xavier replaces the linear layers' normal."""
    import math

    from tests.model_utils import build_gpt, gpt2_style, single_rank_groups

    ps.initialize_model_parallel(1, 1)
    groups = single_rank_groups()
    plain = dict(build_gpt(gpt2_style(), groups, seed=3).named_parameters())
    wide = dict(build_gpt(gpt2_style(embedding_init_method_std=0.05), groups, seed=3).named_parameters())
    for name, param in plain.items():
        # CPU initialisation draws each tensor from its own seeded stream: same draws, other scale.
        factor = 0.05 / 0.02 if name.startswith("embedding.") else 1.0
        torch.testing.assert_close(wide[name], param * factor, rtol=1e-6, atol=0, msg=name)
    xavier = build_gpt(
        gpt2_style(init_method=torch.nn.init.xavier_uniform_, output_layer_init_method=torch.nn.init.xavier_uniform_),
        groups,
        seed=3,
    )
    for name, param in xavier.named_parameters():
        if name.endswith("weight") and param.dim() == 2 and not name.startswith("embedding."):
            bound = math.sqrt(6.0 / sum(param.shape))  # full weights (one rank): fan_in + fan_out
            assert param.abs().max() <= bound and param.std() > 0.8 * bound / math.sqrt(3.0), name
    with pytest.raises(ValueError, match=r"embedding_init_method_std=-1.0: must be positive"):
        TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, embedding_init_method_std=-1.0)


def test_initialiser_options():
    run_distributed(_initialisers_body, 1)
