"""Qwen2, Qwen3, Qwen3-MoE, Mistral and Mixtral through tools/checkpoint/convert.py: HF -> ours -> 2 training
steps -> HF.

Tiny random ``transformers`` models (nothing downloaded) are converted in, trained two
iterations by ``pretrain_gpt.py`` (``--finetune`` from the converted checkpoint, with the
flags the converter printed) under TP=1 or TP=2, exported, and loaded back with
``from_pretrained``: no missing or unexpected keys, and logits equal to our model loaded from
the trained checkpoint (max abs 1e-4, fp32; random router weights: no routing ties). Mistral's
sliding window (8 of the 32 positions) becomes ``--window-size 7,0`` and comes back.
"""

import pytest
import torch
import transformers  # a test dependency: missing it must fail, not skip

from megatron.core import parallel_state as ps
from tests.dist_harness import run_distributed
from tests.functional_tests.gpt_runs import assert_ok, run_gpt, tiny_gpt_flags
from tests.unit_tests.tools.test_checkpoint_convert import _our_logits
from tools.checkpoint import convert, llama_family

MAX_ABS = 1e-4
HF_VOCAB = 100  # NullTokenizer --vocab-size 99: 99 text ids and the eod
SHAPE = dict(
    vocab_size=HF_VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
)


def _save(kind, path):
    """A tiny random HF model of ``kind`` saved under ``path``."""
    torch.manual_seed(0)
    if kind == "qwen2":  # tied embeddings, like the small Qwen2.5 models
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True))
    elif kind == "qwen3":  # head dim 16 != hidden / heads
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=False))
    elif kind == "mistral":  # a window shorter than the sequence: it changes the logits
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**SHAPE, sliding_window=8))
    elif kind == "mixtral":  # every layer MoE, experts of intermediate_size; saved as block_sparse_moe.experts.{j}.w1
        config = transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2)  # untied
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(
            **SHAPE,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            tie_word_embeddings=False,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: make them tell apart
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    return str(path)


TRAIN_FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(HF_VOCAB - 1)]
TRAIN_FLAGS += ["--no-save-optim", "--no-save-rng", "--lr-warmup-iters", "1", "--save-interval", "2"]
FAMILY_FLAGS = {
    "qwen2": ["--add-qkv-bias"],
    "qwen3": ["--qk-layernorm"],
    "qwen3_moe": ["--qk-layernorm", "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1]"],
    "mistral": ["--window-size", "7,0"],
    "mixtral": ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64"],
}


def _exported_body(rank, world_size, save, hf_dir):
    """Max |ours - HF| of the exported model, and whether HF loaded it without missing/unexpected keys."""
    tokens = torch.randint(0, HF_VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    with torch.no_grad():
        expected = hf.eval()(tokens).logits
    ours = _our_logits(save, tokens, ps.initialize_model_parallel(world_size, 1))
    clean = not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    return (ours[..., :HF_VOCAB] - expected).abs().max().item(), clean, type(hf).__name__


@pytest.mark.parametrize("kind,tp", [("qwen2", 1), ("qwen3", 2), ("qwen3_moe", 2), ("mistral", 1), ("mixtral", 2)])
def test_convert_train_export(tmp_path, kind, tp):
    hf_in, first, trained, hf_out = (str(tmp_path / n) for n in ("hf_in", "first", "trained", "hf_out"))
    _save(kind, hf_in)
    flags = convert.hf_to_megatron(hf_in, first, tp=tp)
    for flag in FAMILY_FLAGS[kind]:
        assert flag in flags, f"{kind}: the converter did not print {flag}: {flags}"
    run = tiny_gpt_flags(2) + flags + TRAIN_FLAGS + ["--load", first, "--finetune", "--save", trained]
    if tp > 1 and "--num-experts" in FAMILY_FLAGS[kind]:
        run += ["--sequence-parallel"]  # MoE with TP trains only with SP (Megatron's rule)
    assert_ok(run_gpt(tp, run, cwd=str(tmp_path)), f"pretrain_gpt.py ({kind}, TP={tp})")
    assert convert.megatron_to_hf(trained, hf_out, kind, vocab_size=HF_VOCAB) == HF_VOCAB
    before, after = convert.read_hf_weights(hf_in), convert.read_hf_weights(hf_out)
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "training changed nothing"
    diff, clean, cls = run_distributed(_exported_body, 1, trained, hf_out)[0]
    assert clean and cls == transformers.AutoConfig.from_pretrained(hf_in).architectures[0]
    print(f"{kind} TP={tp}: max |logits diff| {diff:.3g}")
    assert diff <= MAX_ABS, f"{kind} TP={tp}: max |logits diff| {diff:.3g}"


def test_round_trip_is_exact(tmp_path):
    """HF -> ours -> HF gives back every tensor bit for bit (Qwen3-MoE: all three families' tensors; Mixtral's
    per-expert w1/w2/w3 names)."""
    for kind in ("qwen2", "qwen3_moe", "mistral", "mixtral"):
        hf_in, ckpt, hf_out = (str(tmp_path / f"{kind}_{n}") for n in ("in", "ckpt", "out"))
        _save(kind, hf_in)
        convert.hf_to_megatron(hf_in, ckpt)
        convert.megatron_to_hf(ckpt, hf_out, kind)
        a, b = convert.read_hf_weights(hf_in), convert.read_hf_weights(hf_out)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), kind
        config_in, config_out = (transformers.AutoConfig.from_pretrained(d) for d in (hf_in, hf_out))
        assert config_out.architectures == config_in.architectures, kind
        assert getattr(config_out, "sliding_window", None) == getattr(config_in, "sliding_window", None), kind


def test_refusals(tmp_path):
    """A Qwen3 checkpoint cannot be written as Qwen2 (no QKV bias in Qwen3) nor a dense one as Qwen3-MoE or
    Mixtral; a Qwen3-MoE one with a dense layer and query/key norms not as Mixtral."""
    hf_in, ckpt = str(tmp_path / "in"), str(tmp_path / "ckpt")
    _save("qwen3", hf_in)
    convert.hf_to_megatron(hf_in, ckpt)
    with pytest.raises(convert.ConversionError, match="add_qkv_bias"):
        convert.megatron_to_hf(ckpt, str(tmp_path / "o1"), "qwen2")
    for moe_kind in ("qwen3_moe", "mixtral"):
        with pytest.raises(convert.ConversionError, match="num_experts"):
            convert.megatron_to_hf(ckpt, str(tmp_path / "o2"), moe_kind)
    moe_in, moe_ckpt = str(tmp_path / "moe_in"), str(tmp_path / "moe_ckpt")
    _save("qwen3_moe", moe_in)
    convert.hf_to_megatron(moe_in, moe_ckpt)
    with pytest.raises(convert.ConversionError, match="qk_layernorm"):
        convert.megatron_to_hf(moe_ckpt, str(tmp_path / "o3"), "mixtral")


def test_mixtral_refuses_what_its_config_cannot_express():
    """MixtralConfig has no dense layers and one FFN size for the experts: both are refused, naming the flag."""
    base = dict(num_layers=2, ffn_hidden_size=64, num_experts=4, moe_router_topk=2)
    fields = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    assert llama_family.config_fields(base, "mixtral", "ckpt") == fields
    with pytest.raises(convert.ConversionError, match=r"moe_layer_freq is \[0, 1\]"):
        llama_family.config_fields({**base, "moe_layer_freq": [0, 1]}, "mixtral", "ckpt")
    with pytest.raises(convert.ConversionError, match="moe_ffn_hidden_size is 32"):
        llama_family.config_fields({**base, "moe_ffn_hidden_size": 32}, "mixtral", "ckpt")
