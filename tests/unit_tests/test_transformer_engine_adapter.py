"""The Transformer Engine adapter (``core/extensions/transformer_engine.py``), against a FAKE TE.

Nothing here runs the real Transformer Engine (it needs CUDA): ``tests/fakes/transformer_engine``
implements the API the adapter uses in plain torch and records what it is handed;
``test_te_oracle.py`` checks the adapter's keywords and the fake's signatures against TE's sources.

* Recipe mapping: every ``--fp8-recipe`` x ``--fp8-format`` and ``--fp4-recipe`` gives the TE recipe
  class and fields of an independent table; ``--no-fp8-wgrad`` is refused where TE has no switch.
* With the fake, ``--transformer-impl transformer_engine`` builds TE linears with the local layers'
  parameter names and values; a GPT model equals the local one in loss and gradients at TP=1 and
  TP=2 (with and without SP), each block's forward runs in one TE autocast with the mapped recipe and
  the TP x DP x CP group (the first/last bf16 window's layers in a nested disabled one), and no local
  quantizer is attached; a chunk under full recomputation re-enters the region when recomputed in
  backward. Under delayed scaling the fake TE all-reduces the amaxes when the outermost
  autocast exits, as TE does: exactly once per microbatch forward, not once per layer.
* Checkpoints: parameters load across impls both ways (torch_dist and the torch format, through
  the core API and through ``save_checkpoint`` / ``load_checkpoint``); TE's delayed-scaling state
  round-trips as a plain fp32 tensor; a pickled TE state is refused unread.
* Without TE, the same flag builds the local layers and says so once on rank 0.
"""

import io
import pickle
import tempfile
from contextlib import redirect_stdout

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing import load_extra_states, model_sharded_state_dict, model_state_to_save
from megatron.core.extensions import transformer_engine as te_ext
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.training.checkpointing import CheckpointConfig, load_checkpoint, save_checkpoint
from megatron.training.model_setup import report_transformer_impl
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, gpt2_style, llama_style, loss_and_grads, single_rank_groups
from tests.te_fake import fake_transformer_engine

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, bf16=True)
# Independent table: (flags) -> (TE recipe class, fields it must carry).
FP8_CASES = {
    ("tensorwise", "e4m3"): ("Float8CurrentScaling", {"fp8_format": "E4M3"}),
    ("tensorwise", "hybrid"): ("Float8CurrentScaling", {"fp8_format": "HYBRID"}),
    ("delayed", "e4m3"): (
        "DelayedScaling",
        {"fp8_format": "E4M3", "margin": 2, "amax_history_len": 8, "amax_compute_algo": "max"},
    ),
    ("delayed", "hybrid"): (
        "DelayedScaling",
        {"fp8_format": "HYBRID", "margin": 2, "amax_history_len": 8, "amax_compute_algo": "max"},
    ),
    ("blockwise", "e4m3"): ("Float8BlockScaling", {"fp8_format": "E4M3"}),
    ("blockwise", "hybrid"): ("Float8BlockScaling", {"fp8_format": "HYBRID"}),
    ("mxfp8", "e4m3"): ("MXFP8BlockScaling", {"fp8_format": "E4M3"}),
    ("mxfp8", "hybrid"): ("MXFP8BlockScaling", {"fp8_format": "HYBRID"}),
}


@pytest.mark.parametrize("recipe,fmt", sorted(FP8_CASES))
def test_fp8_recipe_mapping(recipe, fmt):
    config = TransformerConfig(
        **BASE, fp8=fmt, fp8_recipe=recipe, fp8_margin=2, fp8_amax_history_len=8, fp8_amax_compute_algo="max"
    )
    cls, fields = FP8_CASES[(recipe, fmt)]
    with fake_transformer_engine():
        mapped = te_ext.te_recipe(config)
        assert type(mapped).__name__ == cls
        for name, value in fields.items():
            got = getattr(mapped, name)
            assert (got.name if name == "fp8_format" else got) == value, (recipe, fmt, name, got)


def test_fp4_recipe_mapping_and_refusals():
    with fake_transformer_engine():
        mapped = te_ext.te_recipe(TransformerConfig(**BASE, fp4="e2m1", fp4_recipe="nvfp4"))
        assert type(mapped).__name__ == "NVFP4BlockScaling"
        for recipe in ("delayed", "tensorwise"):  # the fake's DelayedScaling, like TE 2.9's, has no switch
            config = TransformerConfig(**BASE, fp8="hybrid", fp8_recipe=recipe, fp8_wgrad=False)
            with pytest.raises(ValueError, match=r"fp8_wgrad=False: .*override_linear_precision"):
                te_ext.te_recipe(config)
        with pytest.raises(ValueError, match="neither fp8 nor fp4"):
            te_ext.te_recipe(TransformerConfig(**BASE))
    with pytest.raises(ValueError, match="transformer_impl='inference_optimized': must be one of"):
        TransformerConfig(**BASE, transformer_impl="inference_optimized")


def test_autocast_and_older_tes_fp8_autocast(monkeypatch):
    """``autocast`` where TE has it, else ``fp8_autocast``: the same recipe and group either way."""
    group = object()
    with fake_transformer_engine() as te:
        recipe = te_ext.te_recipe(TransformerConfig(**BASE, fp8="hybrid", fp8_recipe="tensorwise"))
        with te_ext.te_autocast(recipe, group):
            pass
        monkeypatch.delattr(te, "autocast")
        with te_ext.te_autocast(recipe, group):
            pass
        assert [(r["kind"], r["recipe"], r["group"], r["enabled"]) for r in te.RECORD] == [
            ("autocast", recipe, group, True),
            ("fp8_autocast", recipe, group, True),
        ]


def _linears(model):
    return [
        (n, type(m).__name__)
        for n, m in model.named_modules()
        if n.endswith(("linear_qkv", "linear_proj", "fc1", "fc2"))
    ]


def _compare_impls(tp_groups, ref_groups):
    """TE impl (fake) at TP=world, +-SP, equals the local impl at TP=1: same names, loss, gradients."""
    for style in (gpt2_style, llama_style):
        ref = build_gpt(style(transformer_impl="local"), ref_groups)
        assert {kind for _, kind in _linears(ref)} == {"ColumnParallelLinear", "RowParallelLinear"}
        ref_loss, ref_grads = loss_and_grads(ref, ref_groups.tp)
        for sp in (False, True):
            model = build_gpt(style(sequence_parallel=sp), tp_groups)
            kinds = {kind for _, kind in _linears(model)}
            assert kinds == {"TEColumnParallelLinear", "TERowParallelLinear"}, kinds
            loss, grads = loss_and_grads(model, tp_groups.tp)
            assert set(grads) == set(ref_grads)
            where = f"{style.__name__} sp={sp}"
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=lambda m: f"{where} loss: {m}")
            for name, grad in ref_grads.items():
                torch.testing.assert_close(
                    grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{where} {name}: {m}"
                )


def _one_autocast_per_block(te, tp_groups):
    """FP8 under the TE impl: one autocast per block forward with the mapped recipe and the TP x DP x CP
    group, the bf16 window's layer nested in a disabled one; TE linears get no local quantizer, the
    local impl's linears do."""
    te.RECORD.clear()
    model = build_gpt(gpt2_style(bf16=True, fp8="hybrid", fp8_recipe="tensorwise"), tp_groups)
    assert all(getattr(m, "quantizer", None) is None for m in model.modules() if te_ext.is_te_linear(type(m), "column"))
    local = build_gpt(gpt2_style(bf16=True, fp8="hybrid", fp8_recipe="tensorwise", transformer_impl="local"), tp_groups)
    assert all(m.quantizer is not None for m in local.decoder.modules() if isinstance(m, ColumnParallelLinear))
    tokens, labels = batch(0)
    model(tokens, None, None, labels=labels).mean().backward()
    casts = [r for r in te.RECORD if r["kind"] == "autocast"]
    assert len(casts) == 1 and casts[0]["group"] is tp_groups.tp_dp_cp and casts[0]["enabled"], casts
    assert type(casts[0]["recipe"]).__name__ == "Float8CurrentScaling"
    forwards = [r for r in te.RECORD if r["kind"] == "forward"]
    assert len(forwards) == 8 and all(r["recipe"] is not None for r in forwards)  # 4 linears x 2 layers
    te.RECORD.clear()
    bf16_window = dict(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=0)
    model = build_gpt(gpt2_style(bf16=True, fp8="hybrid", fp8_recipe="tensorwise", **bf16_window), tp_groups)
    model(tokens, None, None, labels=labels)
    forwards = [r for r in te.RECORD if r["kind"] == "forward"]
    assert [r["recipe"] is None for r in forwards] == [True] * 4 + [False] * 4
    assert [r["enabled"] for r in te.RECORD if r["kind"] == "autocast"] == [True, False]  # outer, layer 1's
    te.RECORD.clear()
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    model = build_gpt(gpt2_style(bf16=True, fp8="hybrid", fp8_recipe="tensorwise", **recompute), tp_groups)
    model(tokens, None, None, labels=labels).mean().backward()
    forwards = [r for r in te.RECORD if r["kind"] == "forward"]
    assert len(forwards) == 16 and all(r["recipe"] is not None for r in forwards)  # recomputed ones too


def _one_amax_reduction_per_microbatch(te, tp_groups):
    """Delayed scaling: TE all-reduces the amaxes when the outermost autocast exits, so once per
    microbatch forward over the TP x DP x CP group (not once per layer), none in a no-grad forward,
    and the backward ones once, in the region's first linear's backward;
    afterwards each linear's weight amax is the max of ``|W|`` over the TP ranks' shards."""
    model = build_gpt(gpt2_style(bf16=True, fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4), tp_groups)
    microbatches = 3
    te.RECORD.clear()
    for i in range(microbatches):
        tokens, labels = batch(i)
        model(tokens, None, None, labels=labels).mean().backward()
    with torch.no_grad():
        model(tokens, None, None, labels=labels)
    reductions = [r for r in te.RECORD if r["kind"] == "amax_reduction"]
    group = tp_groups.tp_dp_cp
    # forward then backward per microbatch; the per-layer regions gave 2 (layers) of each per microbatch
    assert [r["forward"] for r in reductions] == [True, False] * microbatches, reductions
    assert all(r["group"] is group and r["linears"] == 8 for r in reductions), reductions
    assert all(r["all_reduce"] == (torch.distributed.get_world_size(group) > 1) for r in reductions)
    for name, linear in model.named_modules():
        if te_ext.is_te_linear(type(linear), "column") or te_ext.is_te_linear(type(linear), "row"):
            local = linear.weight.detach().abs().max().float()
            torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX, group=tp_groups.tp)
            assert torch.equal(linear.fp8_meta["scaling_fwd"].amax_history[0, 1], local), name


def _fp8_state(model):
    return {n: v.clone() for n, v in model.state_dict().items() if n.endswith("_extra_state")}


def _checkpoints(tp_groups, directory):
    """Across impls (weights) both ways and both formats; TE's delayed state round-trips as fp32."""
    te_model, local = build_gpt(gpt2_style(), tp_groups), build_gpt(gpt2_style(transformer_impl="local"), tp_groups, 7)
    assert set(model_state_to_save(te_model)) == set(model_state_to_save(local))  # empty extra states left out
    local.load_state_dict(model_state_to_save(te_model))  # torch format, strict
    assert all(torch.equal(v, te_model.state_dict()[k]) for k, v in local.state_dict().items())
    other = build_gpt(gpt2_style(), tp_groups, seed=8)
    other.load_state_dict(model_state_to_save(build_gpt(gpt2_style(transformer_impl="local"), tp_groups, 9)))
    dist_checkpointing.save(model_sharded_state_dict([te_model], pg_collection=tp_groups), f"{directory}/plain")
    back = build_gpt(gpt2_style(transformer_impl="local"), tp_groups, seed=10)
    dist_checkpointing.load(model_sharded_state_dict([back], pg_collection=tp_groups), f"{directory}/plain")
    assert all(torch.equal(v, te_model.state_dict()[k]) for k, v in back.state_dict().items())

    delayed = gpt2_style(bf16=True, fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4)
    trained = build_gpt(delayed, tp_groups)
    loss_and_grads(trained, tp_groups.tp)
    saved = _fp8_state(trained)
    assert len(saved) == 8 and all(v.dtype == torch.float32 and v.numel() == 5 * (1 + 4) for v in saved.values())
    assert all(v.abs().sum() > 0 and not torch.equal(v, te_ext._initial_fp8_state(4)) for v in saved.values())
    sharded = model_sharded_state_dict([trained], pg_collection=tp_groups)
    dist_checkpointing.save(sharded, f"{directory}/delayed")
    resumed = build_gpt(delayed, tp_groups, seed=11)
    loaded = model_sharded_state_dict([resumed], pg_collection=tp_groups)
    dist_checkpointing.load(loaded, f"{directory}/delayed")
    assert load_extra_states(resumed, loaded, tp_groups) == 8
    plain = build_gpt(delayed, tp_groups, seed=12)
    plain.load_state_dict(model_state_to_save(trained))
    for copy in (resumed, plain):
        state = _fp8_state(copy)
        assert all(torch.equal(state[n], v) for n, v in saved.items())


def _training_checkpoints(tp_groups, directory):
    """``save_checkpoint`` / ``load_checkpoint`` in both formats: TE's delayed state back, weights across impls."""
    delayed = gpt2_style(bf16=True, fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4)
    trained = build_gpt(delayed, tp_groups)
    loss_and_grads(trained, tp_groups.tp)
    saved = _fp8_state(trained)
    for fmt in ("torch_dist", "torch"):
        cfg = CheckpointConfig(save=f"{directory}/{fmt}", load=f"{directory}/{fmt}", ckpt_format=fmt)
        save_checkpoint(1, [trained], None, None, cfg, {}, {}, pg_collection=tp_groups)
        resumed = build_gpt(delayed, tp_groups, seed=13)
        load_checkpoint([resumed], None, None, cfg, pg_collection=tp_groups)
        assert all(torch.equal(_fp8_state(resumed)[n], v) for n, v in saved.items()), fmt
        local = build_gpt(gpt2_style(transformer_impl="local"), tp_groups, seed=14)
        save_checkpoint(2, [local], None, None, cfg, {}, {}, pg_collection=tp_groups)
        into_te = build_gpt(gpt2_style(), tp_groups, seed=15)
        load_checkpoint([into_te], None, None, cfg, pg_collection=tp_groups)
        assert all(torch.equal(v, model_state_to_save(into_te)[k]) for k, v in local.state_dict().items()), fmt
        save_checkpoint(3, [into_te], None, None, cfg, {}, {}, pg_collection=tp_groups)
        into_local = build_gpt(gpt2_style(transformer_impl="local"), tp_groups, seed=16)
        load_checkpoint([into_local], None, None, cfg, pg_collection=tp_groups)  # strict: no _extra_state keys
        assert all(torch.equal(v, into_local.state_dict()[k]) for k, v in local.state_dict().items()), fmt


def _body(rank, world_size, directory):
    tp_groups = ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    with fake_transformer_engine() as te:
        _compare_impls(tp_groups, single_rank_groups())
        _one_autocast_per_block(te, tp_groups)
        _one_amax_reduction_per_microbatch(te, tp_groups)
        _checkpoints(tp_groups, directory)
        _training_checkpoints(tp_groups, directory)
    return True


@pytest.mark.parametrize("tp", [1, 2])
def test_te_impl_equals_local_and_checkpoints_cross_load(tp):
    with tempfile.TemporaryDirectory() as directory:
        assert all(run_distributed(_body, tp, directory))


class _Alarm:
    ran = False

    def __reduce__(self):
        return (_ring, ())


def _ring():
    _Alarm.ran = True


def _refusal_body(rank, world_size):
    with fake_transformer_engine():
        model = build_gpt(gpt2_style(bf16=True, fp8="hybrid", fp8_recipe="delayed"), single_rank_groups())
        linear = model.decoder.layers[0].self_attention.linear_qkv
        payload = torch.frombuffer(bytearray(pickle.dumps({"recipe": _Alarm()})), dtype=torch.uint8)
        with pytest.raises(ValueError, match="pickled byte tensor, is refused"):
            linear.set_extra_state(payload)
        with pytest.raises(ValueError, match="FP8 state has 3 values, this config expects 10"):
            linear.set_extra_state(torch.zeros(3))
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        with pytest.raises(NotImplementedError, match="fp8_recipe='delayed' with recompute_granularity='full'"):
            build_gpt(gpt2_style(bf16=True, fp8="hybrid", fp8_recipe="delayed", **recompute), single_rank_groups())
        build_gpt(gpt2_style(bf16=True, fp8="hybrid", fp8_recipe="tensorwise", **recompute), single_rank_groups())
    assert not _Alarm.ran
    return True


def test_refusals_a_pickled_te_state_unread_and_delayed_under_full_recompute():
    assert all(run_distributed(_refusal_body, 1))


def _fallback_body(rank, world_size):
    assert not te_ext.is_te_available()
    model = build_gpt(gpt2_style(), single_rank_groups())  # transformer_impl defaults to transformer_engine
    assert {kind for _, kind in _linears(model)} == {"ColumnParallelLinear", "RowParallelLinear"}
    lines = []
    for impl in ("transformer_engine", "local"):
        out = io.StringIO()
        with redirect_stdout(out):
            report_transformer_impl(TransformerConfig(**BASE, transformer_impl=impl))
        lines.append(out.getvalue().splitlines())
    return lines


def test_without_te_the_local_layers_run_and_rank0_says_so_once():
    per_rank = run_distributed(_fallback_body, 2)
    said, silent = per_rank[0]
    assert len(said) == 1 and "Transformer Engine does not import here" in said[0] and "local layers" in said[0]
    assert silent == [] and per_rank[1] == [[], []]


ENTRY_FLAGS = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16"
ENTRY_FLAGS += " --micro-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data"
ENTRY_FLAGS += " --tokenizer-type NullTokenizer --vocab-size 128"


def _entry_point_linears(rank, world_size):
    """The linears ``pretrain_gpt.model_provider`` builds from flags, with the fake TE importable."""
    import pretrain_gpt
    from megatron.core import tensor_parallel
    from megatron.training import arguments

    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    kinds = {}
    cases = {"default": [], "local": ["--transformer-impl", "local"], "moe": ["--num-experts", "2"]}
    with fake_transformer_engine():
        for name, extra in cases.items():
            args = arguments.validate_args(arguments.parse_args(ENTRY_FLAGS.split() + extra), world_size)
            config = arguments.core_transformer_config_from_args(args)
            model = pretrain_gpt.model_provider(config=config, args=args)
            kinds[name] = sorted({kind for _, kind in _linears(model)})
    return kinds


def test_the_entry_point_builds_te_linears_when_te_imports():
    """``--transformer-impl transformer_engine`` (the default) reaches TE through ``pretrain_gpt.py``."""
    kinds = run_distributed(_entry_point_linears, 1)[0]
    te_kinds = ["TEColumnParallelLinear", "TERowParallelLinear"]
    assert kinds["default"] == te_kinds, kinds
    assert kinds["local"] == ["ColumnParallelLinear", "RowParallelLinear"], kinds
    assert set(te_kinds) <= set(kinds["moe"]), kinds  # attention's linears; the experts stay local


def _first_microbatch_marks(rank, world_size):
    from megatron.core.quantization.step import quantized_step

    with fake_transformer_engine() as te:
        model = build_gpt(gpt2_style(), single_rank_groups())
        count = len(_linears(model))
        tokens, labels = batch()
        te.RECORD.clear()
        with quantized_step([model]):  # what every schedule runs a step in
            for _ in range(2):
                model(tokens, None, None, labels=labels)
        model(tokens, None, None, labels=labels)
        firsts = [r["first"] for r in te.RECORD if r["kind"] == "forward"]
    return count, firsts


def test_te_linears_get_is_first_microbatch_once_per_step():
    """True at each TE linear's first forward of a step, False at the next microbatch, None outside a step."""
    count, firsts = run_distributed(_first_microbatch_marks, 1)[0]
    assert count == 8 and firsts == [True] * count + [False] * count + [None] * count, firsts
