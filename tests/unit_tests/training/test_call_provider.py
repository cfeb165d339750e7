"""Entry-point providers: what decides the model is always passed, conveniences only where declared."""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.transformer.enums import ModelType
from megatron.training.model_setup import build_model_chunks
from megatron.training.utils import call_provider


def megatron_style(pre_process=True, post_process=True):
    """A provider written for Megatron-LM: reads the rest from get_args()."""
    return ("built", pre_process, post_process)


def test_offered_keywords_only_where_declared():
    assert call_provider(megatron_style, pre_process=False, post_process=True, offered={"config": 1}) == (
        "built",
        False,
        True,
    )
    taking_config = lambda pre_process, post_process, config: config  # noqa: E731
    assert call_provider(taking_config, pre_process=True, post_process=True, offered={"config": 7, "args": 8}) == 7
    taking_all = lambda num_samples, **kwargs: (num_samples, kwargs)  # noqa: E731
    assert call_provider(taking_all, [1, 2], offered={"args": 3}) == ([1, 2], {"args": 3})


def test_required_keyword_the_provider_lacks_is_a_type_error():
    """A Megatron-LM provider without vp_stage under virtual pipelining would build chunk 0 every time."""
    with pytest.raises(TypeError, match="megatron_style does not take vp_stage"):
        call_provider(megatron_style, pre_process=True, post_process=True, vp_stage=1)


def test_required_wins_over_offered():
    with_stage = lambda pre_process, post_process, vp_stage=None: vp_stage  # noqa: E731
    assert call_provider(with_stage, pre_process=True, post_process=True, vp_stage=1, offered={"vp_stage": None}) == 1
    assert call_provider(with_stage, pre_process=True, post_process=True, offered={"vp_stage": None}) is None


class _Groups:
    def rank_in(self, name):
        return 0

    def size_of(self, name):
        return 1


def test_model_chunks_need_vp_stage_under_virtual_pipelining():
    args = SimpleNamespace(virtual_pipeline_model_parallel_size=2)

    def with_stage(pre_process, post_process, vp_stage=None):
        return torch.nn.Linear(1, 1) if vp_stage is not None else None

    chunks = build_model_chunks(with_stage, ModelType.encoder_or_decoder, args, None, _Groups())
    assert len(chunks) == 2
    with pytest.raises(TypeError, match="does not take vp_stage"):
        build_model_chunks(lambda pre_process, post_process: None, ModelType.encoder_or_decoder, args, None, _Groups())
