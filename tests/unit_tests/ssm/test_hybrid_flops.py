"""The hybrid Mamba FLOPs formula against torch's own count of a tiny ``M*M-`` model's forward pass.

``torch.utils.flop_counter`` counts every matmul per module. The formula follows Megatron's hybrid count: it
takes the projections, MLPs and logits exactly, replaces what a mixer does between its projections (scan,
convolution, gates) by Megatron's ``7 d N`` estimate and counts the causal half of each attention square
(``2 s q`` per token). Those two terms replace torch's count of the same modules; the rest must be equal.
"""

import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron.core import parallel_state as ps
from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers
from megatron.training.arguments import flops_config_from_args, parse_args, validate_args
from megatron.training.flops import FlopsConfig, num_floating_point_operations
from tests.dist_harness import run_distributed
from tests.unit_tests.ssm.mamba_utils import PATTERN, SEQ, VOCAB, build_mamba

BATCH = 2


def _module_totals(counter: FlopCounterMode) -> dict:
    return {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}


def _count(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    model = build_mamba(groups).eval()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None)
    totals = _module_totals(counter)
    mixers = [n for n in totals if n.endswith(".mixer")]
    internals = sum(totals[m] - totals[f"{m}.in_proj"] - totals[f"{m}.out_proj"] for m in mixers)
    attentions = [n for n in totals if n.endswith(".self_attention")]
    cores = sum(totals[a] - totals[f"{a}.linear_qkv"] - totals[f"{a}.linear_proj"] for a in attentions)
    c = model.config
    sizes = ("hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups", "kv_channels")
    sizes += ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups")
    config = {k: getattr(c, k) for k in sizes}
    return counter.get_total_flops(), internals + cores, (len(mixers), len(attentions)), config


def test_hybrid_flops_match_torch_count_with_megatron_conventions():
    counted, conventions, (num_mixers, num_attentions), sizes = run_distributed(_count, 1)[0]
    cfg = FlopsConfig(
        num_layers=len(PATTERN), seq_length=SEQ, padded_vocab_size=VOCAB, hybrid_layer_pattern=PATTERN, **sizes
    )
    c = cfg
    tokens = BATCH * SEQ
    assert (num_mixers, num_attentions) == (PATTERN.count("M"), PATTERN.count("*")) and conventions > 0
    d_inner = 2 * c.hidden_size  # mamba_num_heads unset: 2h / head_dim heads of head_dim channels
    scan_estimate = PATTERN.count("M") * 7 * d_inner * c.mamba_state_dim * tokens
    causal_half = PATTERN.count("*") * 2 * SEQ * c.num_attention_heads * c.kv_channels * tokens
    expected = counted - conventions + scan_estimate + causal_half
    assert num_floating_point_operations(cfg, BATCH) == 3 * expected


def test_pretrain_mamba_flags_give_the_hybrid_count_and_mark_the_model_hybrid():
    argv = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 40 --max-position-embeddings 40"
    argv += " --hybrid-attention-ratio 0.25 --hybrid-mlp-ratio 0.25 --mamba-state-dim 8 --mamba-head-dim 8"
    argv += " --micro-batch-size 1 --global-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data"
    argv += " --tokenizer-type NullTokenizer --vocab-size 64"
    args = validate_args(parse_args(argv.split(), entry_point="mamba"), world_size=1)
    args.padded_vocab_size = 64
    cfg = flops_config_from_args(args)
    assert args.is_hybrid_model  # pretrain_mamba.py builds a hybrid model without --is-hybrid-model
    assert cfg.hybrid_layer_pattern == "".join(allocate_layers(4, 0.25, 0.25))  # what MambaModel builds
    gpt = validate_args(parse_args(argv.split(), entry_point="gpt"), world_size=1)
    gpt.padded_vocab_size = 64
    assert not gpt.is_hybrid_model and flops_config_from_args(gpt).hybrid_layer_pattern is None
