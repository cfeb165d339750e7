"""Microbatch calculators: constant, ramp-up, decrease-to-fit, and the module facade."""

import pytest

from megatron.core import num_microbatches_calculator as nmc


def test_constant_counts_microbatches():
    calc = nmc.ConstantNumMicroBatchesCalculator(global_batch_size=48, micro_batch_size=3, data_parallel_size=4)
    assert calc.get() * 3 * 4 == 48
    calc.update(10**6)
    assert calc.get_current_global_batch_size() == 48


def test_constant_refuses_indivisible_batch_and_names_sizes():
    with pytest.raises(ValueError, match=r"global batch size \(50\).*micro batch size \(3\).*\(4\)"):
        nmc.ConstantNumMicroBatchesCalculator(50, 3, 4)


def test_decrease_batch_size_if_needed_runs_largest_fitting_multiple():
    calc = nmc.ConstantNumMicroBatchesCalculator(50, 3, 4, decrease_batch_size_if_needed=True)
    largest = max(k for k in range(1, 51) if k % 12 == 0)
    assert calc.get_current_running_global_batch_size() == largest
    assert calc.get() == largest // 12
    assert calc.get_current_global_batch_size() == 50


def _expected_rampup(consumed, start, incr, samples, final):
    n_incr = (final - start) // incr
    per = samples / n_incr
    if consumed > samples:
        return final
    done = sum(1 for k in range(1, n_incr + 1) if consumed >= k * per)
    return min(start + incr * done, final)


@pytest.mark.parametrize("consumed", [0, 1, 49, 50, 51, 149, 150, 299, 300, 301, 10_000])
def test_rampup_follows_equal_sample_blocks(consumed):
    start, incr, samples, final, mbs, dp = 16, 8, 300, 64, 2, 4
    calc = nmc.RampupBatchsizeNumMicroBatchesCalculator(final, mbs, dp, False, 0, start, incr, samples)
    calc.update(consumed, consistency_check=True)
    want = _expected_rampup(consumed, start, incr, samples, final)
    assert calc.get_current_global_batch_size() == want
    assert calc.get() == want // (mbs * dp)


def test_rampup_rejects_bad_increment():
    with pytest.raises(ValueError, match="multiple of the increment"):
        nmc.RampupBatchsizeNumMicroBatchesCalculator(64, 1, 1, False, 0, 16, 10, 100)


def test_facade_uses_one_calculator():
    nmc.destroy_num_microbatches_calculator()
    with pytest.raises(RuntimeError, match="not initialized"):
        nmc.get_num_microbatches()
    try:
        nmc.init_num_microbatches_calculator(0, ["4", "4", "80"], 12, 2, 2)
        assert nmc.get_current_global_batch_size() == 4 and nmc.get_num_microbatches() == 1
        with pytest.raises(RuntimeError, match="already initialized"):
            nmc.init_num_microbatches_calculator(0, None, 12, 2, 2)
        nmc.update_num_microbatches(40)  # 2 increments over 80 samples: one every 40
        assert nmc.get_current_global_batch_size() == 8 and nmc.get_num_microbatches() == 2
        nmc.update_num_microbatches(81)
        assert nmc.get_current_global_batch_size() == 12 and nmc.get_micro_batch_size() == 2
    finally:
        nmc.destroy_num_microbatches_calculator()
