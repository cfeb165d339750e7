"""Megatron-core's ``pipeline_parallel.schedules`` surface, called as upstream callers call it.

Signatures are keyword-only with upstream's names, ``deallocate_output_tensor`` really swaps the
data for one element and ``custom_backward`` still back-propagates through such an output (the
gradients equal a normal backward), the helper arithmetic gives upstream's numbers, and a 2-rank
pipeline driven through ``initialize_model_parallel`` + ``get_forward_backward_func()`` matches a
single-process reference.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer import TransformerConfig
from tests.dist_harness import run_distributed

UPSTREAM_KEYWORDS = [
    "forward_step_func",
    "data_iterator",
    "model",
    "num_microbatches",
    "seq_length",
    "micro_batch_size",
    "decoder_seq_length",
    "forward_only",
    "collect_non_loss_data",
    "first_val_step",
    "adjust_tensor_shapes_fn",
    "p2p_communicator",
    "pg_collection",
    "force_all_reduce",
]
SCHEDULES = [
    schedules.forward_backward_no_pipelining,
    schedules.forward_backward_pipelining_without_interleaving,
    schedules.forward_backward_pipelining_with_interleaving,
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda f: f.__name__)
def test_schedules_take_upstream_keywords_only(schedule):
    params = inspect.signature(schedule).parameters
    assert list(params) == UPSTREAM_KEYWORDS
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    required = [name for name, p in params.items() if p.default is inspect.Parameter.empty]
    assert required == UPSTREAM_KEYWORDS[:6]
    with pytest.raises(TypeError, match="forward_only_typo"):
        schedule(forward_only_typo=True)
    with pytest.raises(TypeError):
        schedule(lambda it, m: None, None, None, 1, 4, 1)  # positional use is refused, as upstream


def _graph():
    """A small graph with a non-view output [3, 2, 4] and its leaves."""
    torch.manual_seed(0)
    weight = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 2, 4, requires_grad=True)
    return weight, x, torch.tanh(x @ weight)


def test_deallocate_output_tensor_swaps_the_data_for_one_element():
    _, _, out = _graph()
    schedules.deallocate_output_tensor(out)  # default: deallocate_pipeline_outputs=False
    assert out.shape == (3, 2, 4)
    schedules.deallocate_output_tensor(None, deallocate_pipeline_outputs=True)
    schedules.deallocate_output_tensor(out, deallocate_pipeline_outputs=True)
    assert out.shape == (1,) and out.numel() == 1 and out.grad_fn is not None
    with pytest.raises(AssertionError):
        schedules.deallocate_output_tensor(_graph()[2][0], deallocate_pipeline_outputs=True)  # a view


def test_custom_backward_through_a_deallocated_output_equals_a_normal_backward():
    weight, x, out = _graph()
    grad_out = torch.randn(3, 2, 4)
    out.backward(grad_out)
    expected = (weight.grad.clone(), x.grad.clone())

    weight2, x2, out2 = _graph()
    schedules.deallocate_output_tensor(out2, deallocate_pipeline_outputs=True)
    with pytest.raises(RuntimeError):
        torch.autograd.backward(out2, grad_tensors=grad_out)  # the shape check custom_backward avoids
    schedules.custom_backward(out2, grad_out)
    torch.testing.assert_close((weight2.grad, x2.grad), expected, rtol=0, atol=0)

    loss = (x2 * 2).sum()  # grad_output None: a one-element output gets gradient 1
    schedules.custom_backward(loss, None)
    torch.testing.assert_close(x2.grad, expected[1] + 2)


def test_backward_step_upstream_form_returns_the_input_gradient():
    config = types.SimpleNamespace(grad_scale_func=None, deallocate_pipeline_outputs=True)
    weight, x, out = _graph()
    grad_out = torch.randn(3, 2, 4)
    schedules.deallocate_output_tensor(out, config.deallocate_pipeline_outputs)
    grads = schedules.backward_step([x], [out], [grad_out], None, config)
    weight_ref, x_ref, out_ref = _graph()
    out_ref.backward(grad_out)
    assert isinstance(grads, list) and len(grads) == 1
    torch.testing.assert_close(grads[0], x_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(weight.grad, weight_ref.grad, rtol=0, atol=0)


class _Group:
    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_get_tensor_shapes():
    config = types.SimpleNamespace(sequence_parallel=False, hidden_size=16)
    kw = dict(micro_batch_size=2, config=config, tp_group=_Group(2), cp_group=_Group(1))
    assert schedules.get_tensor_shapes(seq_length=8, decoder_seq_length=None, **kw) == [(8, 2, 16)]
    assert schedules.get_tensor_shapes(seq_length=8, decoder_seq_length=4, **kw) == [(4, 2, 16)]
    config.sequence_parallel = True
    assert schedules.get_tensor_shapes(seq_length=8, decoder_seq_length=None, **kw) == [(4, 2, 16)]
    kw["cp_group"] = _Group(2)
    assert schedules.get_tensor_shapes(seq_length=8, decoder_seq_length=None, **kw) == [(2, 2, 16)]


def test_pp_rank_microbatches_and_schedule_table():
    comm = types.SimpleNamespace(pp_group=_Group(4, 1), virtual_pipeline_model_parallel_size=None)
    assert schedules.get_pp_rank_microbatches(8, 1, 8, p2p_communicator=comm) == (8, False, 2, 6)
    assert schedules.get_pp_rank_microbatches(8, 1, 8, forward_only=True, p2p_communicator=comm) == (8, True, 8, 0)
    comm.virtual_pipeline_model_parallel_size = 2
    # 2 x (4 - 1 - 1) + (2 - 1) x 4 = 8 of 16; one more with the MoE overlap
    assert schedules.get_pp_rank_microbatches(8, 2, 4, p2p_communicator=comm) == (16, False, 8, 8)
    assert schedules.get_pp_rank_microbatches(8, 2, 4, False, True, comm) == (16, False, 9, 7)
    assert schedules.get_pp_rank_microbatches(2, 2, 4, p2p_communicator=comm) == (4, True, 4, 0)
    assert schedules.get_schedule_table(5, 2, 2) == [
        (0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1), (4, 0), (4, 1)
    ]  # fmt: skip
    assert schedules.check_first_val_step(False, True, True) is False
    assert schedules.check_first_val_step(False, False, True) is True
    assert schedules.check_first_val_step(None, True, False) is False


def test_set_current_microbatch_and_embedding_buffer_helpers():
    layers = torch.nn.ModuleList([torch.nn.Identity(), torch.nn.Identity()])
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = layers
    schedules.set_current_microbatch(model, 3)
    assert [layer.current_microbatch for layer in layers] == [3, 3]
    schedules.set_current_microbatch(torch.nn.Linear(1, 1), 3)  # no decoder: nothing to do
    off = types.SimpleNamespace(defer_embedding_wgrad_compute=False)
    assert schedules.clear_embedding_activation_buffer(off, model, True) is None
    assert schedules.finish_embedding_wgrad_compute(off, None, True, None) is None
    on = types.SimpleNamespace(defer_embedding_wgrad_compute=True)
    with pytest.raises(NotImplementedError, match="defer_embedding_wgrad_compute"):
        schedules.clear_embedding_activation_buffer(on, model, True)


# ----------------------------------------------------------------------------------
# A 2-stage pipeline set up the upstream way, against a single-process reference.
# ----------------------------------------------------------------------------------
SEQ, MBS, HIDDEN, MICROBATCHES = 3, 2, 4, 4


class _Stage(torch.nn.Module):
    """One linear + tanh; the first stage reads the batch, the other its received input."""

    def __init__(self, config: TransformerConfig, first: bool) -> None:
        super().__init__()
        self.config, self.first, self.input_tensor = config, first, None
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)

    def set_input_tensor(self, tensors) -> None:
        self.input_tensor = tensors[0]

    def forward(self, x):
        return torch.tanh(self.linear(x if self.first else self.input_tensor))


def _loss_func(output):
    return output.square().sum(), torch.tensor(output.numel()), {"loss": output.square().mean().detach()}


def _forward_step(data_iterator, model):
    return model(next(data_iterator) if model.first else None), _loss_func


def _stages_and_batches():
    torch.manual_seed(7)
    stages = [torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(2)]
    batches = [torch.randn(SEQ, MBS, HIDDEN) for _ in range(MICROBATCHES)]
    return stages, batches


def _pipeline_body(rank, world_size):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    try:
        config = TransformerConfig(
            num_layers=2, hidden_size=HIDDEN, num_attention_heads=1, pipeline_model_parallel_size=2,
            pipeline_dtype=torch.float32, deallocate_pipeline_outputs=True,
        )  # fmt: skip
        reference, batches = _stages_and_batches()
        model = _Stage(config, first=rank == 0)
        model.linear.load_state_dict(reference[rank].state_dict())
        func = schedules.get_forward_backward_func()
        assert func is schedules.forward_backward_pipelining_without_interleaving
        losses = func(
            forward_step_func=_forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS, forward_only=False,
        )  # fmt: skip
        expected = 0.0
        for x in batches:  # reference: the mean token loss of each microbatch, averaged
            expected = expected + torch.tanh(reference[1](torch.tanh(reference[0](x)))).square().mean() / MICROBATCHES
        expected.backward()
        torch.testing.assert_close(model.linear.weight.grad, reference[rank].weight.grad)
        torch.testing.assert_close(model.linear.bias.grad, reference[rank].bias.grad)
        if rank == 1:
            assert len(losses) == MICROBATCHES and set(losses[0]) == {"loss"}
        else:
            assert losses == []
    finally:
        parallel_state.destroy_model_parallel()


def test_two_stage_pipeline_through_the_default_groups_matches_reference():
    run_distributed(_pipeline_body, 2)


def test_forward_step_and_calc_loss_upstream_form():
    """The loss is divided by the token count and the microbatches; the reporting dict is stored."""
    config = types.SimpleNamespace(calculate_per_token_loss=False, grad_scale_func=None, num_moe_experts=None)
    model = _Stage(config, first=True)
    x = torch.randn(SEQ, MBS, HIDDEN)
    store = []
    loss, tokens = schedules.forward_step(lambda it, m: _forward_step(it, m), iter([x]), model, 4, None, store, config)
    expected = torch.tanh(model.linear(x)).square().sum() / x.numel() / 4
    torch.testing.assert_close(loss, expected)
    assert int(tokens) == x.numel() and len(store) == 1 and "loss" in store[0]
    out = model(x)
    loss2, _ = schedules.forward_step_calc_loss(model, out, _loss_func, config, None, False, 4, store, None, True)
    torch.testing.assert_close(loss2, expected)
    passed, zero = schedules.forward_step_calc_loss(model, out, _loss_func, config, None, False, 4, store, 1, False)
    assert passed is out and int(zero) == 0 and len(store) == 2  # not the last stage: the activation, unchanged
    with pytest.raises(NotImplementedError):
        schedules.forward_step(_forward_step, iter([x]), model, 4, None, store, config, 2)  # cp_group_size=2
