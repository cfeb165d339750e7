"""The forward-backward functions take exactly Megatron-core's keywords and say no loudly.

An unknown keyword raises ``TypeError`` naming it, a missing one ``TypeError``, and the
keywords accepted for Megatron compatibility but not implemented raise ``NotImplementedError``
naming them; all before any communication (no process group is needed).
"""

import types

import pytest
import torch

from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

SCHEDULES = [
    forward_backward_no_pipelining,
    schedules.forward_backward_pipelining_without_interleaving,
    schedules.forward_backward_pipelining_with_interleaving,
]


def _keywords(**changes):
    base = dict(
        forward_step_func=lambda data_iterator, model: None,
        data_iterator=None,
        model=torch.nn.Linear(2, 2),
        num_microbatches=1,
        seq_length=4,
        micro_batch_size=1,
    )
    base.update(changes)
    return base


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda f: f.__name__)
def test_unknown_keyword_is_named(schedule):
    with pytest.raises(TypeError, match=rf"{schedule.__name__}\(\) got an unexpected keyword argument .tyop."):
        schedule(**_keywords(tyop=1, grad_scaler=None))


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda f: f.__name__)
def test_missing_keyword_is_named(schedule):
    kwargs = _keywords()
    del kwargs["seq_length"]
    with pytest.raises(TypeError, match="seq_length"):
        schedule(**kwargs)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "keyword, value",
    [
        ("adjust_tensor_shapes_fn", lambda recv, send: (recv, send)),
        ("p2p_communicator", object()),
        ("force_all_reduce", True),
    ],
)
def test_unimplemented_keywords_are_refused(schedule, keyword, value):
    with pytest.raises(NotImplementedError, match=keyword):
        schedule(**_keywords(**{keyword: value}))


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda f: f.__name__)
def test_a_decoder_length_of_its_own_is_refused_when_pipelined(schedule):
    """Encoder-decoder pipelines would send two activation shapes; without pipelining nothing is sent (T5 runs)."""
    two_stages = types.SimpleNamespace(size_of=lambda dim: 2 if dim == "pp" else 1)
    with pytest.raises(NotImplementedError, match="decoder_seq_length=8 != seq_length=4"):
        schedule(**_keywords(decoder_seq_length=8, pg_collection=two_stages))


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda f: f.__name__)
def test_without_groups_the_default_is_required(schedule):
    # pg_collection=None resolves to initialize_model_parallel's groups, which do not exist here.
    with pytest.raises(RuntimeError, match="not initialized"):
        schedule(**_keywords(first_val_step=True, decoder_seq_length=4))
