"""Under sequence parallelism every dropout of a layer draws fresh random numbers.

The block runs its layers inside one fork of the model-parallel RNG stream. Attention
must not fork that stream again (Megatron does not under SP): a nested fork restarts the
stream from the state saved at the outer fork, so the attention-dropout mask and the
hidden-dropout mask after it would be drawn from the same offsets. The test records the
generator state at every dropout call (SDPA's internal dropout and the explicit
softmax's) and requires all of them to differ.
"""

from typing import List

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gpt2_style


def _generator_state() -> torch.Tensor:
    """The state of the generator the tracker forks (the GPU's where there is one)."""
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _recording(states: List[torch.Tensor]):
    """Wrap F.dropout and SDPA so each call with dropout records the generator state it starts from."""
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def dropout_hook(input_, p=0.5, training=True, inplace=False):
        if p > 0 and training:
            states.append(_generator_state())
        return dropout(input_, p, training, inplace)

    def sdpa_hook(*args, **kwargs):
        if kwargs.get("dropout_p", 0.0) > 0:
            states.append(_generator_state())
        return sdpa(*args, **kwargs)

    return dropout_hook, sdpa_hook


def _draw_states(attention_backend: str) -> List[torch.Tensor]:
    groups = ps.initialize_model_parallel(tensor_model_parallel_size=2)
    style = gpt2_style(hidden_dropout=0.1, attention_dropout=0.1, sequence_parallel=True)
    model = build_gpt(style, groups, attention_backend=attention_backend)
    model_parallel_cuda_manual_seed(7)
    states: List[torch.Tensor] = []
    dropout_hook, sdpa_hook = _recording(states)
    tokens, labels = batch()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(F, "dropout", dropout_hook)
        patch.setattr(F, "scaled_dot_product_attention", sdpa_hook)
        model(tokens, None, None, labels=labels)
    return states


def _body(rank: int, world_size: int, attention_backend: str) -> None:
    states = _draw_states(attention_backend)
    # Per layer: attention dropout + two hidden dropouts; plus the embedding dropout.
    assert len(states) == 1 + 3 * 2, len(states)
    for i in range(len(states)):
        for j in range(i):
            assert not torch.equal(states[i], states[j]), f"dropout calls {j} and {i} draw the same random numbers"


@pytest.mark.parametrize("attention_backend", ["auto", "unfused"])
def test_sequence_parallel_dropouts_draw_different_masks(attention_backend: str) -> None:
    run_distributed(_body, 2, attention_backend)
