"""The FLOPs formula of DeepSeek-V4 against torch's count of a forward and a backward of the tiny V4 model.

The parity test's model (CSA, HCA and sliding layers, window 6, CSA top-3 of 10 entries, HCA 5 entries, three
hyper-connection streams with their heads, a hash-routed then two learned MoE layers with shared experts, the
grouped low-rank output) plus one MTP module, on 2 x 40 tokens. ``torch.utils.flop_counter`` counts every matmul
(``mm``, ``bmm``; the einsums of the window, the compressed entries, the grouped output and the stream mixes run as
``bmm``); the ``FlopsConfig`` comes from the ``pretrain_gpt.py`` flags of the same model, so the flag records'
wiring is checked too. The formula must equal the count exactly, less one convention: the routers' gates
(``2 h E`` per token and MoE layer, the hash layer's too: its gate still weights the chosen experts), which
Megatron's count leaves out. The forward is counted per module under ``no_grad`` (torch's module tracker cannot
enter the indexer, which runs without gradient inside a graph); the backward is counted alone and must be twice the
forward except for the CSA indexer, which has none (the formula adds it once). Dropping any term (the compressors,
the window, the top-k attention, the indexer, the grouped output, the stream mixes, a hyper head, the MTP
module's) changes the total, so the equality fails.
"""

import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron.training import arguments as A
from megatron.training.flops import compressed_attention_flops, hyper_connection_flops, num_floating_point_operations
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, single_rank_groups
from tests.unit_tests.models.test_deepseek_v4_parity import TYPES, V4_MODEL, VOCAB, S

BATCH = 2
MODEL = dict(V4_MODEL, mtp_num_layers=1)
ARGV = (
    "--num-layers 3 --hidden-size 32 --num-attention-heads 4 --kv-channels 16 --ffn-hidden-size 16 "
    f"--seq-length {S} --max-position-embeddings {S} --micro-batch-size {BATCH} --global-batch-size {BATCH} "
    "--train-iters 1 --lr 1e-4 --swiglu --normalization RMSNorm --disable-bias-linear "
    "--untie-embeddings-and-output-weights --position-embedding-type rope --rotary-percent 0.5 --rotary-interleaved "
    f"--q-lora-rank 12 --window-size 5,0 --compressed-attention-layer-types {' '.join(TYPES)} "
    "--csa-compress-rate 4 --hca-compress-rate 8 --attention-output-groups 2 --attention-output-lora-rank 6 "
    "--dsa-indexer-n-heads 2 --dsa-indexer-head-dim 8 --dsa-indexer-topk 3 --hyper-connection-streams 3 "
    "--num-experts 4 --moe-ffn-hidden-size 16 --moe-router-topk 2 --moe-shared-expert-intermediate-size 16 "
    "--moe-num-hash-layers 1 --moe-router-score-function sigmoid --mtp-num-layers 1"
).split()


def _count(rank, world_size):
    model = build_gpt(MODEL, single_rank_groups())
    tokens, labels = batch(b=BATCH, s=S, vocab=VOCAB)
    with torch.no_grad(), FlopCounterMode(display=False) as forward:
        model(tokens, labels=labels)
    totals = {name: sum(ops.values()) for name, ops in forward.get_flop_counts().items()}
    routers = sum(v for name, v in totals.items() if name.endswith(".mlp.router"))
    indexer = sum(v for name, v in totals.items() if name.endswith(".indexer"))
    loss = model(tokens, labels=labels).sum()
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return forward.get_total_flops(), routers, indexer, backward.get_total_flops()


def test_deepseek_v4_flops_match_torch_count():
    forward, routers, indexer, backward = run_distributed(_count, 1)[0]
    args = A.validate_args(A.parse_args(ARGV, entry_point="gpt"), 1)
    args.padded_vocab_size = VOCAB
    cfg = A.flops_config_from_args(args)
    assert cfg.compressed_attention_layer_types == TYPES and cfg.hyper_connection_streams == 3
    assert routers == 2 * BATCH * S * cfg.hidden_size * 4 * 4  # 3 decoder MoE layers and the MTP layer's, 4 experts
    assert indexer == BATCH * S * compressed_attention_flops(cfg, TYPES[0])[1] > 0  # CSA's indexer, forward only
    assert backward == 2 * (forward - indexer)  # the indexer has no backward
    assert min(hyper_connection_flops(cfg)) > 0
    formula = num_floating_point_operations(cfg, BATCH)
    assert formula == 3 * (forward - routers - indexer) + indexer, (formula, forward, routers, indexer)
