"""The FLOPs formula of a Qwen3-Next-style model (Gated DeltaNet and gated attention layers) against torch's count.

``torch.utils.flop_counter`` counts every matmul of one forward pass per module. The formula takes the projections,
MLPs and logits exactly; between a GDN layer's projections it counts Megatron's terms for the convolution
(``K (2 qk + v)``) and the delta rule (``4 Hv dv^2``), and for attention the whole ``s x s`` square (``4 s q``, the
GPT count's convention). Those terms replace torch's count of the same modules; the rest must be equal.
"""

import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron.training.flops import FlopsConfig, num_floating_point_operations
from tests.dist_harness import run_distributed
from tests.model_utils import VOCAB, single_rank_groups
from tests.unit_tests.ssm.qwen3_next_utils import DENSE, GDN, SEQ, build_qwen3_next

BATCH = 2


def _count(rank, world_size):
    model = build_qwen3_next(single_rank_groups(), **DENSE)  # no router: the formula leaves it out
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, VOCAB, (BATCH, SEQ)), torch.arange(SEQ).expand(BATCH, SEQ), None)
    totals = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    mixers = [n[: -len(".in_proj")] for n in totals if n.endswith("self_attention.in_proj")]
    internals = sum(totals[m] - totals[f"{m}.in_proj"] - totals[f"{m}.out_proj"] for m in mixers)
    attentions = [n[: -len(".linear_qkv")] for n in totals if n.endswith("self_attention.linear_qkv")]
    cores = sum(totals[a] - totals[f"{a}.linear_qkv"] - totals[f"{a}.linear_proj"] for a in attentions)
    c = model.config
    sizes = {k: getattr(c, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")}
    sizes.update({k: getattr(c, k) for k in ("num_query_groups", "kv_channels", "linear_conv_kernel_dim")})
    return counter.get_total_flops(), internals + cores, (len(mixers), len(attentions)), sizes


def test_gated_delta_net_flops_match_torch_count():
    counted, conventions, (num_gdn, num_attention), sizes = run_distributed(_count, 1)[0]
    cfg = FlopsConfig(
        **sizes, seq_length=SEQ, padded_vocab_size=VOCAB, swiglu=True, attention_output_gate=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=2, **GDN,
    )  # fmt: skip
    assert (num_gdn, num_attention) == (2, 2) and conventions > 0  # linear_attention_freq=2: GDN, attention, ...
    qk = GDN["linear_num_key_heads"] * GDN["linear_key_head_dim"]
    heads, dv = GDN["linear_num_value_heads"], GDN["linear_value_head_dim"]
    conv_and_rule = 2 * (cfg.linear_conv_kernel_dim * (2 * qk + heads * dv) + 4 * heads * dv * dv)
    core = 4 * SEQ * cfg.num_attention_heads * cfg.kv_channels
    expected = counted - conventions + BATCH * SEQ * (num_gdn * conv_and_rule + num_attention * core)
    assert num_floating_point_operations(cfg, BATCH) == 3 * expected
