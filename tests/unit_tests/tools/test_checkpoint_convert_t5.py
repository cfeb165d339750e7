"""tools/checkpoint/convert.py for T5: Hugging Face T5ForConditionalGeneration (v1.1) <-> our T5Model (--t5-v11).

Random tiny models, offline, with 2 encoder and 3 decoder layers (the stacks are sized apart) and
4 heads of 12 channels on a hidden size of 32 (``d_kv`` is not ``d_model / num_heads``). The
HF files are what transformers 5 writes for v1.1: their own ``lm_head.weight`` next to
``shared.weight`` (transformers 5 ties the two in the module, so the test unties it before saving).
Our logits come from the model the training loader (``load_checkpoint`` with ``--finetune``) fills
from the converted checkpoint, on a batch with encoder and decoder padding; they must equal Hugging
Face's within 1e-4. The end-to-end test trains the converted model for 2 iterations with
``pretrain_t5.py`` and the printed flags, exports it and loads it back into ``transformers``.
"""

import os
import shutil

import pytest
import torch
import transformers  # a test dependency (requirements-test.txt): missing it must fail, not skip

from megatron.core import parallel_state as ps
from megatron.core.models.T5 import t5_padding_attention_masks
from megatron.core.tokenizers.build import build_tokenizer
from megatron.training.checkpointing import CheckpointConfig, load_checkpoint
from tests.dist_harness import run_distributed
from tests.functional_tests.gpt_runs import REPO, assert_ok, run_gpt, tiny_gpt_flags, with_flags
from tests.model_utils import t5_batch
from tests.tokenizer_files import make_tokenizer_files
from tests.unit_tests.tools.convert_helpers import convert_to_megatron, write_config
from tools.checkpoint import convert

MAX_ABS = 1e-4
HF_VOCAB = 100  # pads to 128 with the default --make-vocab-size-divisible-by 128
STD = 0.3  # larger than T5's initialisation: sharp attention, so padding and the relative bias matter
ENC_LAYERS, DEC_LAYERS = 2, 3


def _hf_config(vocab: int = HF_VOCAB) -> transformers.T5Config:
    return transformers.T5Config(
        vocab_size=vocab,
        d_model=32,
        d_kv=12,  # heads x d_kv = 48, not d_model: the projections are not square
        d_ff=48,
        num_layers=ENC_LAYERS,
        num_decoder_layers=DEC_LAYERS,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        layer_norm_epsilon=1e-6,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        decoder_start_token_id=0,
    )


def _save(path, seed: int, vocab: int = HF_VOCAB) -> str:
    """A random v1.1 T5 (own LM head, every tensor random, norms around 1) saved with ``save_pretrained``."""
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(_hf_config(vocab))
    model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight))  # v1.1: an untied head
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "layer_norm" in name else p.normal_(0.0, STD)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("hf_t5") / "t5", 0)


def _our_model(save, groups):
    """Our T5Model loaded from ``save`` by the training loader."""
    iter_dir, common = convert.find_checkpoint(save)
    args = dict(common["args"])
    args["padded_vocab_size"] = convert.dc.read_metadata(iter_dir).state_dict_metadata[convert.EMBEDDING_KEY].size[0]
    model = convert.build_model(args, groups, "t5").eval()
    load_checkpoint([model], None, None, CheckpointConfig(load=save, finetune=True), groups)
    return model


def _hf_logits(hf_model, data):
    with torch.no_grad():
        return hf_model(
            input_ids=data["enc"],
            attention_mask=data["enc_pad"],
            decoder_input_ids=data["dec"],
            decoder_attention_mask=data["dec_pad"],
        ).logits


def _our_logits(ours, data):
    """Our logits on the padded batch (the padded vocabulary)."""
    with torch.no_grad():
        return ours(data["enc"], data["dec"], *t5_padding_attention_masks(data["enc_pad"], data["dec_pad"]))


def _diff_body(rank, world_size, hf_path, save):
    """(max |ours - HF| over the real vocabulary, our padded vocabulary, max |padded-row logits|)."""
    groups = ps.initialize_model_parallel(1, 1)
    hf_model = transformers.T5ForConditionalGeneration.from_pretrained(hf_path).eval()
    assert hf_model.lm_head.weight is not hf_model.shared.weight
    data = t5_batch()
    ref, got = _hf_logits(hf_model, data), _our_logits(_our_model(save, groups), data)
    vocab = ref.shape[-1]
    return (got[..., :vocab] - ref).abs().max().item(), got.shape[-1], got[..., vocab:].abs().max().item()


def test_hf_to_megatron_logits_and_flags(hf_dir, tmp_path):
    save = str(tmp_path / "c")
    flags = convert.hf_to_megatron(hf_dir, save)
    print(" ".join(flags))
    expected = {"--encoder-num-layers": "2", "--decoder-num-layers": "3", "--kv-channels": "12"}
    expected.update({"--ffn-hidden-size": "48", "--relative-attention-num-buckets": "8", "--norm-epsilon": "1e-06"})
    expected.update({"--relative-attention-max-distance": "16", "--position-embedding-type": "relative"})
    for flag, value in expected.items():
        assert flags[flags.index(flag) + 1] == value, flag
    for flag in ("--t5-v11", "--disable-bias-linear", "--untie-embeddings-and-output-weights"):
        assert flag in flags
    assert flags[flags.index("--normalization") + 1] == "RMSNorm" and "--num-layers" not in flags
    diff, padded, pad_rows = run_distributed(_diff_body, 1, hf_dir, save)[0]
    print({"max_abs_logits_diff": diff, "padded_vocab": padded})
    assert padded == 128 and pad_rows == 0.0
    assert diff <= MAX_ABS, f"max |logits diff| {diff:.3g}"


def test_tp2_padding(hf_dir, tmp_path):
    flags = convert.hf_to_megatron(hf_dir, str(tmp_path / "c"), tp=2)
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == "2"
    iter_dir, _ = convert.find_checkpoint(str(tmp_path / "c"))
    saved = convert.dc.read_metadata(iter_dir).state_dict_metadata
    assert saved[convert.EMBEDDING_KEY].size[0] == 256 and saved["lm_head.output_layer.weight"].size[0] == 256


def test_round_trip(hf_dir, tmp_path):
    """Export gives back the v1.1 file tensor for tensor, with its own LM head and an untied config."""
    save, out = str(tmp_path / "c"), str(tmp_path / "out")
    convert.hf_to_megatron(hf_dir, save)
    argv = ["--direction", "megatron-to-hf", "--load", save, "--hf-dir-out", out, "--model-type", "t5"]
    assert convert.main(argv) == 0
    config = convert.read_hf_config(out)
    assert config["architectures"] == ["T5ForConditionalGeneration"] and config["vocab_size"] == HF_VOCAB
    assert config["tie_word_embeddings"] is False and config["feed_forward_proj"] == "gated-gelu"
    original, exported = convert.read_hf_weights(hf_dir), convert.read_hf_weights(out)
    assert "lm_head.weight" in original and exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    model, info = transformers.T5ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not model.config.scale_decoder_outputs
    assert torch.equal(model.lm_head.weight, original["lm_head.weight"])
    assert torch.equal(model.shared.weight, original["shared.weight"])
    # A file that says tie_word_embeddings false (older transformers) converts the same.
    write_config(out, drop=("scale_decoder_outputs",))
    diff = run_distributed(_diff_body, 1, out, save)[0][0]
    assert diff <= MAX_ABS, diff


def _error_of(hf_dir, save, capsys, *extra):
    argv = ["--direction", "hf-to-megatron", "--hf-dir", hf_dir, "--save", save, *extra]
    assert convert.main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "changes, needle",
    [
        (dict(feed_forward_proj="relu"), "field 'feed_forward_proj' is 'relu'; only T5 v1.1"),
        (dict(is_gated_act=False), "field 'is_gated_act' is False; only T5 v1.1"),
        (dict(scale_decoder_outputs=True), "field 'scale_decoder_outputs' is True"),
        (dict(tie_word_embeddings=True, drop=("scale_decoder_outputs",)), "field 'tie_word_embeddings' is True"),
        (dict(relative_attention_num_buckets=0), "field 'relative_attention_num_buckets' is 0"),
        (dict(relative_attention_max_distance=None), "field 'relative_attention_max_distance' is None"),
        (dict(drop=("d_kv",)), "field 'd_kv' is missing"),
    ],
    ids=["relu", "not_gated", "scaled", "tied_v10", "buckets", "distance", "d_kv"],
)
def test_clear_errors(hf_dir, tmp_path, capsys, changes, needle):
    bad = str(tmp_path / "bad")
    shutil.copytree(hf_dir, bad)
    write_config(bad, **changes)
    err = _error_of(bad, str(tmp_path / "s"), capsys)
    assert needle in err, err


def test_refused_checkpoints(hf_dir, tmp_path, capsys):
    """No pipeline parallelism, no tied LM head in the file, no other family or non-v1.1 checkpoint on export."""
    assert "T5 has no pipeline parallelism" in _error_of(
        hf_dir, str(tmp_path / "s"), capsys, "--target-pipeline-model-parallel-size", "2"
    )
    from safetensors.torch import load_file, save_file

    tied = str(tmp_path / "tied")
    shutil.copytree(hf_dir, tied)
    weights = load_file(os.path.join(tied, "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, os.path.join(tied, "model.safetensors"))
    err = _error_of(tied, str(tmp_path / "t"), capsys)
    assert "weight 'lm_head.weight' is missing: a tied LM head is T5 v1.0" in err
    save = str(tmp_path / "c")
    convert.hf_to_megatron(hf_dir, save)
    argv = ["--direction", "megatron-to-hf", "--load", save, "--hf-dir-out", str(tmp_path / "o"), "--model-type"]
    assert convert.main(argv + ["gpt2"]) == 2
    assert "is a T5 checkpoint" in capsys.readouterr().err
    common_file = os.path.join(save, "release", convert.COMMON_FILE)
    common = convert.read_json(common_file, "common")
    common["args"]["t5_v11"] = False
    convert.write_json_atomic(common_file, common)
    assert convert.main(argv + ["t5", "--no-verify-checkpoint"]) == 2
    assert "flag t5_v11 is False; --model-type t5 needs True" in capsys.readouterr().err


# ---------------------------------------------------------------- end to end with pretrain_t5.py
_MODEL_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads", "--hidden-dropout", "--attention-dropout")
_MODEL_FLAGS += ("--make-vocab-size-divisible-by",)
EXTRA_IDS = "100"


def _trained_body(rank, world_size, save, out_dir, original_dir):
    """(max |HF(exported) - ours(trained)|, max |HF(exported) - HF(original)|) of the logits, and loading info."""
    groups = ps.initialize_model_parallel(1, 1)
    exported, info = transformers.T5ForConditionalGeneration.from_pretrained(out_dir, output_loading_info=True)
    original = transformers.T5ForConditionalGeneration.from_pretrained(original_dir).eval()
    data = t5_batch()
    got, before = _hf_logits(exported.eval(), data), _hf_logits(original, data)
    ours = _our_logits(_our_model(save, groups), data)
    assert torch.isfinite(got).all()
    same = (ours[..., : got.shape[-1]] - got).abs().max().item()
    info = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys")}
    return same, (got - before).abs().max().item(), info


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_convert_train_export(tmp_path, tp):
    """HF -> release checkpoint -> pretrain_t5.py (printed flags, 2 iterations, --finetune, mock data) -> HF.

    With ``tp`` 2 the checkpoint converted for TP=1 trains on 2 ranks (the 702-token vocabulary pads to 768
    either way) and the sharded result exports the same."""
    vocab_file = make_tokenizer_files(str(tmp_path / "tok"))["BertWordPieceLowerCase"]["vocab_file"]
    tokenizer = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab_file, vocab_extra_ids=int(EXTRA_IDS))
    vocab = tokenizer.vocab_size  # the WordPiece lines, [BOS], [EOS] and the sentinels: the padding agrees
    hf_dir = _save(tmp_path / "hf", 2, vocab=vocab)
    converted, trained, out = (str(tmp_path / n) for n in ("converted", "trained", "out"))
    stdout, printed = convert_to_megatron(hf_dir, converted)
    assert "pretrain_t5.py" in stdout and "--t5-v11" in printed and "--finetune" in printed
    training = with_flags(tiny_gpt_flags(2), {**dict.fromkeys(_MODEL_FLAGS), "--lr-warmup-iters": "1"})
    training += ["--mock-data", "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab_file]
    training += ["--vocab-extra-ids", EXTRA_IDS, "--decoder-seq-length", "16"]
    training += ["--save", trained, "--save-interval", "2", "--no-save-optim", "--no-save-rng"]
    printed = with_flags(printed, {"--tensor-model-parallel-size": str(tp)})
    result = run_gpt(tp, training + printed, cwd=str(tmp_path), script=[os.path.join(REPO, "pretrain_t5.py")])
    assert_ok(result, "pretrain_t5.py from the converted checkpoint")
    assert len(result.lines) == 2
    argv = ["--direction", "megatron-to-hf", "--load", trained, "--hf-dir-out", out, "--model-type", "t5"]
    assert convert.main(argv) == 0
    assert convert.read_hf_config(out)["vocab_size"] == vocab  # padding stripped to the tokenizer's vocabulary
    same, moved, info = run_distributed(_trained_body, 1, trained, out, hf_dir)[0]
    original, exported = convert.read_hf_weights(hf_dir), convert.read_hf_weights(out)
    assert exported.keys() == original.keys()
    step = max((exported[k] - original[k]).abs().max().item() for k in original)
    print({"exported_vs_trained": same, "exported_vs_original": moved, "max_weight_step": step, **info})
    assert info == {"missing_keys": [], "unexpected_keys": []}
    # Training started from the converted weights: 2 Adam steps of lr <= 3e-3 move no weight far.
    assert 0 < step < 0.02, step
    assert same <= MAX_ABS, f"exported vs trained checkpoint: max |logits diff| {same:.3g}"
    assert moved > MAX_ABS, "training did not change the model"
