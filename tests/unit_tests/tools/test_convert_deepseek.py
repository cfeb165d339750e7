"""DeepSeek-V3 and V3.2 through tools/checkpoint/convert.py: HF -> ours (TP=2) -> 2 training steps -> HF.

A tiny random ``DeepseekV3ForCausalLM`` (MLA with query compression and YaRN, one dense layer then
MoE with sigmoid group-limited routing, a random ``e_score_correction_bias``, shared experts) is
converted in, trained two iterations by ``pretrain_gpt.py`` with the flags the converter printed
(TP=2 with sequence parallelism), exported, and loaded back with ``from_pretrained``: no missing or
unexpected keys, and logits equal to our model loaded from the trained checkpoint (max abs 1e-4,
fp32). HF -> ours -> HF without training gives back every tensor bit for bit. DeepSeek-V3.2 is the same
model with the sparse attention's lightning indexer (4 of up to 32 keys per query), trained under TP=2
with sequence parallelism as well.
"""

import pytest
import torch
import transformers  # a test dependency: missing it must fail, not skip

from tests.dist_harness import run_distributed
from tests.functional_tests.gpt_runs import assert_ok, run_gpt, tiny_gpt_flags
from tests.unit_tests.tools.test_convert_qwen import HF_VOCAB, MAX_ABS, TRAIN_FLAGS, _exported_body
from tools.checkpoint import convert, hf_config

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=4096)
YARN.update(beta_fast=32, beta_slow=1, mscale=0.9, mscale_all_dim=0.7)


V32 = dict(index_n_heads=4, index_head_dim=12, index_topk=4)


def _save(path, v32=False, **overrides):
    """A tiny random DeepSeek-V3 (``v32``: V3.2) saved under ``path``, with weights large enough to matter."""
    torch.manual_seed(0)
    fields = dict(
        vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=4,
        routed_scaling_factor=2.5, kv_lora_rank=12, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=6, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=32, rms_norm_eps=1e-6, rope_parameters=YARN, tie_word_embeddings=False,
    )  # fmt: skip
    fields.update(overrides)
    if v32:
        model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**fields, **V32))
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            else:  # HF's 0.02 leaves attention and experts too small to show in the logits
                param.normal_(0, 0.2)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn_like(buf))
    model.save_pretrained(path)
    return str(path)


EXPECTED_FLAGS = ["--multi-latent-attention", "--q-lora-rank", "--rope-type", "--mscale-all-dim", "--qk-layernorm"]
EXPECTED_FLAGS += ["--moe-router-score-function", "--moe-router-enable-expert-bias", "--moe-router-num-groups"]
EXPECTED_FLAGS += ["--moe-shared-expert-intermediate-size", "--moe-router-topk-scaling-factor", "--moe-layer-freq"]


V32_FLAGS = ["--experimental-attention-variant", "--dsa-indexer-n-heads", "--dsa-indexer-head-dim"]
V32_FLAGS += ["--dsa-indexer-topk"]


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v32"])
def test_convert_train_export(tmp_path, kind):
    hf_in, first, trained, hf_out = (str(tmp_path / n) for n in ("hf_in", "first", "trained", "hf_out"))
    _save(hf_in, v32=kind == "deepseek_v32")
    flags = convert.hf_to_megatron(hf_in, first, tp=2)
    for flag in EXPECTED_FLAGS + (V32_FLAGS if kind == "deepseek_v32" else []):
        assert flag in flags, f"the converter did not print {flag}: {flags}"
    run = tiny_gpt_flags(2) + flags + TRAIN_FLAGS + ["--load", first, "--finetune", "--save", trained]
    assert_ok(run_gpt(2, run + ["--sequence-parallel"], cwd=str(tmp_path)), f"pretrain_gpt.py ({kind}, TP=2)")
    assert convert.megatron_to_hf(trained, hf_out, kind, vocab_size=HF_VOCAB) == HF_VOCAB
    before, after = convert.read_hf_weights(hf_in), convert.read_hf_weights(hf_out)
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "training changed nothing"
    diff, clean, cls = run_distributed(_exported_body, 1, trained, hf_out)[0]
    assert clean and cls == convert.read_hf_config(hf_in)["architectures"][0]
    print(f"{kind} TP=2: max |logits diff| {diff:.3g}")
    assert diff <= MAX_ABS, f"{kind} TP=2: max |logits diff| {diff:.3g}"


def test_round_trip_is_exact_and_refusals(tmp_path):
    hf_in, ckpt, hf_out = (str(tmp_path / n) for n in ("in", "ckpt", "out"))
    _save(hf_in)
    convert.hf_to_megatron(hf_in, ckpt)
    convert.megatron_to_hf(ckpt, hf_out, "deepseek_v3")
    a, b = convert.read_hf_weights(hf_in), convert.read_hf_weights(hf_out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    v32_in, v32_ckpt, v32_out = (str(tmp_path / n) for n in ("v32_in", "v32_ckpt", "v32_out"))
    _save(v32_in, v32=True)
    convert.hf_to_megatron(v32_in, v32_ckpt)
    convert.megatron_to_hf(v32_ckpt, v32_out, "deepseek_v32")
    a, b = convert.read_hf_weights(v32_in), convert.read_hf_weights(v32_out)
    assert any(".indexer." in k for k in a) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(convert.ConversionError, match="experimental_attention_variant"):
        convert.megatron_to_hf(v32_ckpt, str(tmp_path / "o0"), "deepseek_v3")
    with pytest.raises(convert.ConversionError, match="multi_latent_attention"):
        convert.megatron_to_hf(ckpt, str(tmp_path / "o1"), "qwen3_moe")
    _, args = hf_config.megatron_args_from_hf(convert.read_hf_config(hf_in), "in", 1, 128)
    with pytest.raises(convert.ConversionError, match="mtp_num_layers is 1"):  # HF models have no MTP modules
        hf_config.hf_config_from_args(dict(args, mtp_num_layers=1), "deepseek_v3", HF_VOCAB, "ckpt")
    bad = _save(tmp_path / "bad", rope_parameters=dict(YARN, original_max_position_embeddings=256))
    with pytest.raises(convert.ConversionError, match="original_max_position_embeddings"):
        convert.hf_to_megatron(bad, str(tmp_path / "c2"))
