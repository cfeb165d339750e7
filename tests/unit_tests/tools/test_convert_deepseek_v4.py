"""DeepSeek-V4 through tools/checkpoint/convert.py (``--model-type deepseek_v4``).

A tiny random ``DeepseekV4ForCausalLM`` (CSA, HCA and sliding-window layers, three hyper-connection streams, a
hash-routed MoE layer then learned ones with sqrtsoftplus scores and a random expert bias, clamped SwiGLU) saved
by ``save_pretrained`` (DeepSeek's original tensor names on disk).
Default tier: HF -> ours -> HF gives back every tensor bit for bit and the same config; our model loaded from the
converted checkpoint gives ``transformers``' logits (max abs 1e-4, fp32, 32 tokens: window 6, CSA top-3 of up to
8 entries, HCA 4 entries); the printed ``pretrain_gpt.py`` flags pass its validation; config fields our model
does not compute are refused by name, and so is exporting the checkpoint as another family.
Full tier: HF -> ours -> 2 training steps of ``pretrain_gpt.py`` (the printed flags, TP=2 with sequence
parallelism) -> HF, loaded back by ``from_pretrained`` with no missing, unexpected or mismatched keys, the trained
weights carried, its logits equal to our trained model's (max abs 1e-4).
"""

import pytest
import torch
import transformers  # a test dependency: missing it must fail, not skip

from megatron.training.arguments import parse_args, validate_args
from tests.dist_harness import run_distributed
from tests.functional_tests.gpt_runs import assert_ok, run_gpt, tiny_gpt_flags
from tests.unit_tests.tools.test_checkpoint_convert import _our_logits
from tests.unit_tests.tools.test_convert_qwen import HF_VOCAB, MAX_ABS, TRAIN_FLAGS, _exported_body
from tools.checkpoint import convert, hf_config

TYPES = ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"]
SHAPE = dict(
    vocab_size=HF_VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
    head_dim=16, q_lora_rank=12, partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=4,
    layer_types=TYPES, compress_rates={TYPES[0]: 4, TYPES[1]: 8}, hc_mult=3, mlp_layer_types=["hash_moe", "moe", "moe"],
    swiglu_limit=3.0, sliding_window=6, o_groups=2, o_lora_rank=6, index_n_heads=2, index_head_dim=8, index_topk=3,
    max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip
V4_FLAGS = ["--compressed-attention-layer-types", "--csa-compress-rate", "--hca-compress-rate", "--q-lora-rank"]
V4_FLAGS += ["--attention-output-groups", "--attention-output-lora-rank", "--dsa-indexer-topk", "--window-size"]
V4_FLAGS += ["--hyper-connection-streams", "--moe-num-hash-layers", "--activation-func-clamp-value"]
V4_FLAGS += ["--rotary-interleaved", "--rotary-percent", "--moe-router-enable-expert-bias"]


def _save(path, **overrides):
    """A tiny random DeepSeek-V4 saved under ``path``, weights large enough to show in the logits, a random
    hash table (k distinct experts per token id) and expert bias."""
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**dict(SHAPE, **overrides)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                buf.copy_(torch.rand(buf.shape[0], SHAPE["n_routed_experts"]).argsort(-1)[:, : buf.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn_like(buf))
    model.save_pretrained(path)
    return str(path)


def _logits_diff(ckpt, hf_dir):
    """Max |ours - transformers| over 2 x 32 tokens: ours loaded from ``ckpt`` (this process, one rank)."""
    tokens = torch.randint(0, HF_VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        expected = hf(tokens).logits
    with convert.single_process_group() as groups:
        ours = _our_logits(ckpt, tokens, groups)
    return (ours[..., :HF_VOCAB] - expected).abs().max().item(), expected.abs().max().item()


def _refusals(tmp_path, hf_in, ckpt):
    """Config fields our model does not compute, and a V4 checkpoint exported as another family."""
    config = convert.read_hf_config(hf_in)
    for field, value, match in (
        ("scoring_func", "softmax", "scoring_func"),
        ("hc_mult", 1, "hc_mult"),
        ("mlp_layer_types", ["moe", "hash_moe", "moe"], "mlp_layer_types"),
        ("n_shared_experts", 2, "n_shared_experts"),
        ("rope_parameters", dict(config["rope_parameters"], compress=dict(rope_type="yarn", factor=16.0)), "yarn"),
    ):
        with pytest.raises(convert.ConversionError, match=match):
            hf_config.megatron_args_from_hf(dict(config, **{field: value}), "config.json", 1, 128)
    with pytest.raises(convert.ConversionError, match="--model-type deepseek_v3 needs"):
        convert.megatron_to_hf(ckpt, str(tmp_path / "as_v3"), "deepseek_v3")
    _, args = hf_config.megatron_args_from_hf(config, "config.json", 1, 128)
    v3_like = dict(args, qk_layernorm=True, multi_latent_attention=True, rotary_interleaved=False, rotary_percent=1.0)
    with pytest.raises(convert.ConversionError, match="compressed_attention_layer_types"):  # V4's parts named
        hf_config.hf_config_from_args(v3_like, "deepseek_v3", HF_VOCAB, "ckpt")
    for dest, value in (("moe_router_score_function", "softmax"), ("mtp_num_layers", 1), ("rotary_interleaved", False)):
        with pytest.raises(convert.ConversionError, match=dest):
            hf_config.hf_config_from_args(dict(args, **{dest: value}), "deepseek_v4", HF_VOCAB, "ckpt")


def test_deepseek_v4_round_trip_logits_flags_and_refusals(tmp_path):
    hf_in, ckpt, hf_out = (str(tmp_path / n) for n in ("in", "ckpt", "out"))
    _save(hf_in)
    flags = convert.hf_to_megatron(hf_in, ckpt)
    for flag in V4_FLAGS:
        assert flag in flags, f"the converter did not print {flag}: {flags}"
    assert flags[flags.index("--moe-router-score-function") + 1] == "sqrtsoftplus"
    run = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(HF_VOCAB - 1)]
    run += ["--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]
    validate_args(parse_args(flags + run), world_size=1)
    convert.megatron_to_hf(ckpt, hf_out, "deepseek_v4")
    a, b = convert.read_hf_weights(hf_in), convert.read_hf_weights(hf_out)
    assert any(k.endswith("tid2eid") for k in a) and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    config_in, config_out = (transformers.AutoConfig.from_pretrained(d) for d in (hf_in, hf_out))
    assert config_out.to_diff_dict() == dict(config_in.to_diff_dict(), num_nextn_predict_layers=0)
    diff, scale = _logits_diff(ckpt, hf_out)
    print(f"deepseek_v4: max |logits diff| {diff:.3g} (logits up to {scale:.3g})")
    assert scale > 0.5 and diff <= MAX_ABS, f"max |logits diff| {diff:.3g}"
    _refusals(tmp_path, hf_in, ckpt)


@pytest.mark.full  # default-tier sibling: test_deepseek_v4_round_trip_logits_flags_and_refusals (the same model)
def test_deepseek_v4_convert_train_export(tmp_path):
    hf_in, first, trained, hf_out = (str(tmp_path / n) for n in ("hf_in", "first", "trained", "hf_out"))
    _save(hf_in)
    flags = convert.hf_to_megatron(hf_in, first, tp=2)
    run = tiny_gpt_flags(2) + flags + TRAIN_FLAGS + ["--load", first, "--finetune", "--save", trained]
    assert_ok(run_gpt(2, run + ["--sequence-parallel"], cwd=str(tmp_path)), "pretrain_gpt.py (deepseek_v4, TP=2)")
    assert convert.megatron_to_hf(trained, hf_out, "deepseek_v4", vocab_size=HF_VOCAB) == HF_VOCAB
    before, after = convert.read_hf_weights(hf_in), convert.read_hf_weights(hf_out)
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert any(".attn." in k for k in changed) and any("hc_" in k for k in changed), "training changed nothing"
    diff, clean, cls = run_distributed(_exported_body, 1, trained, hf_out)[0]
    assert clean and cls == "DeepseekV4ForCausalLM"
    print(f"deepseek_v4 TP=2: max |logits diff| {diff:.3g}")
    assert diff <= MAX_ABS, f"deepseek_v4 TP=2: max |logits diff| {diff:.3g}"
