"""Mamba2 and Nemotron-H (with a MoE layer) through tools/checkpoint/convert.py: HF -> ours -> HF.

Tiny random ``transformers`` models (nothing downloaded) are converted in and out; the exported model
holds exactly the original tensors and gives the original logits, and the printed flags are
``pretrain_mamba.py``'s and pass its validation (logits of our model against HF's: test_mamba_models.py). Full tier: a
Nemotron-H with a MoE layer through 2 ``pretrain_mamba.py`` steps exports and loads back cleanly.
"""

import os

import pytest
import torch

from megatron.training.arguments import parse_args, validate_args
from tests.functional_tests.gpt_runs import REPO, assert_ok, run_gpt, tiny_gpt_flags
from tests.unit_tests.ssm.hf_mamba import hf_mamba2, hf_nemotron_h, perturb
from tools.checkpoint import convert


def _round_trip(hf, kind, tmp_path):
    perturb(hf)
    hf.save_pretrained(tmp_path / "in")
    flags = convert.hf_to_megatron(str(tmp_path / "in"), str(tmp_path / "ckpt"), divisible_by=1)
    convert.megatron_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"), kind)
    back = type(hf).from_pretrained(tmp_path / "out").eval()
    assert set(back.state_dict()) == set(hf.state_dict())
    for name, tensor in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    ids = torch.randint(0, hf.config.vocab_size, (1, 24))
    with torch.no_grad():
        # The same tensors; only HF's scan chunk (not a weight) differs, so the sums' order does.
        torch.testing.assert_close(back(ids, use_cache=False).logits, hf(ids, use_cache=False).logits)
    return flags


def test_mamba2_and_nemotron_h_round_trip(tmp_path):
    assert convert._script_of(_round_trip(hf_mamba2(2), "mamba2", tmp_path / "m")) == "pretrain_mamba.py"
    flags = _round_trip(hf_nemotron_h("M*E-"), "nemotron_h", tmp_path / "n")  # with a MoE layer
    assert flags[flags.index("--hybrid-override-pattern") + 1] == "M*E-"
    run = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "63", "--seq-length", "16"]
    run += ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]
    validate_args(parse_args(flags + run, entry_point="mamba"), world_size=1)


@pytest.mark.full
def test_nemotron_h_convert_train_export(tmp_path):
    """HF -> ours -> 2 ``pretrain_mamba.py`` steps -> HF: ``from_pretrained`` loads the trained export with no
    missing, unexpected or mismatched keys, and training changed its weights (full tier; the default tier's round
    trip above checks the mapping tensor by tensor)."""
    hf_in, first, trained, hf_out = (str(tmp_path / n) for n in ("in", "first", "trained", "out"))
    hf = hf_nemotron_h("M*E-")
    perturb(hf)
    hf.save_pretrained(hf_in)
    flags = convert.hf_to_megatron(hf_in, first, divisible_by=1)
    train = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "63", "--no-save-optim"]
    train += ["--no-save-rng", "--lr-warmup-iters", "1", "--save-interval", "2"]
    run = tiny_gpt_flags(2) + flags + train + ["--load", first, "--finetune", "--save", trained]
    assert_ok(run_gpt(1, run, cwd=str(tmp_path), script=[os.path.join(REPO, "pretrain_mamba.py")]), "pretrain_mamba")
    convert.megatron_to_hf(trained, hf_out, "nemotron_h", vocab_size=hf.config.vocab_size)
    back, info = type(hf).from_pretrained(hf_out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    before, after = convert.read_hf_weights(hf_in), convert.read_hf_weights(hf_out)
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "training changed nothing"
