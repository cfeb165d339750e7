"""ModelParallelConfig: the parallel layout and numerics every core module shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.process_groups import check_hierarchical_cp_sizes


def require_positive(name: str, value: object) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is a positive integer."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive integer")


def require_divisible(name: str, value: int, by_name: str, by: int) -> None:
    """Raise a ValueError unless ``value`` (setting ``name``) is divisible by ``by``."""
    if value % by:
        raise ValueError(f"{name}={value} must be divisible by {by_name}={by}")


def require_one_precision(fp16: bool, bf16: bool) -> None:
    """Raise a ValueError when both half-precision modes are on (shared by the configs that hold both)."""
    if fp16 and bf16:
        raise ValueError("fp16=True and bf16=True: choose at most one")


@dataclass
class ModelParallelConfig:
    """Parallel sizes and precision settings (Megatron field names).

    Flags that only pick a kernel or overlap strategy on GPUs are accepted as
    fields and have no effect where the result is mathematically the same.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    # Sizes of the nested CP groups, [a2a, p2p] for cp_comm_type 'a2a+p2p': the all-to-all inside groups of
    # consecutive CP ranks, the ring across them; the product is context_parallel_size.
    hierarchical_context_parallel_sizes: Optional[List[int]] = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None

    perform_initialization: bool = True
    use_cpu_initialization: bool = False

    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    timers: Optional[object] = None

    # Tensor-parallel linears add their weight gradient straight into ``param.main_grad`` (the
    # data-parallel buffer) instead of returning it to autograd; weights without main_grad are unaffected.
    gradient_accumulation_fusion: bool = False
    # GPU-only performance switches: accepted, no numerical effect.
    async_tensor_model_parallel_allreduce: bool = False
    # The sequence-parallel all-gather / reduce-scatter of the linears as rings under per-chunk GEMMs
    # (``tensor_parallel.tp_overlap``); needs sequence parallelism.
    tp_comm_overlap: bool = False

    # Pipeline communication.
    pipeline_dtype: Optional[torch.dtype] = None
    variable_seq_lengths: bool = False
    deallocate_pipeline_outputs: bool = False
    batch_p2p_comm: bool = True
    # The interleaved schedule leaves each batch of sends and receives in flight and waits for a received
    # tensor where an op takes it (``pipeline_parallel.executor``); same values.
    overlap_p2p_comm: bool = False
    finalize_model_grads_func: Optional[object] = None
    grad_scale_func: Optional[object] = None
    no_sync_func: Optional[object] = None
    # Megatron's loops set these to launch bucket reductions / parameter gathers from the schedule. Not called
    # here: DDP launches each bucket's reduction from its gradient hooks and waits for each gather in a forward
    # pre-hook (tested structurally), so what they would do already happens; kept so such loops run unchanged.
    grad_sync_func: Optional[object] = None
    param_sync_func: Optional[object] = None

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            require_positive(name, getattr(self, name))
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        require_positive("expert_tensor_parallel_size", self.expert_tensor_parallel_size)
        self.hierarchical_context_parallel_sizes = check_hierarchical_cp_sizes(
            self.hierarchical_context_parallel_sizes, self.context_parallel_size
        )
        require_one_precision(self.fp16, self.bf16)
        self.sequence_parallel = parallel_state.warn_sequence_parallel_without_tp(
            self.tensor_model_parallel_size, self.sequence_parallel
        )
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ValueError(
                "tp_comm_overlap=True needs sequence_parallel=True (and tensor_model_parallel_size > 1): it "
                "overlaps the sequence-parallel all-gather and reduce-scatter with the GEMMs"
            )
        if self.pipeline_dtype is None:
            self.pipeline_dtype = self.params_dtype

    def check_against(self, groups: parallel_state.ProcessGroupCollection, adopt_unset: bool = False) -> None:
        """Raise if the configured sizes differ from the groups' actual sizes.

        Args:
            groups: the process groups the model is built on.
            adopt_unset: a size still at its default of 1 takes the groups' size instead of raising,
                and the config's rules run again with it. Megatron-core's models read the sizes from
                ``parallel_state``, so its callers leave them unset in the config; the models pass
                True only when they resolved ``parallel_state``'s groups themselves.
        """
        actual = {
            "tensor_model_parallel_size": groups.size_of("tp"),
            "pipeline_model_parallel_size": groups.size_of("pp"),
            "context_parallel_size": groups.size_of("cp"),
            "expert_model_parallel_size": groups.size_of("ep"),
            "expert_tensor_parallel_size": groups.size_of("expt_tp"),
        }
        adopted = {n: s for n, s in actual.items() if adopt_unset and getattr(self, n) == 1 and s != 1}
        if adopted:
            if self.expert_tensor_parallel_size == self.tensor_model_parallel_size:
                # Derived from TP: it takes the groups' expert-TP size (TP's unless set apart).
                self.expert_tensor_parallel_size = actual["expert_tensor_parallel_size"]
            for name, size in adopted.items():
                setattr(self, name, size)
            self.__post_init__()
        for name, size in actual.items():
            if getattr(self, name) != size:
                raise ValueError(
                    f"{name}={getattr(self, name)} in the config, but the process groups have {size}: "
                    "initialize_model_parallel and the config must agree"
                )
