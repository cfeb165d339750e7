"""megatron.core.transformer as Megatron-core's callers use it: specs, layer placement, Float16Module."""

from __future__ import annotations

import pytest
import torch

from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, get_module, import_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build, get_transformer_layer_offset
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.dist_harness import run_distributed


def _activation(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class _Needs:
    def __init__(self, size: int, *, submodules=None, scale: float = 1.0) -> None:
        self.size, self.submodules, self.scale = size, submodules, scale


def test_build_module_forms():
    assert build_module(_activation) is _activation  # a function spec is returned, not called
    assert build_module(ModuleSpec(module=_activation)) is _activation
    linear = build_module(("torch.nn", "Linear"), 3, 4)  # (module_path, name) is imported
    assert isinstance(linear, torch.nn.Linear) and linear.out_features == 4
    built = build_module(ModuleSpec(module=_Needs, params={"scale": 0.5}, submodules="sub", metainfo={"a": 1}), 7)
    assert (built.size, built.scale, built.submodules) == (7, 0.5, "sub")
    assert get_module(ModuleSpec(module=("torch.nn", "ReLU"))) is torch.nn.ReLU
    assert import_module(("torch.nn", "GELU")) is torch.nn.GELU
    with pytest.raises(ImportError, match="NoSuchThing"):
        import_module(("torch.nn", "NoSuchThing"))
    with pytest.raises(TypeError, match="when instantiating _Needs"):
        build_module(ModuleSpec(module=_Needs), 1, unknown=2)


@pytest.mark.parametrize(
    "pp, vp, first, last, expected",
    [
        (1, None, None, None, [[(8, 0)]]),
        (4, None, None, None, [[(2, 0)], [(2, 2)], [(2, 4)], [(2, 6)]]),
        (2, 2, None, None, [[(2, 0), (2, 4)], [(2, 2), (2, 6)]]),
        (3, None, 2, 2, [[(2, 0)], [(4, 2)], [(2, 6)]]),
    ],
)
def test_layers_per_stage(pp, vp, first, last, expected):
    config = TransformerConfig(
        num_layers=8,
        hidden_size=8,
        num_attention_heads=2,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
    )
    for rank, chunks in enumerate(expected):
        for vp_stage, (count, offset) in enumerate(chunks):
            stage = None if vp is None else vp_stage
            assert get_num_layers_to_build(config, vp_stage=stage, pp_rank=rank) == count
            assert get_transformer_layer_offset(config, vp_stage=stage, pp_rank=rank) == offset


class _Stage(torch.nn.Module):
    """A pipeline stage that reports what it was given."""

    def __init__(self, pre_process: bool, post_process: bool) -> None:
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.linear = torch.nn.Linear(4, 4)
        self.received = None

    def set_input_tensor(self, tensor):
        self.received = tensor

    def forward(self, x, ids):
        self.seen = (x.dtype, ids.dtype)
        return self.linear(x.to(self.linear.weight.dtype))


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_float16_module(precision, dtype):
    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1, **{precision: True})
    first = Float16Module(config, _Stage(pre_process=True, post_process=False))
    assert first.module.linear.weight.dtype == dtype
    out = first(torch.ones(2, 4), torch.arange(2))
    assert first.module.seen == (dtype, torch.int64) and out.dtype == dtype  # inputs cast, no upcast mid-pipeline
    last = Float16Module(config, _Stage(pre_process=False, post_process=True))
    assert last(torch.ones(2, 4), torch.arange(2)).dtype == torch.float32
    assert last.module.seen[0] == torch.float32  # not the first stage: inputs as given
    assert last(torch.ones(2, 4), torch.arange(2), fp32_output=False).dtype == dtype
    assert set(last.state_dict()) == {"linear.weight", "linear.bias"}  # no "module." prefix
    last.set_input_tensor("x")
    assert last.module.received == "x"
    with pytest.raises(ValueError, match="fp16 or config.bf16"):
        Float16Module(TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1), _Stage(True, True))


def _embedding_body(rank: int, world_size: int):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(2, 1)
    config = TransformerConfig(num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True)
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=100, max_sequence_length=16
    )
    emb = model.embedding
    layer = model.decoder.layers[1]
    refused = []
    for extra in ({"scatter_embedding_sequence_parallel": False}, {"mtp_block_spec": get_gpt_layer_local_spec()}):
        try:
            GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=100,
                     max_sequence_length=16, **extra)  # fmt: skip
        except NotImplementedError as err:
            refused.append(next(iter(extra)) in str(err))
    sharded = layer.sharded_state_dict(prefix="decoder.layers.1.")
    return {
        "word_embeddings": tuple(emb.word_embeddings.weight.shape) == (50, 12),  # vocab split over TP
        "position_embeddings": tuple(emb.position_embeddings.weight.shape) == (16, 12),
        "dropout": isinstance(emb.embedding_dropout, torch.nn.Dropout) and emb.embedding_dropout.p == 0.1,
        "sizes": (emb.vocab_size, emb.max_sequence_length, emb.add_position_embedding) == (100, 16, True),
        "adopted_tp": config.tensor_model_parallel_size == 2,
        "layer_sharded": sharded["decoder.layers.1.mlp.linear_fc1.weight"].global_shape == (48, 12),
        "tied_weight": model.shared_embedding_or_output_weight() is emb.word_embeddings.weight,
        "gpt_refusals": refused == [True, True],
    }


def _modules_body(rank: int, world_size: int):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, model_parallel_cuda_manual_seed
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(2, 1)
    model_parallel_cuda_manual_seed(123)
    config = TransformerConfig(num_layers=2, hidden_size=12, num_attention_heads=4, tensor_model_parallel_size=2)
    spec = get_gpt_layer_local_spec(qk_layernorm=True)
    # As upstream tests build them: the spec's submodules, groups from parallel_state.
    attention = SelfAttention(config, spec.submodules.self_attention.submodules, layer_number=1)
    mlp = MLP(config, spec.submodules.mlp.submodules)
    wide = MLP(config, MLPSubmodules(), input_size=6, ffn_hidden_size=8)
    x = torch.randn(5, 2, 12)
    out, _ = attention(x, None)
    y, _ = mlp(x)
    checks = {
        "attention_shapes": tuple(attention.linear_qkv.weight.shape) == (18, 12) and out.shape == x.shape,
        "qk_norm_from_spec": attention.q_layernorm is not None and attention.k_layernorm is not None,
        "mask_type": attention.core_attention.attn_mask_type == AttnMaskType.causal,
        "mlp_shapes": tuple(mlp.linear_fc1.weight.shape) == (24, 12) and y.shape == x.shape,
        "input_size": tuple(wide.linear_fc1.weight.shape) == (4, 6) and tuple(wide.linear_fc2.weight.shape) == (12, 4),
        "tp_group": mlp.linear_fc1.tp_group is parallel_state.get_tensor_model_parallel_group(),
    }
    from megatron.core.transformer.norms import RMSNorm
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layer = TransformerLayer(config, spec.submodules, layer_number=2, hidden_dropout=0.0, pp_layer_offset=3)
    block = TransformerBlock(config, TransformerBlockSubmodules([spec] * 2, layer_norm=None))
    checks["layer_offset"] = layer.layer_number == 5 and layer.hidden_dropout == 0.0
    checks["block_from_parallel_state"] = [m.layer_number for m in block.layers] == [1, 2]
    for build in (
        lambda: TransformerBlock(config, TransformerBlockSubmodules([spec] * 2, layer_norm=RMSNorm)),
        lambda: TransformerLayer(config, spec.submodules, is_mtp_layer=True),
        lambda: SelfAttention(config, SelfAttentionSubmodules(linear_qkv=torch.nn.Linear)),
        lambda: SelfAttention(config, SelfAttentionSubmodules(q_layernorm=torch.nn.LayerNorm, k_layernorm=None)),
        lambda: MLP(config, MLPSubmodules(linear_fc2=ColumnParallelLinear)),
        lambda: MLP(config, MLPSubmodules(activation_func=torch.nn.functional.silu)),
    ):
        try:
            build()
            checks[f"refused_{len(checks)}"] = False
        except NotImplementedError:
            checks[f"refused_{len(checks)}"] = True
    try:
        SelfAttention(config, None, 1, AttnMaskType.causal, cp_comm_type="ring")
        checks["cp_comm_type"] = False
    except ValueError:
        checks["cp_comm_type"] = True
    return checks


def test_self_attention_and_mlp_upstream_signatures():
    for checks in run_distributed(_modules_body, 2):
        assert checks == dict.fromkeys(checks, True), checks


def test_embedding_attributes_and_layer_sharded_state_dict():
    for checks in run_distributed(_embedding_body, 2):
        assert checks == dict.fromkeys(checks, True), checks


def test_config_sizes_checked_once_set():
    # Megatron-core callers set the shape; our defaults (0) are refused with the field named.
    with pytest.raises(ValueError, match="num_layers=0"):
        TransformerConfig()
    with pytest.raises(ValueError, match="num_attention_heads=4 must be divisible by tensor_model_parallel_size=3"):
        TransformerConfig(num_layers=1, hidden_size=12, num_attention_heads=4, tensor_model_parallel_size=3)


def test_module_helpers_and_mlp_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.module import (
        conversion_helper,
        float16_to_fp32,
        fp32_to_float16,
        param_is_not_shared,
    )
    from megatron.core.transformer.moe.moe_layer import MoELayer

    dense = get_mlp_module_spec(use_te=False)
    assert dense.module is MLP and isinstance(dense.submodules, MLPSubmodules)
    assert get_mlp_module_spec(num_experts=4).module is MoELayer
    halves = fp32_to_float16((torch.ones(2), [torch.ones(1, dtype=torch.float64), 3]), lambda t: t.half())
    assert halves[0].dtype == torch.float16 and halves[1][0].dtype == torch.float64 and halves[1][1] == 3
    assert float16_to_fp32([torch.ones(1, dtype=torch.bfloat16)])[0].dtype == torch.float32
    assert conversion_helper((1, [2]), lambda v: v + 1) == (2, [3])
    shared = torch.nn.Parameter(torch.ones(1))
    shared.shared = True
    assert not param_is_not_shared(shared) and param_is_not_shared(torch.nn.Parameter(torch.ones(1)))
