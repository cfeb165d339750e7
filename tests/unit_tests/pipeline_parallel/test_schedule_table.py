"""Schedule tables and communication plans, checked without processes.

Exact expectations: op counts and order, the 1F1B in-flight bound p - i, the ideal-machine
bubble (p-1)/(v*m) to 1e-9, deadlock freedom under blocking untagged transfers.
"""

import pytest

from megatron.core.pipeline_parallel import schedule_table as st
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining, get_forward_backward_func
from megatron.core.transformer.layer_layout import pipeline_layer_assignment

CASES = [(p, m, v) for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16) for v in (1, 2, 3) if v == 1 or m % p == 0]


@pytest.mark.parametrize("p,m,v", CASES)
@pytest.mark.parametrize("forward_only", [False, True])
def test_every_op_once_backward_after_forward(p, m, v, forward_only):
    table = st.schedule_table(p, m, v, forward_only)
    st.check_table(table, m, v, forward_only)
    assert all(len(ops) == m * v * (1 if forward_only else 2) for ops in table)


@pytest.mark.parametrize("p,m", [(p, m) for p, m, v in CASES if v == 1])
def test_1f1b_in_flight_bound(p, m):
    for rank, ops in enumerate(st.schedule_table(p, m)):
        assert st.max_in_flight(ops) == min(p - rank, m), (rank, st.format_table([ops]))


@pytest.mark.parametrize("p,m,v", CASES)
def test_ideal_bubble_matches_theory(p, m, v):
    makespan, busy = st.simulate(st.schedule_table(p, m, v), v, t_forward=1.0, t_backward=2.0)
    assert all(b == pytest.approx(3.0 * m) for b in busy)
    assert (makespan - busy[0]) / busy[0] == pytest.approx((p - 1) / (v * m), abs=1e-9)


@pytest.mark.parametrize("p,m,v", CASES)
@pytest.mark.parametrize("forward_only", [False, True])
def test_comm_plan_pairs_up_and_never_deadlocks(p, m, v, forward_only):
    st.check_comm_plan(p, m, v, forward_only)


def test_per_op_batches_would_deadlock_interleaved():
    """Why slots: posting each op's transfers alone deadlocks interleaved 1F1B (p=2, m=4, v=2)."""
    per_op = [[[op] for op in ops] for ops in st.schedule_table(2, 4, 2)]
    plans = [st.comm_plan(slots, r, 2, 2) for r, slots in enumerate(per_op)]
    with pytest.raises(RuntimeError, match="deadlocks"):
        st._simulate_blocking(plans)


def test_known_tables():
    assert st.format_table(st.schedule_table(2, 4)) == (
        "rank 0: F0 F1 B0 F2 B1 F3 B2 B3\nrank 1: F0 B0 F1 B1 F2 B2 F3 B3"
    )
    assert st.format_table(st.schedule_table(2, 2, 2)) == (
        "rank 0: F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1\nrank 1: F0 F1 F0.1 B0.1 F1.1 B1.1 B0 B1"
    )


def test_simulate_detects_a_deadlocked_table():
    table = st.schedule_table(2, 2)
    table[1] = [st.Op("B", 0, 0), st.Op("F", 0, 0)] + table[1][2:]
    with pytest.raises(RuntimeError, match="deadlocks"):
        st.simulate(table)


def test_invalid_interleaving_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"num_microbatches \(6\) to be a multiple of pipeline_model_parallel_size \(4\)"
    ):
        st.schedule_table(4, 6, 2)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        st.schedule_table(2, 0)


def test_invalid_layer_split_is_a_clear_error():
    with pytest.raises(ValueError, match="not divisible by 2 virtual pipeline chunks"):
        pipeline_layer_assignment(6, 2, 2)
    with pytest.raises(ValueError, match="num_layers=5 cannot be split over pipeline_model_parallel_size=2"):
        pipeline_layer_assignment(5, 2)


def test_schedule_selection():
    assert get_forward_backward_func(1) is forward_backward_no_pipelining
    assert get_forward_backward_func(2) is schedules.forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(2, 1) is schedules.forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(2, 2) is schedules.forward_backward_pipelining_with_interleaving
