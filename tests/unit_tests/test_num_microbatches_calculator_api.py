"""Megatron Core 0.16's ``num_microbatches_calculator`` API, called as upstream callers do."""

import pytest

from megatron.core import num_microbatches_calculator as nmc
from megatron.core.num_microbatches_calculator import (
    ConstantNumMicroBatchesCalculator,
    RampupBatchsizeNumMicroBatchesCalculator,
    destroy_num_microbatches_calculator,
    get_current_global_batch_size,
    get_current_running_global_batch_size,
    get_micro_batch_size,
    get_num_microbatches,
    init_num_microbatches_calculator,
    reconfigure_num_microbatches_calculator,
    unset_num_microbatches_calculator,
    update_num_microbatches,
)


@pytest.fixture(autouse=True)
def _fresh_calculator():
    destroy_num_microbatches_calculator()
    yield
    destroy_num_microbatches_calculator()


def test_init_sets_the_module_global_and_double_init_asserts():
    assert nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None
    init_num_microbatches_calculator(0, None, 32, 8, 2)
    assert isinstance(nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR, ConstantNumMicroBatchesCalculator)
    assert get_num_microbatches() == 2 and get_current_global_batch_size() == 32 and get_micro_batch_size() == 8
    with pytest.raises(AssertionError):
        init_num_microbatches_calculator(0, None, 32, 8, 2)
    unset_num_microbatches_calculator()
    assert nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None


def test_reconfigure_replaces_the_calculator():
    init_num_microbatches_calculator(0, None, 32, 8, 2)
    reconfigure_num_microbatches_calculator(0, None, 16, 2, 2)
    assert get_num_microbatches() == 4 and get_micro_batch_size() == 2
    reconfigure_num_microbatches_calculator(0, [4, 4, 100], 16, 2, 2)
    assert isinstance(nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR, RampupBatchsizeNumMicroBatchesCalculator)
    assert get_current_global_batch_size() == 4 and get_num_microbatches() == 1
    destroy_num_microbatches_calculator()
    reconfigure_num_microbatches_calculator(0, None, 8, 2, 2)  # also works without a calculator
    assert get_num_microbatches() == 2


def test_a_calculator_assigned_to_the_module_global_is_used():
    nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR = ConstantNumMicroBatchesCalculator(24, 2, 3, False, 0)
    assert get_num_microbatches() == 4


def test_rampup_through_the_facade():
    # start 16, +16 per step, over 1000 samples to 48: two increments, one every 500 samples
    init_num_microbatches_calculator(0, [16, 16, 1000], 48, 2, 2)
    for consumed, batch in ((0, 16), (499, 16), (500, 32), (999, 32), (1000, 48), (5000, 48)):
        update_num_microbatches(consumed, consistency_check=True)
        assert get_current_global_batch_size() == batch and get_num_microbatches() == batch // 4, consumed


def test_decrease_batch_size_if_needed():
    init_num_microbatches_calculator(0, None, 30, 2, 4, decrease_batch_size_if_needed=True)
    assert get_current_global_batch_size() == 30
    assert get_current_running_global_batch_size() == 24 and get_num_microbatches() == 3


def test_constant_calculator_signature_and_assertions():
    calc = ConstantNumMicroBatchesCalculator(
        global_batch_size=16, micro_batch_size=2, data_parallel_size=2, decrease_batch_size_if_needed=False, rank=0
    )
    calc.update(100, False)
    assert calc.get() == 4 and calc.get_current_running_global_batch_size() == 16
    with pytest.raises(AssertionError):
        ConstantNumMicroBatchesCalculator(15, 2, 2, False, 0)
    with pytest.raises(AssertionError):
        init_num_microbatches_calculator(0, [16, 16], 48, 2, 2)  # ramp-up needs three values


def test_rampup_calculator_signature_and_assertions():
    calc = RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=32,
        micro_batch_size=2,
        data_parallel_size=2,
        decrease_batch_size_if_needed=False,
        rank=0,
        start_global_batch_size=8,
        batch_size_increment=8,
        ramup_samples=300,
    )
    assert calc.rampup_samples_per_increment == 100
    calc.update(250, True)
    assert calc.get_current_global_batch_size() == 24
    with pytest.raises(AssertionError):  # 32 - 8 is not a multiple of 7
        RampupBatchsizeNumMicroBatchesCalculator(32, 2, 2, False, 0, 8, 7, 300)
