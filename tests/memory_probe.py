"""Measure what a training step really holds: saved-for-backward bytes and model/optimizer state.

Shared by ``tests/unit_tests/training/test_theoretical_memory.py`` and
``benchmarks/bench_theoretical_memory.py``, which compare it with
``megatron.training.theoretical_memory``.

``SavedTensorMeter`` counts, through ``torch.autograd.graph.saved_tensors_hooks``, the distinct
storages autograd keeps for backward while they are alive: a view counts its whole storage once
(q, k and v are views of one QKV output), a storage saved by two ops (a layer's output, saved by
the next layer's norm and by a residual) counts once, parameters (and the distributed optimizer's
parameter buffer they are views of) are not activations and are skipped. A saved tensor is
released when autograd frees the node that holds it (after its backward), so the meter's peak over
a whole pipeline schedule is the peak of activations in flight.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Dict, Iterable, List, Optional

import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.distributed.torch_fully_sharded_data_parallel import (
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
    local_shard,
)
from megatron.core.models.mamba import MambaModel
from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.theoretical_memory import LanguageModelShape, MemoryEstimate, RankPosition, estimate_memory
from megatron.training.utils import masked_token_loss
from tests.model_utils import build_gpt, gpt2_style, llama_style


class _Saved:
    """What the pack hook hands autograd: the tensor, and a release callback when autograd drops it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedTensorMeter:
    """Live and peak bytes of distinct non-parameter storages saved for backward."""

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        # Storages are told apart by identity, not address: Megatron-FSDP frees a gathered parameter buffer
        # (``resize_(0)``) and gathers it again elsewhere, and freed addresses are reused by activations.
        self.param_storages = [p.untyped_storage() for p in parameters]  # kept alive: their ids stay unique
        self.excluded = {id(s) for s in self.param_storages}
        self.refs: Dict[int, int] = {}  # id of a storage -> saved tensors holding it
        self.sizes: Dict[int, int] = {}
        self.storages: Dict[int, torch.UntypedStorage] = {}  # kept alive while tracked: ids stay unique
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved.tensor)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        storage = tensor.untyped_storage()
        key = id(storage)  # one Python object per storage while it lives (views share it)
        # A parameter itself is skipped too: sharded (FSDP) ones are re-gathered into fresh storage.
        if key in self.excluded or storage.nbytes() == 0 or isinstance(tensor, torch.nn.Parameter):
            return saved
        if key not in self.refs:
            self.refs[key], self.sizes[key], self.storages[key] = 0, storage.nbytes(), storage
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(saved, self._release, key)
        return saved

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key], self.storages[key]
            self.live -= self.sizes.pop(key)

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Sum of the distinct storages behind ``tensors``."""
    seen: Dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel() > 0 and t.untyped_storage().nbytes() > 0:  # freed (FSDP): none
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class MemCase:
    """One point of the grid: a tiny GPT, a layout, and the memory-relevant switches."""

    name: str
    tp: int = 1
    pp: int = 1
    vp: Optional[int] = None
    sp: bool = False
    recompute: Optional[str] = None  # None, "selective", "full"
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    moe: bool = False
    ep: int = 1
    dist_opt: bool = False
    bf16: bool = False
    llama: bool = False
    num_layers: int = 2
    micro_batch_size: int = 2
    num_microbatches: int = 1
    seq: int = 16
    hidden_dropout: float = 0.0
    sharding: str = "no_shard"  # Megatron-FSDP's data_parallel_sharding_strategy (others need dist_opt)
    instances: int = 1  # num_distributed_optimizer_instances (needs dist_opt)
    hybrid: Optional[str] = None  # a MambaModel of this layer pattern (``M * - E``), num_layers symbols
    fsdp2: bool = False  # PyTorch FSDP2 (TorchFullyShardedDataParallel; the model untied)
    extra: Dict = field(default_factory=dict)

    def model_kwargs(self) -> Dict:
        kw = dict(num_layers=self.num_layers, sequence_parallel=self.sp, hidden_dropout=self.hidden_dropout)
        kw.update(max_sequence_length=self.seq)
        if self.recompute:
            kw.update(recompute_granularity=self.recompute)
        if self.recompute == "full":
            kw.update(
                recompute_method=self.recompute_method or "uniform", recompute_num_layers=self.recompute_num_layers or 1
            )
        if self.moe:
            kw.update(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)
        if self.bf16:
            kw.update(params_dtype=torch.bfloat16, bf16=True)
        if self.hybrid:  # 8 Mamba heads of 8 channels in 2 groups (hidden 32)
            kw.update(num_layers=len(self.hybrid), mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2)
        kw.update(self.extra)
        return (llama_style if self.llama else gpt2_style)(**kw)


def _build_hybrid(kw: Dict, groups: ps.ProcessGroupCollection, pattern: str, **ends) -> MambaModel:
    """``build_gpt``'s model as a hybrid ``MambaModel`` of ``pattern`` (the same config fields)."""
    torch.manual_seed(1234)
    fields = {k: v for k, v in kw.items() if k in TransformerConfig.__dataclass_fields__}
    sizes = dict(tensor_model_parallel_size=groups.size_of("tp"), pipeline_model_parallel_size=groups.size_of("pp"))
    return MambaModel(
        TransformerConfig(**fields, **sizes), mamba_stack_spec, kw["vocab_size"], kw["max_sequence_length"],
        hybrid_override_pattern=pattern, position_embedding_type=kw["position_embedding_type"],
        share_embeddings_and_output_weights=kw["share_embeddings_and_output_weights"], pg_collection=groups, **ends,
    )  # fmt: skip


def build_case(case: MemCase, groups: ps.ProcessGroupCollection):
    kw = case.model_kwargs()
    vp = case.vp or 1
    extra = {"virtual_pipeline_model_parallel_size": case.vp} if case.vp else {}
    pp_rank = groups.rank_in("pp")
    chunks = []
    for c in range(vp):
        ends = dict(pre_process=pp_rank == 0 and c == 0, post_process=pp_rank == case.pp - 1 and c == vp - 1)
        if case.hybrid:
            chunks.append(_build_hybrid(kw, groups, case.hybrid, **ends))
        else:
            chunks.append(build_gpt(kw, groups, vp_stage=c, **ends, **extra))
    if case.fsdp2:
        ddp_config = TorchFullyShardedDataParallelConfig()
        wrapped = [TorchFullyShardedDataParallel(c.config, ddp_config, c, pg_collection=groups) for c in chunks]
    else:
        ddp_config, wrapped = _ddp_wrapped(case, chunks, groups)
    half = {"params_dtype": torch.bfloat16, "bf16": True} if case.bf16 else {}
    opt_config = OptimizerConfig(lr=1e-4, use_distributed_optimizer=case.dist_opt, **half)
    optimizer = get_megatron_optimizer(opt_config, wrapped, pg_collection=groups)
    config = chunks[0].config
    config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=groups)
    config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    lm = LanguageModelShape(
        chunks[0].vocab_size,
        case.seq,
        kw["position_embedding_type"],
        kw["share_embeddings_and_output_weights"],
        kw.get("rotary_percent", 1.0),
        hybrid_layer_pattern=case.hybrid,
    )
    return chunks, wrapped, optimizer, ddp_config, opt_config, lm


def _ddp_wrapped(case: MemCase, chunks: List[torch.nn.Module], groups: ps.ProcessGroupCollection):
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=case.dist_opt,
        use_megatron_fsdp=case.sharding != "no_shard",
        data_parallel_sharding_strategy=case.sharding,
        num_distributed_optimizer_instances=case.instances,
    )
    wrapped = [
        DistributedDataParallel(chunks[0].config, ddp_config, c, disable_bucketing=i > 0, pg_collection=groups)
        for i, c in enumerate(chunks)
    ]
    return ddp_config, wrapped


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)  # [b, s] each
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()  # [b, s] as pretrain_gpt's get_batch
    output = model(tokens, positions, None, labels=labels)
    return output, partial(masked_token_loss, torch.ones(b, s))


def measure_case(rank: int, world_size: int, case: MemCase) -> Dict[str, object]:
    """Run one training step of ``case`` on this rank; measured and accounted bytes side by side."""
    layout = ps.ParallelLayout(
        world_size=world_size,
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=case.vp,
        expert_model_parallel_size=case.ep,
        num_distributed_optimizer_instances=case.instances,
    )
    groups = ps.build_process_groups(layout)
    torch.manual_seed(1234)
    chunks, wrapped, optimizer, ddp_config, opt_config, lm = build_case(case, groups)
    mb, m = case.micro_batch_size, case.num_microbatches
    g = torch.Generator().manual_seed(groups.rank_in("dp"))
    data = torch.randint(0, lm.vocab_size, (m, mb, case.seq + 1), generator=g)
    micro = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]
    params = [p for c in chunks for p in c.parameters()]
    func = get_forward_backward_func(case.pp, len(chunks))
    with SavedTensorMeter([local_shard(p) for p in params]) as meter:
        func(
            forward_step_func=_forward_step,
            data_iterator=[iter(micro) for _ in chunks],
            model=wrapped,
            num_microbatches=m,
            seq_length=case.seq,
            micro_batch_size=mb,
            pg_collection=groups,
        )
    optimizer.step()
    measured = {
        "params": storage_bytes(
            [local_shard(p.data) for p in params] + [b.param_shard for w in wrapped for b in _buffers(w)]
        ),
        "grads": storage_bytes(
            [t for w in wrapped for b in _buffers(w) for t in (b.grad_data, b.grad_shard)]
            + [local_shard(p.grad) for p in params if case.fsdp2 and p.grad is not None]
        ),
        "main_params": storage_bytes(link.main for link in optimizer.links if link.is_copy),
        "optimizer_states": storage_bytes(v for s in optimizer.state.values() for v in s.values() if v.dim() > 0),
        "activations": meter.peak,
        "num_parameters": sum(p.numel() for p in params),
    }
    dp = world_size // (case.tp * case.pp)
    pos = RankPosition(case.tp, case.pp, dp, 1, case.ep, case.vp, groups.rank_in("pp"), groups.rank_in("dp"))
    est = estimate_memory(chunks[0].config, lm, ddp_config, opt_config, pos, mb, case.seq, m, device_type="cpu")
    return {"measured": measured, "accounted": _as_dict(est), "chunks": chunks_named(chunks)}


def _buffers(wrapped: torch.nn.Module) -> list:
    return getattr(wrapped, "all_buffers", [])  # FSDP2 has none


def _as_dict(est: MemoryEstimate) -> Dict[str, int]:
    s = est.state
    return {
        "params": s.params,
        "grads": s.grads,
        "main_params": s.main_params,
        "optimizer_states": s.optimizer_states,
        "activations": est.activation_peak if est.activations_estimated else None,
        "num_parameters": est.num_parameters,
    }


def chunks_named(chunks: List[torch.nn.Module]) -> List[List[tuple]]:
    """``(name, numel)`` of every chunk's parameters, in registration order."""
    return [[(n, p.numel()) for n, p in c.named_parameters()] for c in chunks]


def measure_cases(rank: int, world_size: int, cases: List[MemCase]) -> List[Dict[str, object]]:
    """``measure_case`` for several cases in one spawned group of ranks."""
    return [measure_case(rank, world_size, case) for case in cases]
