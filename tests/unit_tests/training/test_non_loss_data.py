"""``pretrain(process_non_loss_data_func=...)``: called after each evaluation with the collected data."""

from __future__ import annotations

from typing import List

import torch

from tests.dist_harness import run_distributed
from tests.functional_tests.gpt_runs import mock_flags, tiny_gpt_flags, with_flags


def _pretrain_body(rank: int, world_size: int, argv: List[str]) -> list:
    import pretrain_gpt
    from megatron.core.transformer.enums import ModelType
    from megatron.training.training import pretrain

    calls = []

    def forward_step(data_iterator, model):
        output, loss_func = pretrain_gpt.forward_step(data_iterator, model)

        def loss_or_data(output_tensor, non_loss_data=False):
            return output_tensor.detach().clone() if non_loss_data else loss_func(output_tensor)

        return output, loss_or_data

    def process(collected, iteration, writer):
        calls.append((iteration, [tuple(t.shape) for t in collected], torch.stack(collected).mean().item(), writer))

    pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        process_non_loss_data_func=process,
        argv=argv,
    )
    return calls


def test_called_on_the_last_rank_after_each_evaluation():
    """4 iterations, --eval-interval 2: after iterations 2 and 4, then the final validation and test."""
    argv = with_flags(tiny_gpt_flags(4) + mock_flags(), {"--eval-interval": "2"})
    per_rank = run_distributed(_pretrain_body, 2, argv, timeout=300)
    assert per_rank[0] == []  # Megatron calls it on the last rank only
    calls = per_rank[1]
    assert [iteration for iteration, *_ in calls] == [2, 4, 4, 4]
    # DP=2: each rank's share of one global batch of 8, micro batches of 2 -> 2 micro batches of per-token losses
    assert all(shapes == [(2, 32), (2, 32)] for _, shapes, _, _ in calls)
    assert all(mean > 0 for _, _, mean, _ in calls) and all(writer is None for *_, writer in calls)
