"""Tensor-parallel layers: column- and row-split linear layers and a vocab-split embedding.

Every parameter carries three attributes that checkpointing, gradient clipping
and the optimizer read: ``tensor_model_parallel`` (is it a shard?),
``partition_dim`` (which dim is split) and ``partition_stride``. With a TP group
of one rank each layer is exactly ``torch.nn.functional.linear`` / ``embedding``.

Layer forwards return ``(output, output_bias)``: ``output_bias`` is the bias when
``skip_bias_add`` is set (the caller fuses it into a later op), else None.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.linear_function import (
    COMM_ALL_REDUCE,
    COMM_NONE,
    COMM_SEQUENCE_PARALLEL,
    linear_reduce_scatter,
    linear_with_grad_accumulation_and_async_allreduce,  # noqa: F401 - Megatron's import path
    parallel_linear,
)
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.tensor_parallel.utils import VocabUtility, divide

InitMethod = Callable[[torch.Tensor], object]

_TP_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Mark ``tensor`` as a TP shard split along ``dim`` (or as replicated)."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` the 'replicated' attributes unless it already has them."""
    for name, value in _TP_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(destination_tensor: torch.Tensor, source_tensor: torch.Tensor) -> None:
    """Copy the TP attributes of ``source_tensor`` (defaults where it has none) onto ``destination_tensor``."""
    for name, value in _TP_ATTRIBUTE_DEFAULTS.items():
        setattr(destination_tensor, name, getattr(source_tensor, name, value))


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor, tp_group: Union[dist.ProcessGroup, int, None] = None
) -> bool:
    """True for shards and, for replicated parameters, only on TP rank 0 (count each once).

    ``tp_group`` is the TP group (None: the default one), or directly this rank's TP rank.
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    if isinstance(tp_group, int):
        return tp_group == 0
    return dist.get_rank(parallel_state.get_tensor_model_parallel_group_if_none(tp_group)) == 0


def _refuse_unsupported(layer: str, **arguments: object) -> None:
    """Raise for Megatron arguments whose non-default value has no implementation here yet."""
    active = sorted(name for name, value in arguments.items() if value not in (None, False))
    if active:
        raise ValueError(f"{layer}: not supported yet: {active}")


def is_expert_param(param: torch.Tensor) -> bool:
    """Expert weights and biases carry ``allreduce = False``: they differ across expert-parallel ranks."""
    return getattr(param, "allreduce", True) is False


def _init_common(
    layer: torch.nn.Module,
    config: ModelParallelConfig,
    input_size: int,
    output_size: int,
    skip_bias_add: bool,
    is_expert: bool,
    tp_comm_buffer_name: Optional[str],
    tp_group: Optional[dist.ProcessGroup],
) -> int:
    """Attributes both parallel linears share; returns the size of their TP group.

    An expert layer on more than one rank leaves communication to its MoE layer, which
    gathers the tokens once (``explicit_expert_comm``).
    """
    layer.config = config
    layer.input_size, layer.output_size = input_size, output_size
    layer.skip_bias_add, layer.is_expert = skip_bias_add, is_expert
    layer.sequence_parallel = config.sequence_parallel
    layer.tp_comm_buffer_name = tp_comm_buffer_name  # userbuffer overlap (GPU only): unused
    layer.tp_group = parallel_state.get_tensor_model_parallel_group_if_none(tp_group, is_expert)
    world = dist.get_world_size(layer.tp_group)
    layer.explicit_expert_comm = is_expert and world > 1
    layer.quantizer = None  # a quantization.recipes.LinearQuantizer under FP8/FP4 (fp8_utils.attach_quantizers)
    return world


def _tp_comm_overlap(layer: torch.nn.Module) -> bool:
    """``tp_comm_overlap``: the sequence-parallel all-gather / reduce-scatter run as rings under chunk
    GEMMs (``tp_overlap``); FP8/FP4 linears keep their quantized gathers."""
    return bool(getattr(layer.config, "tp_comm_overlap", False)) and layer.quantizer is None


def _fuse_wgrad(layer: torch.nn.Module) -> bool:
    """``gradient_accumulation_fusion``: weight gradients go straight into ``main_grad``."""
    return bool(getattr(layer.config, "gradient_accumulation_fusion", False))


def _home_device() -> torch.device:
    """Where parameters live: the current CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shard_of_master(
    master: torch.Tensor, per_partition: int, dim: int, stride: int, rank: int, world: int
) -> torch.Tensor:
    """This rank's shard of ``master``: with stride k, every world-th of the k*world blocks."""
    blocks = torch.split(master, divide(per_partition, stride), dim=dim)
    return torch.cat(blocks[rank::world], dim=dim)


def _make_weight(shape: Tuple[int, int], config: ModelParallelConfig) -> torch.nn.Parameter:
    """An uninitialized weight (on the CPU under ``use_cpu_initialization``): ``init_weight_shard_`` fills it."""
    device = torch.device("cpu") if config.use_cpu_initialization else _home_device()
    return torch.nn.Parameter(torch.empty(shape, dtype=config.params_dtype, device=device))


def init_weight_shard_(
    weight: torch.nn.Parameter,
    full_shape: Tuple[int, int],
    partition_dim: int,
    stride: int,
    init_method: InitMethod,
    config: ModelParallelConfig,
    group: dist.ProcessGroup,
    rng_stream: str,
) -> None:
    """Mark ``weight`` as this rank's shard along ``partition_dim`` and initialize it as ``config`` asks.

    ``use_cpu_initialization``: build the full ``full_shape`` weight with the default generator
    (so the same seed gives the same model for any TP size) and keep this rank's shard. Otherwise
    each rank fills its own shard under the tracked per-TP-rank stream ``rng_stream``. The weight
    ends on this rank's device.
    """
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    if config.perform_initialization and config.use_cpu_initialization:
        master = torch.empty(full_shape, dtype=torch.float32)
        init_method(master)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        with torch.no_grad():
            weight.copy_(_shard_of_master(master, weight.shape[partition_dim], partition_dim, stride, rank, world))
    elif config.perform_initialization:
        with torch.no_grad(), get_cuda_rng_tracker().fork(rng_stream):
            init_method(weight)
    weight.data = weight.data.to(_home_device())


def _make_bias(size: int, config: ModelParallelConfig) -> torch.nn.Parameter:
    """Zero-initialized bias (Megatron starts every linear bias at zero)."""
    return torch.nn.Parameter(torch.zeros(size, dtype=config.params_dtype, device=_home_device()))


def mark_column_bias(bias: torch.nn.Parameter, stride: int, is_expert: bool) -> None:
    """A column-parallel bias is split like the output dim; experts' are not reduced over DP."""
    set_tensor_model_parallel_attributes(bias, True, 0, stride)
    bias.allreduce = not is_expert


def mark_row_bias(bias: torch.nn.Parameter, sequence_parallel: bool, is_expert: bool) -> None:
    """A row-parallel bias is replicated; under SP each rank's bias grad covers only its sequence piece,
    so training must all-reduce it (``sequence_parallel``)."""
    set_tensor_model_parallel_attributes(bias, False, -1, 1)
    bias.sequence_parallel = sequence_parallel
    bias.allreduce = not is_expert


def weight_rng_stream(is_expert: bool) -> str:
    """The tracked RNG stream a linear's weight is initialized from."""
    return "expert-parallel-rng" if is_expert else "model-parallel-rng"


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its output dim: rank i holds ``A[i*o/tp:(i+1)*o/tp]``.

    Input ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism, all-gathered
    here; only the piece is kept for backward); output ``[s, b, o/tp]``, or ``[s, b, o]``
    with ``gather_output``. Backward overlaps the input gradient's all-reduce
    (reduce-scatter under SP) with the weight-gradient GEMM (``linear_function.py``). An
    expert layer (``is_expert``) on more than one rank communicates nothing: its MoE layer
    hands it tokens present on every rank and reduces their gradient itself.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: InitMethod,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: Optional[List[torch.Tensor]] = None,
        grad_output_buffer: Optional[List[torch.Tensor]] = None,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        disable_grad_reduce: bool = False,
        tp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__()
        _refuse_unsupported(
            "ColumnParallelLinear",
            keep_master_weight_for_test=keep_master_weight_for_test,
            embedding_activation_buffer=embedding_activation_buffer,
            grad_output_buffer=grad_output_buffer,
            disable_grad_reduce=disable_grad_reduce,
        )
        if gather_output and config.sequence_parallel:
            raise ValueError(
                "ColumnParallelLinear: gather_output=True cannot be combined with "
                "config.sequence_parallel=True (the output would be gathered twice)"
            )
        self.gather_output = gather_output
        world = _init_common(
            self, config, input_size, output_size, skip_bias_add, is_expert, tp_comm_buffer_name, tp_group
        )
        self.output_size_per_partition = divide(output_size, world)
        shape = (self.output_size_per_partition, input_size)
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = _make_weight(shape, config)
            full = (output_size, input_size)
            init_weight_shard_(
                self.weight, full, 0, stride, init_method, config, self.tp_group, weight_rng_stream(is_expert)
            )
            self.weight.allreduce = not is_expert
        if bias:
            self.bias = _make_bias(self.output_size_per_partition, config)
            mark_column_bias(self.bias, stride, is_expert)
        else:
            self.register_parameter("bias", None)

    def _comm(self) -> str:
        """The input's communication: none for experts (tokens already on every rank) or one rank."""
        if self.explicit_expert_comm or dist.get_world_size(self.tp_group) == 1:
            return COMM_NONE
        return COMM_SEQUENCE_PARALLEL if self.sequence_parallel else COMM_ALL_REDUCE

    def _check_weight(self, weight: Optional[torch.Tensor]) -> torch.Tensor:
        if weight is None:
            if self.weight is None:
                raise ValueError(
                    "ColumnParallelLinear was built with skip_weight_param_allocation=True: pass weight= to forward"
                )
            return self.weight
        expected = (self.output_size_per_partition, self.input_size)
        if tuple(weight.shape) != expected:
            raise ValueError(f"ColumnParallelLinear: weight has shape {tuple(weight.shape)}, expected {expected}")
        return weight

    def forward(
        self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output: Optional[bool] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Apply the layer.

        Args:
            input_: ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism).
            weight: shard to use instead of ``self.weight`` (tied output layers).
            runtime_gather_output: overrides ``gather_output`` for this call.
        """
        weight = self._check_weight(weight)
        bias = None if self.skip_bias_add else self.bias
        # input_: [s/tp, b, h] under SP (gathered inside, only the piece is kept for backward), else [s, b, h]
        output_parallel = parallel_linear(
            input_, weight, bias, self.tp_group, self._comm(), _fuse_wgrad(self), self.quantizer, _tp_comm_overlap(self)
        )  # [s, b, o/tp]
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            if self.sequence_parallel:
                raise ValueError("ColumnParallelLinear: cannot gather the output under sequence parallelism")
            output = gather_from_tensor_model_parallel_region(output_parallel, self.tp_group)  # [s, b, o]
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its input dim: rank i holds ``A[:, i*h/tp:(i+1)*h/tp]``.

    Input ``[s, b, h/tp]`` (``input_is_parallel``) or ``[s, b, h]`` (scattered
    here); the partial products are summed over TP (all-reduce, or reduce-scatter
    along the sequence dim to ``[s/tp, b, o]`` under sequence parallelism). The bias
    is replicated and added after the reduction. An expert layer (``is_expert``) on more
    than one rank returns the partial sums (its MoE layer reduces them) and its bias
    separately (``skip_bias_add`` required).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: InitMethod,
        bias: bool = True,
        input_is_parallel: bool = False,
        skip_bias_add: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__()
        _refuse_unsupported("RowParallelLinear", keep_master_weight_for_test=keep_master_weight_for_test)
        if config.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: config.sequence_parallel=True requires input_is_parallel=True")
        self.input_is_parallel = input_is_parallel
        world = _init_common(
            self, config, input_size, output_size, skip_bias_add, is_expert, tp_comm_buffer_name, tp_group
        )
        if self.explicit_expert_comm and bias and not skip_bias_add:
            raise ValueError(
                "RowParallelLinear: an expert layer on several TP ranks needs skip_bias_add=True "
                "(the bias must be added after the MoE layer's reduction)"
            )
        self.input_size_per_partition = divide(input_size, world)
        self.weight = _make_weight((output_size, self.input_size_per_partition), config)
        full = (output_size, input_size)
        init_weight_shard_(
            self.weight, full, 1, stride, init_method, config, self.tp_group, weight_rng_stream(is_expert)
        )
        self.weight.allreduce = not is_expert
        if bias:
            self.bias = _make_bias(output_size, config)
            mark_row_bias(self.bias, config.sequence_parallel and not self.explicit_expert_comm, is_expert)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Apply the layer to ``[s, b, h/tp]`` (or ``[s, b, h]`` unless ``input_is_parallel``)."""
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, self.tp_group)  # [s, b, h/tp]
        if self.sequence_parallel and not self.explicit_expert_comm and _tp_comm_overlap(self):
            output = linear_reduce_scatter(
                input_parallel, self.weight, self.tp_group, _fuse_wgrad(self)
            )  # [s/tp, b, o]
            return (output, self.bias) if self.skip_bias_add else self._add_bias(output)
        output_parallel = parallel_linear(
            input_parallel, self.weight, None, self.tp_group, COMM_NONE, _fuse_wgrad(self), self.quantizer
        )  # [s, b, o] partial sum
        if self.explicit_expert_comm:
            output = output_parallel  # the MoE layer sums the partial outputs over TP
        elif self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)  # [s/tp, b, o]
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)  # [s, b, o]
        if self.skip_bias_add:
            return output, self.bias
        return self._add_bias(output)

    def _add_bias(self, output: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return (output if self.bias is None else output + self.bias), None


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split along the vocabulary: rank i holds rows ``[i*V/tp, (i+1)*V/tp)``.

    Input token ids ``[b, s]``. Each rank looks up the ids it owns (zeros for the
    others) and the partial results are summed over TP. Output ``[b, s, h]``; with
    ``reduce_scatter_embeddings`` the output is first transposed to ``[s, b, h]``
    and reduce-scattered along the sequence dim (dim 0), giving ``[s/tp, b, h]``
    for a sequence-parallel model.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod,
        config: ModelParallelConfig,
        reduce_scatter_embeddings: bool = False,
        tp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.tp_group = parallel_state.get_tensor_model_parallel_group_if_none(tp_group)
        rank, world = dist.get_rank(self.tp_group), dist.get_world_size(self.tp_group)
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, rank, world
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = _make_weight((self.num_embeddings_per_partition, embedding_dim), config)
        full = (num_embeddings, embedding_dim)
        init_weight_shard_(self.weight, full, 0, 1, init_method, config, self.tp_group, weight_rng_stream(False))

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Embed ``[b, s]`` ids; returns ``[b, s, h]`` or ``[s/tp, b, h]`` (see class doc)."""
        parallel = dist.get_world_size(self.tp_group) > 1
        if parallel:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)  # [b, s]
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        else:
            local_ids = input_
        output_parallel = F.embedding(local_ids, self.weight)  # [b, s, h]
        if parallel:
            output_parallel = output_parallel.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()  # [s, b, h]
            return reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)  # [s/tp, b, h]
        return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)  # [b, s, h]
