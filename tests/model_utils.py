"""Tiny GPT configurations and helpers shared by model, pipeline and data-parallel tests."""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from megatron.core.models import BertModel, GPTModel
from megatron.core.models.bert import bert_layer_post_ln_spec
from megatron.core.parallel_state import ParallelLayout, ProcessGroupCollection, build_process_groups
from megatron.core.tensor_parallel.layers import is_expert_param
from megatron.core.transformer import TransformerConfig

VOCAB = 128
SEQ = 16


def gpt2_style(**overrides) -> Dict:
    """GPT-2 shape: LayerNorm, GeLU, learned positions, biases, tied embeddings."""
    kw = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=True,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    kw.update(overrides)
    return kw


def llama_style(**overrides) -> Dict:
    """Llama shape: RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied."""
    kw = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    kw.update(overrides)
    return kw


DEEPSEEK_YARN = dict(rotary_scaling_factor=4.0, mscale=0.9, mscale_all_dim=0.7, original_max_position_embeddings=256)


def deepseek_style(**overrides):
    """A 3-layer DeepSeek-V3 shape: MLA with query compression and YaRN (factor 4, mscale 0.9 over
    mscale_all_dim 0.7), one dense layer, then MoE with sigmoid routing over 2 of 4 expert groups,
    expert bias, top-k scaling 2.5 and shared experts."""
    kw = dict(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        vocab_size=VOCAB,
        max_sequence_length=16,
        multi_latent_attention=True,
        qk_layernorm=True,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_head_dim=8,
        qk_pos_emb_head_dim=8,
        v_head_dim=6,
        rope_type="yarn",
        **DEEPSEEK_YARN,
        num_moe_experts=8,
        moe_layer_freq=[0, 1, 1],
        moe_ffn_hidden_size=16,
        moe_router_topk=4,
        moe_router_score_function="sigmoid",
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="none",
        moe_shared_expert_intermediate_size=32,
    )
    kw.update(overrides)
    return kw


def single_rank_groups() -> ProcessGroupCollection:
    """Groups in which every rank is alone: for building a TP=1 reference on every rank."""
    return build_process_groups(ParallelLayout(world_size=dist.get_world_size(), tensor_model_parallel_size=1))


def build_gpt(kwargs: Dict, groups: ProcessGroupCollection, seed: int = 1234, **extra) -> GPTModel:
    """A GPTModel from ``kwargs``, initialized from ``seed`` (CPU init: same weights for any TP)."""
    torch.manual_seed(seed)
    kw = dict(
        kwargs,
        tensor_model_parallel_size=groups.size_of("tp"),
        pipeline_model_parallel_size=groups.size_of("pp"),
        expert_model_parallel_size=groups.size_of("ep"),
        expert_tensor_parallel_size=groups.size_of("expt_tp"),
        context_parallel_size=groups.size_of("cp"),
    )
    kw.update(extra)
    return GPTModel(pg_collection=groups, **kw)


def tp_group_of(param: torch.nn.Parameter, groups: ProcessGroupCollection):
    """The group ``param`` is split over: expert-TP for expert parameters, TP for the others."""
    return groups.expt_tp if is_expert_param(param) else groups.tp


def gather_tp(tensor: torch.Tensor, param: torch.nn.Parameter, tp_group) -> torch.Tensor:
    """Reassemble the full tensor from every TP rank's shard of ``param`` (stride aware)."""
    world = dist.get_world_size(tp_group)
    if world == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    shards: List[torch.Tensor] = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(shards, tensor.contiguous(), group=tp_group)
    dim, stride = param.partition_dim, param.partition_stride
    pieces = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][j] for j in range(stride) for r in range(world)], dim=dim)


def loss_and_grads(model: torch.nn.Module, tp_group, seed: int = 0):
    """One forward/backward of a GPT on ``batch(seed)``: the loss and every full (TP-gathered) gradient by name."""
    model.zero_grad(set_to_none=True)
    tokens, labels = batch(seed)
    loss = model(tokens, None, None, labels=labels).mean()  # [b, s] -> []
    loss.backward()
    allreduce_sequence_parallel_grads([model], tp_group)
    return loss.detach(), {n: gather_tp(p.grad, p, tp_group) for n, p in model.named_parameters()}


def batch(seed: int = 0, b: int = 2, s: int = SEQ, vocab: int = VOCAB):
    """Random token ids and next-token labels ``[b, s]``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def bert_config(groups: ProcessGroupCollection, **overrides) -> TransformerConfig:
    """A tiny BERT config (Hugging Face's LayerNorm eps) for ``groups``' TP/PP sizes; no dropout."""
    kw = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=1e-12,
        use_cpu_initialization=True,
        initialization_seed=1234,  # weights depend on each module's name only: the same for any layout
        tensor_model_parallel_size=groups.size_of("tp"),
        pipeline_model_parallel_size=groups.size_of("pp"),
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_bert(groups: ProcessGroupCollection, spec=None, seed: int = 1234, config=None, **model_kwargs) -> BertModel:
    """A BertModel (post-LN spec unless ``spec``), 2 token types, initialized from ``seed``."""
    torch.manual_seed(seed)
    kw = dict(num_tokentypes=2, vocab_size=VOCAB, max_sequence_length=SEQ, pg_collection=groups)
    kw.update(model_kwargs)
    return BertModel(config=config or bert_config(groups), transformer_layer_spec=spec or bert_layer_post_ln_spec, **kw)


def bert_batch(seed: int = 0, b: int = 3, s: int = SEQ, vocab: int = VOCAB) -> Dict[str, torch.Tensor]:
    """Token ids, padding mask (1 = token; sequence i has ``3*i`` padded positions at the end),
    token types (0 then 1), MLM labels, loss mask (a random ~30% of the real tokens) and NSP labels."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([s - 3 * i for i in range(b)])  # [b]
    positions = torch.arange(s)  # [s]
    padding = (positions[None, :] < lengths[:, None]).long()  # [b, s]
    types = (positions[None, :] >= lengths[:, None] // 2).long() * padding  # [b, s]
    loss_mask = (torch.rand(b, s, generator=g) < 0.3).float() * padding  # [b, s]
    return {
        "tokens": torch.randint(0, vocab, (b, s), generator=g),
        "padding": padding,
        "types": types,
        "labels": torch.randint(0, vocab, (b, s), generator=g),
        "loss_mask": loss_mask,
        "nsp": torch.randint(0, 2, (b,), generator=g),
    }


T5_VOCAB, T5_ENC, T5_DEC = 96, 12, 10


def t5_config(groups: ProcessGroupCollection, v11: bool = True, **overrides) -> TransformerConfig:
    """A tiny T5 config for ``groups``' TP size: T5 v1.1 numerics (``t5_v11_config``) or Megatron's
    (LayerNorm, biases, GeLU); 2 layers, 4 heads of 8, no dropout, layout-independent initialization."""
    from megatron.core.models.T5 import t5_v11_config

    kw = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        kv_channels=8,
        ffn_hidden_size=48,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        initialization_seed=1234,
        tensor_model_parallel_size=groups.size_of("tp"),
    )
    kw.update(overrides)
    return t5_v11_config(**kw) if v11 else TransformerConfig(**kw)


def build_t5(groups: ProcessGroupCollection, v11: bool = True, config=None, **model_kwargs):
    """A T5Model from ``t5_config``: the v1.1 layout (relative bias, untied head) or Megatron's local spec
    (learned absolute positions, tied head with bias)."""
    from megatron.core.models import T5

    config = config or t5_config(groups, v11)
    if v11:
        specs = (T5.get_t5_v11_encoder_block_spec(2), T5.get_t5_v11_decoder_block_spec(2))
        kw = dict(position_embedding_type="relative", relative_attention_num_buckets=8)
        kw.update(relative_attention_max_distance=16, share_embeddings_and_output_weights=False)
    else:
        specs = (T5.get_t5_encoder_with_local_block_spec(2), T5.get_t5_decoder_with_local_block_spec(2))
        kw = dict(share_embeddings_and_output_weights=True)
    kw.update(model_kwargs)
    return T5.T5Model(config, config, *specs, T5_VOCAB, 32, pg_collection=groups, **kw)


def t5_batch(seed: int = 0, b: int = 3) -> Dict[str, torch.Tensor]:
    """Encoder and decoder token ids (from 1), padding masks ``[b, s]`` (1 = token; sample i has ``3*i``
    encoder and ``2*i`` decoder pads at the end), labels, and the loss mask (the decoder padding)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(b)[:, None]  # [b, 1]
    enc_pad = (torch.arange(T5_ENC)[None, :] < T5_ENC - 3 * rows).long()  # [b, s_enc]
    dec_pad = (torch.arange(T5_DEC)[None, :] < T5_DEC - 2 * rows).long()  # [b, s_dec]
    return {
        "enc": torch.randint(1, T5_VOCAB, (b, T5_ENC), generator=g),
        "dec": torch.randint(1, T5_VOCAB, (b, T5_DEC), generator=g),
        "enc_pad": enc_pad,
        "dec_pad": dec_pad,
        "labels": torch.randint(0, T5_VOCAB, (b, T5_DEC), generator=g),
        "loss_mask": dec_pad.float(),
    }
