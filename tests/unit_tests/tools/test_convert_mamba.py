"""Mamba2 and Nemotron-H (with a MoE layer) through tools/checkpoint/convert.py: HF -> ours -> HF.

Tiny random ``transformers`` models (nothing downloaded) are converted in and out; the exported model
holds exactly the original tensors and gives the original logits, and the printed flags are
``pretrain_mamba.py``'s and pass its validation. (Logits of our model against HF's: test_mamba_models.py.)
"""

import torch

from megatron.training.arguments import parse_args, validate_args
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
