"""Pipelined GPT training equals the PP=1, TP=1 model with the same weights and data.

For each layout, GPT-2-style (tied embeddings, learned positions) and Llama-style (RoPE,
SwiGLU, GQA, untied) models with 4 layers are trained 3 SGD iterations through the
schedule; loss, every gradient and the weights after the steps are compared with the
single-process reference, then a forward-only evaluation loss. fp32; rtol=1e-5,
atol=1e-6 (only the order of float additions differs). Layouts marked ``D`` release each
stage output's storage once it is sent (``deallocate_pipeline_outputs``), as
``pretrain_gpt.py`` always does; backward then starts from the output's graph edge.
Each layout family runs each style: GPT-2-style PP=2 and TP=2+PP=2 without SP were dropped as repeats
(PP=4, interleaved PP=2 and the eight-rank TP=2+PP=2 with SP train that style).
"""

from megatron.core.parallel_state import ParallelLayout, build_process_groups
from tests.dist_harness import run_distributed
from tests.model_utils import gpt2_style, llama_style
from tests.unit_tests.pipeline_parallel.pipeline_parity import check_parity

STYLES = {"gpt2": gpt2_style, "llama": llama_style}


def _layouts(rank, world_size, layouts):
    """Run ``check_parity`` for each (tp, pp, vp, num_microbatches, style, sequence_parallel[, "D"])."""
    for tp, pp, vp, num_mb, style, sp, *dealloc in layouts:
        groups = build_process_groups(
            ParallelLayout(world_size=world_size, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        )
        kwargs = STYLES[style](num_layers=4, sequence_parallel=sp, deallocate_pipeline_outputs=bool(dealloc))
        check_parity(
            kwargs,
            groups,
            vp,
            num_mb,
            f"{style} tp={tp} pp={pp} vp={vp} dp={groups.size_of('dp')} sp={sp} dealloc={bool(dealloc)}",
        )


def test_pp2_and_interleaved():
    run_distributed(
        _layouts,
        2,
        [
            (1, 2, 1, 4, "llama", False),
            (1, 2, 2, 4, "gpt2", False, "D"),
            (1, 2, 2, 2, "llama", False),
        ],
    )


def test_pp4_and_tp2_pp2():
    run_distributed(
        _layouts,
        4,
        [
            (1, 4, 1, 4, "gpt2", False),
            (1, 4, 1, 5, "llama", False, "D"),
            (2, 2, 1, 2, "llama", True, "D"),
        ],
    )


def test_tp2_pp2_dp2_eight_ranks():
    run_distributed(_layouts, 8, [(2, 2, 1, 2, "gpt2", True, "D"), (2, 2, 2, 2, "llama", False)])
