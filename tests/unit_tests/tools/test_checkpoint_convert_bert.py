"""tools/checkpoint/convert.py for BERT: Hugging Face BertForPreTraining / BertForMaskedLM <-> post-LN BertModel.

Random tiny models, offline. Our logits come from the model the training loader (``load_checkpoint``
with ``--finetune``) fills from the converted checkpoint, on a batch with padding and token types
0/1; they must equal Hugging Face's within 1e-4. The end-to-end test trains the converted model
for 2 iterations with ``pretrain_bert.py`` and the printed flags, exports it and loads it back
into ``transformers``.
"""

import json
import os
import shutil

import pytest
import torch
import transformers  # a test dependency (requirements-test.txt): missing it must fail, not skip

from megatron.core import parallel_state as ps
from megatron.training.checkpointing import CheckpointConfig, load_checkpoint
from tests.dist_harness import run_distributed
from tests.functional_tests.gpt_runs import REPO, assert_ok, run_gpt, tiny_gpt_flags, with_flags
from tests.tokenizer_files import make_tokenizer_files
from tests.unit_tests.tools.convert_helpers import convert_to_megatron, write_config
from tools.checkpoint import convert

MAX_ABS = 1e-4
HF_VOCAB = 100  # pads to 128 with the default --make-vocab-size-divisible-by 128
SEQ = 16
STD = 0.3  # larger than BERT's 0.02: sharper attention, so padding and token types matter


def _hf_config(vocab: int = HF_VOCAB, **overrides) -> transformers.BertConfig:
    kw = dict(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=STD,
    )
    kw.update(overrides)
    return transformers.BertConfig(**kw)


def _save(path, cls, seed, **overrides):
    torch.manual_seed(seed)
    model = cls(_hf_config(**overrides))
    with torch.no_grad():  # HF initialises biases and LayerNorms to 0 / 1: make every tensor count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_bert")
    return {
        "pretraining": _save(root / "pretraining", transformers.BertForPreTraining, 0),
        "masked_lm": _save(root / "masked_lm", transformers.BertForMaskedLM, 1),
        "untied_masked_lm": _save(root / "untied", transformers.BertForMaskedLM, 3, tie_word_embeddings=False),
    }


def _batch(vocab: int = HF_VOCAB):
    """Tokens, padding (row i: 3*i padded positions at the end) and token types 0 then 1."""
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(SEQ)
    lengths = torch.tensor([SEQ, SEQ - 3, SEQ - 6])
    padding = (positions[None, :] < lengths[:, None]).long()
    types = (positions[None, :] >= lengths[:, None] // 2).long() * padding
    return torch.randint(0, vocab, (3, SEQ), generator=g), padding, types


def _our_model(save, groups):
    """Our BertModel loaded from ``save`` by the training loader (binary head as the checkpoint holds)."""
    iter_dir, common = convert.find_checkpoint(save)
    saved = convert.dc.read_metadata(iter_dir).state_dict_metadata
    args = dict(common["args"])
    args["padded_vocab_size"] = saved[convert.EMBEDDING_KEY].size[0]
    args["bert_binary_head"] = convert.BINARY_HEAD_KEY in saved
    model = convert.build_model(args, groups, "bert").eval()
    load_checkpoint([model], None, None, CheckpointConfig(load=save, finetune=True), groups)
    return model


def _diffs_body(rank, world_size, cases, vocab=HF_VOCAB):
    """Per (hf_dir, checkpoint): max |ours - HF| of the MLM logits (real vocabulary) and the NSP logits."""
    groups, out = ps.initialize_model_parallel(1, 1), []
    tokens, padding, types = _batch(vocab)
    for hf_dir, save in cases:
        cls = getattr(transformers, convert.read_hf_config(hf_dir)["architectures"][0])
        hf = cls.from_pretrained(hf_dir).eval()
        ours = _our_model(save, groups)
        with torch.no_grad():
            if ours.add_binary_head:
                expected = hf(input_ids=tokens, attention_mask=padding, token_type_ids=types)
                mlm, nsp = expected.prediction_logits, expected.seq_relationship_logits
                logits, binary = ours(tokens, padding, types)
            else:  # no token types in our MLM-only model: Hugging Face's default, all type 0
                mlm, nsp = hf(input_ids=tokens, attention_mask=padding).logits, None
                logits, binary = ours(tokens, padding)
        diffs = {"mlm": (logits[..., : mlm.shape[-1]] - mlm).abs().max().item(), "vocab": logits.shape[-1]}
        if nsp is not None:
            diffs["nsp"] = (binary - nsp).abs().max().item()
        out.append(diffs)
    return out


def test_hf_to_megatron_logits_and_flags(hf_dirs, tmp_path):
    cases = []
    for kind, hf_dir in hf_dirs.items():
        save = str(tmp_path / kind)
        flags = convert.hf_to_megatron(hf_dir, save)
        assert "--bert-post-layernorm" in flags and ("--bert-no-binary-head" in flags) == ("masked_lm" in kind)
        assert ("--untie-embeddings-and-output-weights" in flags) == kind.startswith("untied")
        assert flags[flags.index("--seq-length") + 1] == str(SEQ) and "--openai-gelu" not in flags
        assert flags[flags.index("--norm-epsilon") + 1] == "1e-12"
        cases.append((hf_dir, save))
    results = run_distributed(_diffs_body, 1, cases)[0]
    print(results)
    for (hf_dir, _), diffs in zip(cases, results):
        assert diffs.pop("vocab") == 128
        for name, diff in diffs.items():
            assert diff <= MAX_ABS, f"{hf_dir} {name}: max |logits diff| {diff:.3g}"


def test_tp2_padding(hf_dirs, tmp_path):
    flags = convert.hf_to_megatron(hf_dirs["pretraining"], str(tmp_path / "c"), tp=2)
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == "2"
    iter_dir, _ = convert.find_checkpoint(str(tmp_path / "c"))
    saved = convert.dc.read_metadata(iter_dir).state_dict_metadata
    assert saved[convert.EMBEDDING_KEY].size[0] == 256 and saved["output_layer.bias"].size[0] == 256


def test_round_trip(hf_dirs, tmp_path):
    """BertForPreTraining comes back tensor for tensor; BertForMaskedLM as the same function (type 0 folded)."""
    exported_pairs = []
    for kind, hf_dir in hf_dirs.items():
        cls = "BertForPreTraining" if kind == "pretraining" else "BertForMaskedLM"
        save, out = str(tmp_path / kind), str(tmp_path / (kind + "_out"))
        convert.hf_to_megatron(hf_dir, save)
        assert convert.megatron_to_hf(save, out, "bert") == HF_VOCAB  # padding stripped
        assert convert.read_hf_config(out)["architectures"] == [cls]
        original, exported = convert.read_hf_weights(hf_dir), convert.read_hf_weights(out)
        assert exported.keys() == original.keys()
        assert ("cls.predictions.decoder.weight" in original) == kind.startswith("untied")
        folded = {"bert.embeddings.token_type_embeddings.weight", "bert.embeddings.position_embeddings.weight"}
        if kind.startswith("untied"):  # untied, HF's forward adds the decoder's bias; cls.predictions.bias is unused
            folded.add("cls.predictions.bias")
            assert torch.equal(exported["cls.predictions.bias"], original["cls.predictions.decoder.bias"])
        for name, tensor in original.items():
            if cls == "BertForMaskedLM" and name in folded:
                continue
            assert torch.equal(exported[name], tensor), (kind, name)
        if cls == "BertForMaskedLM":
            types = original["bert.embeddings.token_type_embeddings.weight"]
            assert not exported["bert.embeddings.token_type_embeddings.weight"].any()
            positions = original["bert.embeddings.position_embeddings.weight"] + types[0]
            assert torch.equal(exported["bert.embeddings.position_embeddings.weight"], positions)
        exported_pairs.append((out, save))
    # One spawned rank compares every exported model with its checkpoint.
    for kind, results in zip(hf_dirs, run_distributed(_diffs_body, 1, exported_pairs)[0]):
        assert results["mlm"] <= MAX_ABS and results.get("nsp", 0.0) <= MAX_ABS, (kind, results)


def test_clear_errors(hf_dirs, tmp_path, capsys):
    def error_of(hf_dir):
        assert convert.main(["--direction", "hf-to-megatron", "--hf-dir", hf_dir, "--save", str(tmp_path / "s")]) == 2
        return capsys.readouterr().err

    for field, value in (
        ("hidden_act", "gelu_new"),
        ("position_embedding_type", "relative_key"),
        ("is_decoder", True),
        ("type_vocab_size", 3),
    ):
        bad = tmp_path / field
        shutil.copytree(hf_dirs["pretraining"], bad)
        write_config(str(bad), **{field: value})
        assert f"field {field!r} is {value!r}" in error_of(str(bad)), field
    # A pre-LN BERT checkpoint (pretrain_bert.py without --bert-post-layernorm) is not Hugging Face's layout.
    save = str(tmp_path / "pre_ln")
    convert.hf_to_megatron(hf_dirs["masked_lm"], save)
    common_file = os.path.join(save, "release", convert.COMMON_FILE)
    common = json.loads(open(common_file).read())
    common["args"]["bert_post_layernorm"] = False
    open(common_file, "w").write(json.dumps(common))
    argv = ["--direction", "megatron-to-hf", "--load", save, "--hf-dir-out", str(tmp_path / "o"), "--model-type"]
    assert convert.main(argv + ["bert", "--no-verify-checkpoint"]) == 2
    assert "bert_post_layernorm" in capsys.readouterr().err
    assert convert.main(argv + ["gpt2", "--no-verify-checkpoint"]) == 2  # the wrong family is named, not a failed load
    assert "is a BERT checkpoint" in capsys.readouterr().err


# ---------------------------------------------------------------- end to end with pretrain_bert.py
_MODEL_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--max-position-embeddings")
_MODEL_FLAGS += ("--hidden-dropout", "--attention-dropout", "--make-vocab-size-divisible-by")


def _trained_body(rank, world_size, save, out_dir, original_dir, vocab):
    """(max |HF(exported) - ours(trained)|, max |HF(exported) - HF(original)|) of the MLM logits."""
    groups = ps.initialize_model_parallel(1, 1)
    tokens, padding, types = _batch(vocab)
    exported = transformers.BertForPreTraining.from_pretrained(out_dir).eval()
    original = transformers.BertForPreTraining.from_pretrained(original_dir).eval()
    ours = _our_model(save, groups)
    with torch.no_grad():
        got = exported(input_ids=tokens, attention_mask=padding, token_type_ids=types)
        before = original(input_ids=tokens, attention_mask=padding, token_type_ids=types).prediction_logits
        logits, binary = ours(tokens, padding, types)
    assert torch.isfinite(got.prediction_logits).all()
    mlm = (logits[..., :vocab] - got.prediction_logits).abs().max().item()
    nsp = (binary - got.seq_relationship_logits).abs().max().item()
    return max(mlm, nsp), (got.prediction_logits - before).abs().max().item()


@pytest.mark.full  # default siblings: test_checkpoint_convert_t5.py::test_convert_train_export[tp2] (the same
# convert.py script -> printed flags -> entry point -> export path) and the BERT tests above (its loaded model)
def test_convert_train_export(tmp_path):
    """HF -> release checkpoint -> pretrain_bert.py (printed flags, 2 iterations, --finetune) -> HF."""
    vocab_file = make_tokenizer_files(str(tmp_path / "tok"))["BertWordPieceLowerCase"]["vocab_file"]
    vocab = sum(1 for _ in open(vocab_file))
    hf_dir = _save(tmp_path / "hf", transformers.BertForPreTraining, 2, vocab=vocab, max_position_embeddings=32)
    shutil.copy(vocab_file, os.path.join(hf_dir, "vocab.txt"))  # the converter prints --vocab-file for it
    converted, trained, out = (str(tmp_path / n) for n in ("converted", "trained", "out"))
    stdout, printed = convert_to_megatron(hf_dir, converted)
    assert "pretrain_bert.py" in stdout and "--bert-post-layernorm" in printed and "--vocab-file" in printed
    training = with_flags(tiny_gpt_flags(2), {**dict.fromkeys(_MODEL_FLAGS), "--lr-warmup-iters": "1"})
    training += ["--mock-data", "--save", trained, "--save-interval", "2", "--no-save-optim", "--no-save-rng"]
    result = run_gpt(1, training + printed, cwd=str(tmp_path), script=[os.path.join(REPO, "pretrain_bert.py")])
    assert_ok(result, "pretrain_bert.py from the converted checkpoint")
    assert len(result.lines) == 2
    argv = ["--direction", "megatron-to-hf", "--load", trained, "--hf-dir-out", out, "--model-type", "bert"]
    assert convert.main(argv) == 0
    assert convert.read_hf_config(out)["vocab_size"] == vocab
    same, moved = run_distributed(_trained_body, 1, trained, out, hf_dir, vocab)[0]
    original, exported = convert.read_hf_weights(hf_dir), convert.read_hf_weights(out)
    assert exported.keys() == original.keys()
    step = max((exported[k] - original[k]).abs().max().item() for k in original)
    print({"exported_vs_trained": same, "exported_vs_original": moved, "max_weight_step": step})
    # Training started from the converted weights: 2 Adam steps of lr <= 3e-3 move no weight far (a fresh
    # initialisation would differ by O(STD)), yet every exported weight came through training.
    assert 0 < step < 0.02, step
    assert same <= MAX_ABS, f"exported vs trained checkpoint: max |logits diff| {same:.3g}"
    assert moved > MAX_ABS, "training did not change the model"
