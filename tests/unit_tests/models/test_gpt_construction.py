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
    short = GPTModel(num_layers=2, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=2,
                     pipeline_model_parallel_size=1, vocab_size=64, max_sequence_length=8,
                     position_embedding_type="rope", rotary_base=1000, rotary_percent=0.5,
                     share_embeddings_and_output_weights=True, normalization="RMSNorm")
    assert short.config.normalization == "RMSNorm" and short.rotary_pos_emb is not None
    assert short.output_layer.weight is None  # tied: the output reuses the word embeddings
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=2)
    full = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=8)
    assert full.embedding.word_embeddings.weight.shape == (32, 32)  # [vocab/tp, h]
    logits = full(torch.randint(0, 64, (2, 8)))
    assert logits.shape == (2, 8, 32)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=1 in the config"):
        GPTModel(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64)
    with pytest.raises(TypeError, match="not_a_field"):
        GPTModel(num_layers=1, hidden_size=32, num_attention_heads=4, not_a_field=3)
    with pytest.raises(TypeError, match="either config"):
        GPTModel(config=config, num_layers=3)


def test_construction_styles():
    run_distributed(_construction_body, 2)
