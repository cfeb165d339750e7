"""``--fp8-param-gather``: FP8 linear weights, fp32 main weights, FP8 all-gathers (tensorwise, delayed).

A Llama-style GPT in bf16 with ``hybrid`` FP8 on two gloo ranks (DP=2, distributed optimizer), and
the cast, gather and params-norm checks again under TP=2 x DP=2 on four ranks:

* storage: the 8 transformer linears' weights are 1-byte FP8 parameters, nothing else of theirs is
  kept in high precision; gradients land in the fp32 ``main_grad`` buffer; a training step never
  quantizes a weight (``LinearQuantizer.quantize`` is not called for the ``weight`` role).
* cast: after a step every rank's FP8 bytes and ``scale_inv`` equal a NumPy reference built from the
  full fp32 main weight (gathered through the optimizer's by-name state): e4m3 rounding by search
  (``float_reference``) of ``main * scale`` with ``scale = 448 / amax(full main)`` (tensorwise), or
  the delayed state's scale ``448 / amax`` of the previous step's main weight, with this step's amax
  recorded in the history (delayed), bitwise; under TP the amax is the whole (TP-gathered) weight's.
* the logged params norm counts the FP8 weights' real values (within 2% of the bf16 model's).
* gathers: the parameter all-gather moves the FP8 weights as 1 byte per element (counted by wrapping
  the collective), 2 bytes per element without the flag.
* ``overlap_param_gather`` (FP8 gathers waited for in the next forward) gives the same losses exactly.
* DP=2 equals DP=1 (both with the flag) on the same global batch over 3 steps: losses within
  rtol 1e-5 and the fp32 main weights within relative error 1e-3 (gradients are summed in another
  order; one FP8 rounding moved by that would change a weight by one code).
* checkpoints (torch_dist and torch): save, load into a fresh run with the flag: FP8 bytes, scales,
  main weights and the next step's loss equal bitwise (the FP8 weights are recast from the restored
  main weights); without the optimizer state the checkpoint's bf16 weights are cast back to the same
  FP8 codes (the scale within rtol 2^-8: tensorwise takes it from the bf16-rounded amax) and become
  the main weights; load into a run without the flag: its bf16 weights are the dequantized FP8
  values rounded to bf16 and its main weights the saved ones, bitwise.
* refusals: without the distributed optimizer, without FP8, with block recipes, on the command line.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
    param_and_grad_buffer,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.quantization.fp8_params import is_fp8_param
from megatron.core.quantization.recipes import LinearQuantizer
from megatron.training import arguments as A
from megatron.training.checkpointing import CheckpointConfig, load_checkpoint, save_checkpoint
from megatron.training.training import params_l2_norm
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gather_tp, llama_style, single_rank_groups
from tests.unit_tests.dist_checkpointing.ckpt_utils import groups_for
from tests.unit_tests.float_reference import E4M3, round_nearest_even
from tests.unit_tests.training.test_arguments import _validated

BF16 = {"params_dtype": torch.bfloat16, "bf16": True}
GLOBAL_BATCH = 4


def _build(groups, recipe, fp8_param_gather=True, seed=1234, overlap=False):
    model = build_gpt(llama_style(fp8="hybrid", fp8_recipe=recipe, fp8_amax_history_len=4, **BF16), groups, seed=seed)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        fp8_param_gather=fp8_param_gather,
        grad_reduce_in_fp32=True,
        overlap_param_gather=overlap,
    )
    ddp = DistributedDataParallel(model.config, ddp_config, model, pg_collection=groups)
    config = OptimizerConfig(
        lr=1e-2, weight_decay=0.1, use_distributed_optimizer=True, overlap_param_gather=overlap, **BF16
    )
    return ddp, get_megatron_optimizer(config, [ddp], pg_collection=groups)


def _step(ddp, opt, groups, it):
    """One step on this DP rank's rows of global batch ``it``; returns the global mean loss."""
    dp, rank = groups.size_of("dp"), groups.rank_in("dp")
    tokens, labels = batch(seed=it, b=GLOBAL_BATCH)
    rows = slice(rank * GLOBAL_BATCH // dp, (rank + 1) * GLOBAL_BATCH // dp)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(tokens[rows], None, None, labels=labels[rows]).float().mean()  # [b/dp, s] -> []
    opt.scale_loss(loss).backward()
    finalize_model_grads([ddp], None, groups)
    assert opt.step()[0]
    total = loss.detach().clone()
    dist.all_reduce(total, group=groups.dp)
    return float(total) / dp


def _fp8_weights(ddp):
    return {n: p for n, p in ddp.module.named_parameters() if is_fp8_param(p)}


def _all_mains(ddp, opt):
    """Parameter name -> its full fp32 main weight (every DP rank's slice gathered)."""
    state = opt.state_dict_by_param_name([ddp], all_ranks=True)
    return {name: state[name]["main_param"] for name, _ in ddp.module.named_parameters()}


def _full_mains(ddp, opt):
    """The FP8 weights' full fp32 main weights, by name."""
    mains = _all_mains(ddp, opt)
    return {name: mains[name] for name in _fp8_weights(ddp)}


def _reference_cast(main, scale):
    """e4m3 values of ``main * scale`` (fp32 product), rounded by search: NumPy only."""
    product = main.numpy().astype(np.float32) * np.float32(scale)
    return round_nearest_even(product, E4M3)


def _amax(main, param, groups):
    """max |w| over the whole weight: the fp32 main of this TP shard gathered over TP."""
    return np.float32(np.abs(gather_tp(main, param, groups.tp).numpy()).max())


def _check_cast(ddp, groups, recipe, mains, previous):
    """Every FP8 weight equals the reference cast of its full main weight (module doc)."""
    for name, param in _fp8_weights(ddp).items():
        amax = _amax(mains[name], param, groups)
        quantizer = param.fp8_meta.quantizer
        if recipe == "tensorwise":
            scale = np.float32(448.0) / amax
        else:
            state = quantizer.delayed["weight"]
            scale = np.float32(448.0) / _amax(previous[name], param, groups)  # most_recent
            assert np.float32(state.scale.item()) == scale, name
            assert np.float32(state.amax_history[0].item()) == amax, name
        expected = _reference_cast(mains[name], scale)
        assert np.array_equal(param.detach().float().numpy(), expected), f"{recipe} {name}: FP8 bytes"
        assert np.float32(param.fp8_meta.scale_inv.item()) == np.float32(1.0) / scale, f"{recipe} {name}: scale"


class _WeightQuantizations:
    """Counts ``LinearQuantizer.quantize`` calls for the ``weight`` role."""

    def __enter__(self):
        self.count, self._orig = 0, LinearQuantizer.quantize

        def counted(quantizer, role, *args, **kw):
            self.count += role == "weight"
            return self._orig(quantizer, role, *args, **kw)

        LinearQuantizer.quantize = counted
        return self

    def __exit__(self, *exc):
        LinearQuantizer.quantize = self._orig


class _GatherCounter:
    """Wraps the buffers' all-gather: (elements, bytes) of every parameter gather."""

    def __init__(self):
        self.calls, self._orig = [], param_and_grad_buffer.all_gather_into_tensor

    def __enter__(self):
        def counted(out, shard, **kw):
            self.calls.append((out.numel(), out.numel() * out.element_size()))
            return self._orig(out, shard, **kw)

        param_and_grad_buffer.all_gather_into_tensor = counted
        return self

    def __exit__(self, *exc):
        param_and_grad_buffer.all_gather_into_tensor = self._orig


def _bytes_per_weight_element(ddp, opt, groups):
    """The quantized linears' weights: (model bytes per element, all-gathered bytes per element of their buffer)."""
    weights = [m.weight for m in ddp.module.modules() if getattr(m, "quantizer", None) is not None]
    stored = sum(w.numel() * w.element_size() for w in weights) / sum(w.numel() for w in weights)
    buffer = next(b for b in ddp.buffers if any(p is weights[0] for p in b.params))
    assert all(any(p is w for p in buffer.params) for w in weights)
    with _GatherCounter() as counter:
        _step(ddp, opt, groups, 0)
    gathered = [nbytes for numel, nbytes in counter.calls if numel == buffer.param_data.numel()]
    assert len(gathered) == 1, counter.calls
    return stored, gathered[0] / buffer.param_data.numel()


def _train_and_check(ddp, opt, groups, recipe, iters=3):
    """Train ``iters`` steps checking every cast after the first; (losses, the last full mains)."""
    losses, previous = [], None
    for it in range(iters):
        losses.append(_step(ddp, opt, groups, it))
        mains = _full_mains(ddp, opt)
        if previous is not None:
            _check_cast(ddp, groups, recipe, mains, previous)
        previous = mains
    return losses, previous


def _train_body(rank, world_size, recipe):
    groups = groups_for(1)  # DP=2
    ddp, opt = _build(groups, recipe)
    fp8 = _fp8_weights(ddp)
    assert len(fp8) == 8 and all(p.dtype == torch.float8_e4m3fn for p in fp8.values())
    for name, param in fp8.items():  # no high-precision copy of the weight in the linear
        module = ddp.module.get_submodule(name.rsplit(".", 1)[0])
        others = [t for t in list(module.parameters()) + list(module.buffers()) if t is not param]
        assert all(t.numel() < param.numel() for t in others), name
        assert param.main_grad.dtype == torch.float32, name
    with _WeightQuantizations() as weight_casts:  # the forward uses the stored FP8 weights as they are
        _step(ddp, opt, groups, 5)
    assert weight_casts.count == 0
    ddp, opt = _build(groups, recipe)
    ref_ddp, ref_opt = _build(single_rank_groups(), recipe)  # DP=1, same global batch
    ref_losses = [_step(ref_ddp, ref_opt, single_rank_groups(), it) for it in range(3)]
    losses, previous = _train_and_check(ddp, opt, groups, recipe)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    ref_mains = _full_mains(ref_ddp, ref_opt)
    for name, main in previous.items():
        err = float((main - ref_mains[name]).norm() / ref_mains[name].norm())
        assert err <= 1e-3, f"{recipe} {name}: DP=2 vs DP=1 relative error {err:.3g}"
    overlapped, overlapped_opt = _build(groups, recipe, overlap=True)  # gathers waited for in the next forward
    assert [_step(overlapped, overlapped_opt, groups, it) for it in range(3)] == losses
    fp8_bytes = _bytes_per_weight_element(ddp, opt, groups)
    plain, plain_opt = _build(groups, recipe, fp8_param_gather=False)
    return losses, ref_losses, fp8_bytes, _bytes_per_weight_element(plain, plain_opt, groups)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_weights_cast_from_full_main_and_gathered_as_bytes(recipe):
    results = run_distributed(_train_body, 2, recipe)
    losses, ref_losses, fp8_bytes, plain_bytes = results[0]
    assert fp8_bytes == (1.0, 1.0), fp8_bytes  # model storage, all-gather: bytes per weight element
    assert plain_bytes == (2.0, 2.0), plain_bytes
    assert results[1][0] == losses


def _tensor_parallel_body(rank, world_size):
    """TP=2 x DP=2: the scale is the whole weight's (amax over DP shards and TP shards); params norm."""
    groups = groups_for(2)
    for recipe in ("tensorwise", "delayed"):
        ddp, opt = _build(groups, recipe)
        _train_and_check(ddp, opt, groups, recipe)
        assert _bytes_per_weight_element(ddp, opt, groups) == (1.0, 1.0)
        fresh, _ = _build(groups, recipe)  # the logged params norm counts the FP8 weights' real values
        plain, _ = _build(groups, recipe, fp8_param_gather=False)
        norm, plain_norm = params_l2_norm([fresh], groups), params_l2_norm([plain], groups)
        assert abs(norm - plain_norm) <= 0.02 * plain_norm, (recipe, norm, plain_norm)
    return True


def test_tensor_parallel_fp8_weights_use_the_whole_weights_scale():
    assert all(run_distributed(_tensor_parallel_body, 4))


def _snapshot(ddp, opt):
    weights = {n: (p.detach().clone(), p.fp8_meta.scale_inv.clone()) for n, p in _fp8_weights(ddp).items()}
    return weights, [link.main.detach().clone() for link in opt.links]


def _checkpoint_body(rank, world_size, directory, recipe, ckpt_format):
    groups = groups_for(1)
    ddp, opt = _build(groups, recipe)
    for it in range(2):
        _step(ddp, opt, groups, it)
    save_checkpoint(2, [ddp], opt, None, CheckpointConfig(save=directory, ckpt_format=ckpt_format), {}, {})
    saved_weights, saved_mains = _snapshot(ddp, opt)
    saved_full = _all_mains(ddp, opt)
    dequantized = {n: (w.float() * s).to(torch.bfloat16) for n, (w, s) in saved_weights.items()}
    next_loss = _step(ddp, opt, groups, 2)

    resumed, resumed_opt = _build(groups, recipe, seed=99)
    load_checkpoint([resumed], resumed_opt, None, CheckpointConfig(load=directory, ckpt_format=ckpt_format))
    weights, mains = _snapshot(resumed, resumed_opt)
    for name, (data, scale_inv) in saved_weights.items():
        assert torch.equal(weights[name][0].view(torch.uint8), data.view(torch.uint8)), f"{ckpt_format} {name}"
        assert torch.equal(weights[name][1], scale_inv), f"{ckpt_format} {name}: scale_inv"
    assert all(torch.equal(a, b) for a, b in zip(mains, saved_mains))
    assert _step(resumed, resumed_opt, groups, 2) == next_loss

    # Model weights alone (no optimizer state): the checkpoint's bf16 values cast, main weights from them.
    weights_only, weights_only_opt = _build(groups, recipe, seed=97)
    config = CheckpointConfig(load=directory, ckpt_format=ckpt_format, no_load_optim=True, no_load_rng=True)
    load_checkpoint([weights_only], weights_only_opt, None, config)
    for name, param in _fp8_weights(weights_only).items():
        where = f"{ckpt_format} {name}"
        data, scale_inv = saved_weights[name]
        assert torch.equal(param.detach().view(torch.uint8), data.view(torch.uint8)), where  # the same codes
        # tensorwise: the scale from the bf16-rounded amax; delayed: the checkpointed state's scale
        torch.testing.assert_close(param.fp8_meta.scale_inv, scale_inv, rtol=2**-8, atol=0, msg=where)
    assert all(torch.equal(link.main, link.model_values()) for link in weights_only_opt.links)

    plain, plain_opt = _build(groups, recipe, fp8_param_gather=False, seed=98)
    load_checkpoint([plain], plain_opt, None, CheckpointConfig(load=directory, ckpt_format=ckpt_format))
    params = dict(plain.module.named_parameters())
    for name, values in dequantized.items():
        assert params[name].dtype == torch.bfloat16 and torch.equal(params[name].detach(), values), name
    plain_full = _all_mains(plain, plain_opt)  # the fp32 main weights come from the optimizer state
    assert set(plain_full) == set(saved_full)
    assert all(torch.equal(plain_full[n], main) for n, main in saved_full.items())
    return next_loss


# Each recipe and each format once by default; the two other pairings (the same save and load paths)
# in the full tier.
CHECKPOINT_CASES = [
    ("tensorwise", "torch_dist"),
    ("delayed", "torch"),
    pytest.param("delayed", "torch_dist", marks=pytest.mark.full),
    pytest.param("tensorwise", "torch", marks=pytest.mark.full),
]


@pytest.mark.parametrize("recipe, ckpt_format", CHECKPOINT_CASES)
def test_checkpoint_resume_is_bitwise_and_loads_without_the_flag(tmp_path, recipe, ckpt_format):
    run_distributed(_checkpoint_body, 2, str(tmp_path / ckpt_format), recipe, ckpt_format)


def _refusals_body(rank, world_size):
    groups = single_rank_groups()
    for kw, message in (
        (dict(bf16=True), "FP8 weights need FP8 training"),
        (
            dict(fp8="hybrid", fp8_recipe="blockwise", bf16=True),
            "fp8_recipe='blockwise': FP8 parameter all-gather with an FP8 recipe",
        ),
        (
            dict(fp8="hybrid", fp8_recipe="mxfp8", bf16=True),
            "fp8_recipe='mxfp8': FP8 parameter all-gather with an FP8 recipe",
        ),
    ):
        model = build_gpt(llama_style(**kw), groups)
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, fp8_param_gather=True)
        with pytest.raises(ValueError, match=message):
            DistributedDataParallel(model.config, ddp_config, model, pg_collection=groups)
    return True


def test_refusals():
    with pytest.raises(
        ValueError,
        match="fp8_param_gather=True, use_distributed_optimizer=False: FP8 parameter all-gather with no distributed",
    ):
        DistributedDataParallelConfig(fp8_param_gather=True)
    assert all(run_distributed(_refusals_body, 1))
    fp8 = ["--bf16", "--fp8-format", "hybrid", "--use-distributed-optimizer", "--fp8-param-gather"]
    for extra, message in (
        (
            ["--bf16", "--use-distributed-optimizer", "--fp8-param-gather"],
            "--fp8-param-gather=True, --fp8-format=None: .*FP8 weights need FP8 training",
        ),
        (fp8[:3] + ["--fp8-param-gather"], "--fp8-param-gather=True, --use-distributed-optimizer=False: "),
        (
            fp8 + ["--fp8-recipe", "blockwise"],
            "--fp8-param-gather=True, --fp8-format='hybrid', --fp8-recipe='blockwise': ",
        ),
        (["--bf16", "--fp4-format", "e2m1", "--use-distributed-optimizer", "--fp8-param-gather"], "FP4 weights"),
    ):
        with pytest.raises(A.ArgumentsError, match=message):
            _validated(extra, world_size=2)
    with pytest.raises(A.UnsupportedFlagError, match="not supported yet: --fp4-param-gather=True"):
        _validated(["--bf16", "--fp4-format", "e2m1", "--fp4-param-gather"], world_size=2)
    assert _validated(fp8, world_size=2).fp8_param_gather
