"""The FLOPs formula for multi-latent attention (with and without DSA's indexer), shared experts and
multi-token prediction against torch's own count (the indexer's forward counted once: it has no backward).

``torch.utils.flop_counter`` counts the matmuls (and SDPA) of one forward pass of a tiny
DeepSeek-V3-style model; our per-iteration figure is 3x the forward without the router's gate
(``2*h*E`` per token and MoE layer), which the formula leaves out by design.
"""

import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron.core import parallel_state as ps
from megatron.training.flops import dsa_indexer_flops
from megatron.training.training_log import FlopsConfig, num_floating_point_operations
from tests.dist_harness import run_distributed
from tests.model_utils import SEQ, batch, build_gpt, deepseek_style

SPARSE = dict(dsa_indexer_topk=4)


def _counts(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    out = {}
    for q_lora_rank, mtp, dsa in ((16, 1, False), (None, 0, False), (16, 1, True)):
        extra = (
            dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=4, dsa_indexer_head_dim=12) if dsa else {}
        )
        kw = deepseek_style(q_lora_rank=q_lora_rank, mtp_num_layers=mtp or None, **extra, **SPARSE if dsa else {})
        model = build_gpt(kw, groups).eval()
        tokens, labels = batch(b=2)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(tokens, labels=labels)
        c = model.config
        cfg = FlopsConfig(
            num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
            ffn_hidden_size=c.ffn_hidden_size, seq_length=SEQ, padded_vocab_size=model.vocab_size, swiglu=True,
            num_moe_layers=sum(c.moe_layer_freq), moe_ffn_hidden_size=c.moe_ffn_hidden_size,
            moe_router_topk=c.moe_router_topk,
            moe_shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
            multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=c.kv_lora_rank,
            qk_head_dim=c.qk_head_dim, qk_pos_emb_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim,
            mtp_num_layers=mtp, **extra,
        )  # fmt: skip
        router = 2 * c.hidden_size * c.num_moe_experts * tokens.numel() * (cfg.num_moe_layers + mtp)
        indexer = tokens.numel() * (c.num_layers + mtp) * dsa_indexer_flops(cfg)  # forward only: no backward
        forward = (num_floating_point_operations(cfg, 2) - indexer) / 3 + indexer
        out[(q_lora_rank, dsa)] = (counter.get_total_flops() - router, forward)
    return out


def test_mla_shared_expert_and_mtp_flops_match_torch_count():
    for (q_lora_rank, dsa), (counted, formula) in run_distributed(_counts, 1)[0].items():
        assert counted == formula, f"q_lora_rank={q_lora_rank} dsa={dsa}: torch counts {counted}, the formula {formula}"
