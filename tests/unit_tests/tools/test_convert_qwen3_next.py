"""Qwen3-Next through tools/checkpoint/convert.py.

Default tier: HF -> ours -> HF gives back every tensor bit for bit and the same config, the printed
``pretrain_gpt.py`` flags (GDN layers and sizes, output gate, partial RoPE, 1+w norms, the gated shared expert)
pass its validation, and a conversion at TP=2 is refused (the GDN rows are stored per TP rank).
Full tier: HF -> ours -> 2 training steps of ``pretrain_gpt.py`` -> HF, loaded back by ``from_pretrained`` with
no missing or unexpected keys, its logits equal to our trained model's (max abs 1e-4, fp32).
"""

import pytest
import torch
import transformers  # a test dependency: missing it must fail, not skip

from megatron.training.arguments import parse_args, validate_args
from tests.dist_harness import run_distributed
from tests.functional_tests.gpt_runs import assert_ok, run_gpt, tiny_gpt_flags
from tests.unit_tests.ssm.qwen3_next_utils import GDN
from tests.unit_tests.tools.test_convert_qwen import HF_VOCAB, MAX_ABS, TRAIN_FLAGS, _exported_body
from tools.checkpoint import convert

FAMILY_FLAGS = ["--experimental-attention-variant", "--linear-attention-freq", "--attention-output-gate"]
FAMILY_FLAGS += ["--apply-layernorm-1p", "--moe-shared-expert-gate", "--rotary-percent", "--qk-layernorm"]


def _save(path):
    """A tiny random ``Qwen3NextForCausalLM`` (GDN, attention; dense then MoE), norms and gates perturbed."""
    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(
        vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25, rms_norm_eps=1e-6, max_position_embeddings=32,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        mlp_only_layers=[0], layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False, **GDN,
    )  # fmt: skip
    model = transformers.Qwen3NextForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    return str(path)


def test_qwen3_next_round_trip_is_exact_and_flags_validate(tmp_path):
    hf_in, ckpt, hf_out = (str(tmp_path / n) for n in ("in", "ckpt", "out"))
    _save(hf_in)
    flags = convert.hf_to_megatron(hf_in, ckpt)
    for flag in FAMILY_FLAGS:
        assert flag in flags, f"the converter did not print {flag}: {flags}"
    assert convert._script_of(flags) == "pretrain_gpt.py"
    run = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(HF_VOCAB - 1)]
    run += ["--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]
    validate_args(parse_args(flags + run), world_size=1)
    convert.megatron_to_hf(ckpt, hf_out, "qwen3_next")
    a, b = convert.read_hf_weights(hf_in), convert.read_hf_weights(hf_out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    config_in, config_out = (transformers.AutoConfig.from_pretrained(d) for d in (hf_in, hf_out))
    for field in ("layer_types", "rope_parameters", "shared_expert_intermediate_size", *GDN, "mlp_only_layers"):
        assert getattr(config_out, field) == getattr(config_in, field), field
    with pytest.raises(convert.ConversionError, match="--target-tensor-parallel-size 2"):
        convert.hf_to_megatron(hf_in, str(tmp_path / "tp2"), tp=2)


def test_qwen3_next_convert_train_export(tmp_path):
    hf_in, first, trained, hf_out = (str(tmp_path / n) for n in ("hf_in", "first", "trained", "hf_out"))
    _save(hf_in)
    flags = convert.hf_to_megatron(hf_in, first)
    run = tiny_gpt_flags(2) + flags + TRAIN_FLAGS + ["--load", first, "--finetune", "--save", trained]
    assert_ok(run_gpt(1, run, cwd=str(tmp_path)), "pretrain_gpt.py (qwen3_next)")
    assert convert.megatron_to_hf(trained, hf_out, "qwen3_next", vocab_size=HF_VOCAB) == HF_VOCAB
    before, after = convert.read_hf_weights(hf_in), convert.read_hf_weights(hf_out)
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "training changed nothing"
    diff, clean, cls = run_distributed(_exported_body, 1, trained, hf_out)[0]
    assert clean and cls == "Qwen3NextForCausalLM"
    print(f"qwen3_next: max |logits diff| {diff:.3g}")
    assert diff <= MAX_ABS, f"qwen3_next: max |logits diff| {diff:.3g}"
