"""``overlap_param_gather``: every read of a gathered parameter comes after the wait for its bucket.

Two gloo ranks train tiny GPTs under DDP + the distributed optimizer with many small buckets and the
parameter all-gathers overlapped with the next forward. A ``TorchFunctionMode`` sees every torch
operation of that forward and logs each parameter it is handed, with whether the all-gather of the
parameter's bucket is still pending: every parameter must be read, and none while pending. The
models cover the paths that read weights outside their owner's forward or through another module:
grouped-GEMM experts (stacked by ``GroupedMLP``), the tied output layer (the embedding's weight,
passed as an argument), multi-token prediction (the embedding and output layer again), MLA with
shared experts, and Transformer Engine linears (the fake TE).

The gathers land late (``tests/late_gather.py``): each all-gather's result is copied into the bucket
only when it is waited for, so a read before the wait sees the previous step's weights. Losses must then
equal, bitwise, those of the run that waits for every gather in the optimizer step.
"""

from typing import Dict, List, Set

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from megatron.core import parallel_state as ps
from tests.dist_harness import run_distributed
from tests.late_gather import late_parameter_gathers
from tests.model_utils import batch, deepseek_style, gpt2_style
from tests.te_fake import fake_transformer_engine
from tests.unit_tests.distributed.dp_training import parallel_run, train_step

# One parameter per bucket: a read can only be covered by the wait for its own parameter.
DIST = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=1)
OVERLAP = dict(use_distributed_optimizer=True, overlap_param_gather=True)
ITERS = 3
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True, moe_ffn_hidden_size=16)
MODELS = {
    "grouped GEMM, tied, MTP": gpt2_style(**MOE, mtp_num_layers=1),
    "MLA, shared experts, grouped GEMM": deepseek_style(num_layers=2, moe_layer_freq=[0, 1], moe_grouped_gemm=True),
}
# Tensor metadata: reading it before the gather is harmless.
METADATA = {
    getattr(torch.Tensor, name).__get__ for name in ("shape", "dtype", "device", "requires_grad", "is_cuda", "ndim")
} | {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel}


class _ReadLog(TorchFunctionMode):
    """Logs the name of each gathered parameter an operation is handed; ``early``: those handed while
    their bucket's all-gather was still pending."""

    def __init__(self, ddp) -> None:
        super().__init__()
        params = ddp.module.named_parameters()
        self.where = {id(p): (name, ddp._buffer_of[id(p)].bucket_of[id(p)]) for name, p in params}
        self.read: Set[str] = set()
        self.early: Set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in METADATA:
            for arg in tree_flatten((args, kwargs))[0]:
                if isinstance(arg, torch.nn.Parameter) and id(arg) in self.where:
                    name, bucket = self.where[id(arg)]
                    self.read.add(name)
                    if bucket.param_gather_handle is not None:
                        self.early.add(name)
        return func(*args, **kwargs)


def _reads_in_a_forward(groups, kwargs: Dict, embedded: bool) -> _ReadLog:
    """One step (it leaves the gathers running), then the next forward and backward, logged.

    ``embedded``: the forward is handed its decoder input, so the embedding does not run and the
    tied output layer is the first to read the word embedding."""
    _, _, _, opt, ddp = parallel_run(groups, kwargs, DIST, OVERLAP, iters=0)
    assert len(ddp.buffers[0].buckets) + len(ddp.expert_parallel_buffers) >= 4, "want several buckets"
    train_step(ddp, opt, groups, 0)
    assert any(b.param_gather_handle is not None for buf in ddp.all_buffers for b in buf.buckets)
    tokens, labels = batch(seed=1)
    extra = {"decoder_input": torch.randn(tokens.shape[1], tokens.shape[0], kwargs["hidden_size"])} if embedded else {}
    log = _ReadLog(ddp)
    with log:
        loss = ddp(tokens, None, None, labels=labels, **extra).mean()  # extra: [s, b, h]
    loss.backward()
    return log


def _losses(groups, kwargs: Dict, opt_kwargs: Dict) -> List[float]:
    _, _, _, opt, ddp = parallel_run(groups, kwargs, DIST, opt_kwargs, iters=0)
    return [train_step(ddp, opt, groups, it)[0] for it in range(ITERS)]


def _early_reads(groups) -> Dict[str, Set[str]]:
    """Per model, the parameters read while their bucket's gather was pending (every one must be read)."""
    early = {}
    with fake_transformer_engine():
        cases = [(what, kwargs, False) for what, kwargs in MODELS.items()]
        cases += [("TE linears (fake TE)", gpt2_style(), False)]
        cases += [("tied output layer, decoder input given", gpt2_style(transformer_impl="local"), True)]
        for what, kwargs, embedded in cases:
            log = _reads_in_a_forward(groups, kwargs, embedded)
            params = {n for n, _ in parallel_run(groups, kwargs, DIST, {}, iters=0)[4].module.named_parameters()}
            if embedded:
                params.discard("embedding.position_embeddings.weight")
            assert log.read == params, f"{what}: parameters never seen read: {params - log.read}"
            early[what] = log.early
    return early


def _body(rank: int, world_size: int):
    groups = ps.initialize_model_parallel()
    with late_parameter_gathers():
        early = _early_reads(groups)
        late = _losses(groups, MODELS["grouped GEMM, tied, MTP"], OVERLAP)
    return early, late, _losses(groups, MODELS["grouped GEMM, tied, MTP"], dict(use_distributed_optimizer=True))


def test_every_parameter_read_waits_for_its_gather_also_when_gathers_land_late():
    for rank, (early, late, waited) in enumerate(run_distributed(_body, 2)):
        offenders = {what: sorted(names) for what, names in early.items() if names}
        assert not offenders, f"rank {rank}: parameters read before their all-gather was waited for: {offenders}"
        assert late == waited, f"rank {rank}: late-landing gathers changed the losses: {late} vs {waited}"
