"""How many microbatches make one global batch, with optional batch-size ramp-up.

The calculator classes are plain objects usable on their own. Megatron's
module-level functions (``init_num_microbatches_calculator``,
``get_num_microbatches`` ...) are a facade over one default instance, kept for
API compatibility.

Terms: ``micro_batch_size x data_parallel_size`` samples are consumed per
microbatch step across the data-parallel replicas, so a global batch of ``G``
samples takes ``G / (micro_batch_size x data_parallel_size)`` microbatches.
"""

from __future__ import annotations

import logging
from typing import List, Optional

logger = logging.getLogger(__name__)


class BatchSizeError(ValueError, AssertionError):
    """Batch sizes that do not fit together (Megatron asserts: an ``AssertionError`` too)."""


class CalculatorStateError(RuntimeError, AssertionError):
    """The default calculator is missing, or initialized twice (Megatron asserts on the latter)."""


class NumMicroBatchesCalculator:
    """Common state: current global batch and the number of microbatches it takes."""

    def __init__(
        self, micro_batch_size: int, data_parallel_size: int, decrease_batch_size_if_needed: bool, rank: int = 0
    ) -> None:
        for name, value in (("micro_batch_size", micro_batch_size), ("data_parallel_size", data_parallel_size)):
            if value < 1:
                raise BatchSizeError(f"{name}={value}: must be a positive integer")
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.rank = rank
        self.num_micro_batches = 0
        self.current_global_batch_size = 0
        self.current_running_global_batch_size = 0

    def _set_global_batch(self, global_batch_size: int, consistency_check: bool) -> None:
        """Set the nominal global batch and the one actually run (a multiple of mbs x dp)."""
        step = self.micro_batch_times_data_parallel_size
        if global_batch_size % step and not self.decrease_batch_size_if_needed and consistency_check:
            raise BatchSizeError(
                f"global batch size ({global_batch_size}) is not divisible by micro batch size "
                f"({self.micro_batch_size}) x data parallel size ({self.data_parallel_size}) = {step}"
            )
        running = global_batch_size // step * step
        if running == 0:
            raise BatchSizeError(
                f"global batch size ({global_batch_size}) is smaller than micro batch size "
                f"({self.micro_batch_size}) x data parallel size ({self.data_parallel_size}) = {step}"
            )
        self.current_global_batch_size = global_batch_size
        # With --decrease-batch-size-if-needed the run uses the largest multiple that fits.
        self.current_running_global_batch_size = running
        self.num_micro_batches = running // step

    def get(self) -> int:
        """Number of microbatches in the current global batch."""
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        """The nominal global batch size at this point of training."""
        return self.current_global_batch_size

    def get_current_running_global_batch_size(self) -> int:
        """The global batch size actually run (smaller when decreased to fit)."""
        return self.current_running_global_batch_size

    def get_micro_batch_size(self) -> int:
        return self.micro_batch_size

    def update(self, consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
        """Recompute the batch for ``consumed_samples``; constant calculators ignore it."""


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """A fixed global batch for the whole run."""

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool = False,
        rank: int = 0,
    ) -> None:
        super().__init__(micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank)
        self.global_batch_size = global_batch_size
        self._set_global_batch(global_batch_size, consistency_check=True)


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Global batch grows from ``start_global_batch_size`` by ``batch_size_increment``
    in equal steps spread over the first ``ramup_samples`` consumed samples.

    With ``n = (global - start) / increment`` increments, each lasts
    ``ramup_samples / n`` samples; after ``ramup_samples`` the full global batch is used.
    """

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool,
        rank: int,
        start_global_batch_size: int,
        batch_size_increment: int,
        ramup_samples: int,
    ) -> None:
        super().__init__(micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank)
        if start_global_batch_size < 1 or batch_size_increment < 1 or ramup_samples < 0:
            raise BatchSizeError(
                f"rampup_batch_size=[{start_global_batch_size}, {batch_size_increment}, {ramup_samples}]: "
                "start and increment must be positive and the number of samples non-negative"
            )
        diff = global_batch_size - start_global_batch_size
        if diff < 0 or diff % batch_size_increment:
            raise BatchSizeError(
                f"rampup_batch_size: global batch size ({global_batch_size}) minus start "
                f"({start_global_batch_size}) must be a non-negative multiple of the increment "
                f"({batch_size_increment})"
            )
        self.global_batch_size = global_batch_size
        self.start_global_batch_size = start_global_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        num_increments = diff // batch_size_increment
        self.rampup_samples_per_increment = ramup_samples / num_increments if num_increments else 0.0
        self.update(0, consistency_check=False)

    def batch_size_at(self, consumed_samples: int) -> int:
        """The nominal global batch size after ``consumed_samples`` samples."""
        if consumed_samples > self.ramup_samples or self.rampup_samples_per_increment == 0:
            return self.global_batch_size
        steps = int(consumed_samples / self.rampup_samples_per_increment)
        return min(self.start_global_batch_size + steps * self.batch_size_increment, self.global_batch_size)

    def update(self, consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
        before = self.current_global_batch_size
        self._set_global_batch(self.batch_size_at(consumed_samples), consistency_check)
        if verbose and before != self.current_global_batch_size:
            logger.info(
                "global batch size %d -> %d after %d samples (%d microbatches)",
                before,
                self.current_global_batch_size,
                consumed_samples,
                self.num_micro_batches,
            )


def build_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[List[int]],
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    decrease_batch_size_if_needed: bool = False,
) -> NumMicroBatchesCalculator:
    """A constant calculator, or a ramp-up one from ``[start, increment, samples]``."""
    if rampup_batch_size is None:
        return ConstantNumMicroBatchesCalculator(
            global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank
        )
    if len(rampup_batch_size) != 3:
        raise BatchSizeError(f"rampup_batch_size={rampup_batch_size}: expected 3 values: start increment samples")
    start, increment, samples = (int(v) for v in rampup_batch_size)
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        decrease_batch_size_if_needed,
        rank,
        start,
        increment,
        samples,
    )


# ----------------------------------------------------------------------------------
# Megatron-compatible facade over one default calculator (Megatron's module global).
# ----------------------------------------------------------------------------------
_GLOBAL_NUM_MICROBATCHES_CALCULATOR: Optional[NumMicroBatchesCalculator] = None


def init_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[List[int]],
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    decrease_batch_size_if_needed: bool = False,
) -> NumMicroBatchesCalculator:
    """Build the default calculator and return it (Megatron returns None).

    Raises:
        CalculatorStateError: one exists already (an ``AssertionError``, as in Megatron; destroy it first).
    """
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        raise CalculatorStateError("num microbatches calculator is already initialized")
    return reconfigure_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed
    )


def reconfigure_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[List[int]],
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    decrease_batch_size_if_needed: bool = False,
) -> NumMicroBatchesCalculator:
    """Replace the default calculator, whether or not one exists, and return the new one."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed
    )
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def _default() -> NumMicroBatchesCalculator:
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise CalculatorStateError(
            "num microbatches calculator is not initialized: call init_num_microbatches_calculator"
        )
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def get_num_microbatches() -> int:
    return _default().get()


def get_current_global_batch_size() -> int:
    return _default().get_current_global_batch_size()


def get_current_running_global_batch_size() -> int:
    return _default().get_current_running_global_batch_size()


def get_micro_batch_size() -> int:
    return _default().get_micro_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
    _default().update(consumed_samples, consistency_check, verbose)


def destroy_num_microbatches_calculator() -> None:
    """Forget the default calculator."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


unset_num_microbatches_calculator = destroy_num_microbatches_calculator  # Megatron's other name for it
