"""One activation registry and one copy of each MoE choice list, in the core.

Checked: the registry's functions against their formulas (numpy); the flags, the T5 spec and the
converter get their activation from it; and no module of ``megatron/``, ``tools/`` or the entry
points other than ``moe_choices.py`` writes an MoE choice list as a literal, nor another tanh GeLU.
"""

import ast
import math
import pathlib

import numpy as np
import pytest
import torch

from megatron.core import activations
from megatron.core.transformer import moe_choices
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import arguments as A
from megatron.training.flags import registry

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _sources():
    files = [*(ROOT / "megatron").rglob("*.py"), *(ROOT / "tools").rglob("*.py"), *ROOT.glob("pretrain_*.py")]
    return [p for p in files if p.name not in ("moe_choices.py", "activations.py")]


def test_registry_matches_the_formulas():
    x = torch.linspace(-4, 4, 41, dtype=torch.float64)
    xn = x.numpy()
    tanh_gelu = 0.5 * xn * (1 + np.tanh(math.sqrt(2 / math.pi) * (xn + 0.044715 * xn**3)))
    erf_gelu = 0.5 * xn * (1 + np.vectorize(math.erf)(xn / math.sqrt(2)))
    np.testing.assert_allclose(activations.activation("gelu_tanh")(x).numpy(), tanh_gelu, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(activations.activation("gelu")(x).numpy(), erf_gelu, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(activations.activation("squared_relu")(x).numpy(), np.maximum(xn, 0) ** 2)
    np.testing.assert_allclose(activations.activation("silu")(x).numpy(), xn / (1 + np.exp(-xn)), rtol=1e-12)
    with pytest.raises(ValueError, match="activation 'relu6': must be one of gelu, gelu_tanh"):
        activations.activation("relu6")


@pytest.mark.parametrize(
    "flags,name", [([], "gelu"), (["--openai-gelu"], "gelu_tanh"), (["--squared-relu"], "squared_relu")]
)
def test_flags_choose_from_the_registry(flags, name):
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "1"]
    base += ["--seq-length", "16", "--train-iters", "1", "--lr", "1e-3"]
    args = A.validate_args(A.parse_args(base + flags), 1)
    assert registry.config_from_args(TransformerConfig, args).activation_func is activations.ACTIVATIONS[name]


def test_two_switches_are_refused_naming_both():
    with pytest.raises(ValueError, match="choose one activation, got swiglu=True, openai_gelu=True"):
        activations.activation_name(swiglu=True, openai_gelu=True)


def test_t5_and_the_converter_use_the_registry():
    from megatron.core.models.T5 import t5_spec
    from tools.checkpoint import hf_config

    assert t5_spec.gelu_tanh is activations.gelu_tanh
    kwargs = hf_config.gpt_model_kwargs(dict(_GPT_ARGS, openai_gelu=True))
    assert kwargs["activation_func"] is activations.gelu_tanh


_GPT_ARGS = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    normalization="LayerNorm",
    layernorm_epsilon=1e-5,
    max_position_embeddings=16,
    padded_vocab_size=64,
    untie_embeddings_and_output_weights=False,
    position_embedding_type="learned_absolute",
    add_bias_linear=True,
    rotary_base=10000,
)


def test_no_second_copy_of_a_choice_list_or_the_tanh_gelu():
    lists = {
        moe_choices.SCORE_FUNCTIONS,
        moe_choices.DROP_POLICIES,
        moe_choices.DISPATCHER_TYPES,
        moe_choices.BALANCE_TYPES,
        tuple(moe_choices.BALANCE_LOSS_NAMES),
    }
    found = []
    for path in _sources():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            strings = None
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                strings = tuple(e.value for e in node.elts if isinstance(e, ast.Constant))
            elif isinstance(node, ast.Dict):
                strings = tuple(k.value for k in node.keys if isinstance(k, ast.Constant))
            if strings and any(set(strings) >= set(choice) for choice in lists):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.keyword) and node.arg == "approximate":
                found.append(f"{path.relative_to(ROOT)}:{node.value.lineno} (a tanh GeLU)")
    assert not found, (
        f"write these once (megatron/core/transformer/moe_choices.py, megatron/core/activations.py): {found}"
    )
