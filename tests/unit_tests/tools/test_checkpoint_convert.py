"""tools/checkpoint/convert.py: HF <-> torch_dist checkpoints give the same logits (random weights, offline).

Expected logits come from the Hugging Face implementation; ours are loaded through the
training loader (``load_checkpoint`` with ``--finetune``) under TP=1 and TP=2.
"""

import os
import subprocess
import sys

import pytest
import torch
import transformers  # a test dependency (requirements-test.txt): missing it must fail, not skip

from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.training.checkpointing import CheckpointConfig, load_checkpoint
from tests.dist_harness import run_distributed
from tests.functional_tests.gpt_runs import REPO, assert_ok, mock_flags, run_gpt, tiny_gpt_flags
from tools.checkpoint import convert
from tools.checkpoint.hf_config import gpt_model_kwargs

MAX_ABS = 1e-4
HF_VOCAB = 100  # pads to 128 (TP=1) or 256 (TP=2) with the default --make-vocab-size-divisible-by 128


def _save_llama(path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=HF_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=16,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def _save_gpt2(path):
    torch.manual_seed(1)
    config = transformers.GPT2Config(
        vocab_size=HF_VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new"
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"llama": _save_llama(root / "llama"), "gpt2": _save_gpt2(root / "gpt2")}


def _our_logits(save, tokens, groups):
    """Logits of our model (on this rank's TP group) loaded from ``save`` by the training loader."""
    iter_dir, common = convert.find_checkpoint(save)
    args = dict(common["args"])
    tp = groups.size_of("tp")
    args["padded_vocab_size"] = convert.dc.read_metadata(iter_dir).state_dict_metadata[convert.EMBEDDING_KEY].size[0]
    model = GPTModel(
        pg_collection=groups,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        parallel_output=False,
        **gpt_model_kwargs(args),
    ).eval()
    load_checkpoint([model], None, None, CheckpointConfig(load=save, finetune=True), groups)
    with torch.no_grad():
        return model(tokens)


def _compare_body(rank, world_size, cases):
    """Max |ours - HF| over the real vocabulary, per case (hf_dir, checkpoint)."""
    diffs, groups = [], ps.initialize_model_parallel(world_size, 1)
    for hf_dir, save in cases:
        tokens = torch.randint(0, HF_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        with torch.no_grad():
            expected = hf(tokens).logits
        ours = _our_logits(save, tokens, groups)
        assert ours.shape[-1] >= expected.shape[-1]
        diffs.append((ours[..., : expected.shape[-1]] - expected).abs().max().item())
    return diffs


@pytest.mark.parametrize("tp", [1, 2])
def test_hf_to_megatron_logits(hf_dirs, tmp_path, tp):
    cases = []
    for kind, hf_dir in hf_dirs.items():
        save = str(tmp_path / kind)
        flags = convert.hf_to_megatron(hf_dir, save, tp=tp)
        assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "release"
        assert ("--swiglu" in flags) == (kind == "llama") and ("--openai-gelu" in flags) == (kind == "gpt2")
        cases.append((hf_dir, save))
    for (hf_dir, _), diff in zip(cases, run_distributed(_compare_body, tp, cases)[0]):
        assert diff <= MAX_ABS, f"{hf_dir} TP={tp}: max |logits diff| {diff:.3g}"


def _read_checkpoint(save):
    with convert.single_process_group() as groups:
        return convert.load_megatron(save, groups)[0]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_round_trip_is_exact(hf_dirs, tmp_path, kind):
    first, hf_out, second = (str(tmp_path / n) for n in ("first", "hf_out", "second"))
    convert.hf_to_megatron(hf_dirs[kind], first)
    assert convert.megatron_to_hf(first, hf_out, kind) == HF_VOCAB  # padding stripped
    original, exported = convert.read_hf_weights(hf_dirs[kind]), convert.read_hf_weights(hf_out)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    convert.hf_to_megatron(hf_out, second)
    a, b = _read_checkpoint(first), _read_checkpoint(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.full  # default sibling: test_checkpoint_convert_t5.py::test_convert_train_export[tp2] runs
# convert.py as a script and trains with the flags it prints; GPT-2's printed flags in test_hf_to_megatron_logits
def test_cli_as_script(hf_dirs, tmp_path):
    cmd = [
        sys.executable,
        os.path.join(REPO, "tools", "checkpoint", "convert.py"),
        "--direction",
        "hf-to-megatron",
        "--hf-dir",
        hf_dirs["gpt2"],
        "--save",
        str(tmp_path / "ckpt"),
    ]
    # A fresh interpreter imports torch and transformers: slow on loaded cores (the limit detects a hang only).
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "--make-vocab-size-divisible-by 128" in proc.stdout and "--openai-gelu" in proc.stdout


def test_clear_errors(hf_dirs, tmp_path, capsys):
    def error_of(*argv):
        assert convert.main(list(argv)) == 2
        return capsys.readouterr().err

    assert "not found" in error_of(
        "--direction", "hf-to-megatron", "--hf-dir", str(tmp_path / "nope"), "--save", str(tmp_path / "s")
    )
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text('{"architectures": ["BartForConditionalGeneration"]}')
    assert "'architectures'" in error_of(
        "--direction", "hf-to-megatron", "--hf-dir", str(bert), "--save", str(tmp_path / "s")
    )
    assert "not a Megatron checkpoint" in error_of(
        "--direction",
        "megatron-to-hf",
        "--load",
        hf_dirs["gpt2"],
        "--hf-dir-out",
        str(tmp_path / "o"),
        "--model-type",
        "gpt2",
    )
    assert "needs --model-type" in error_of(
        "--direction", "megatron-to-hf", "--load", str(tmp_path), "--hf-dir-out", str(tmp_path / "o")
    )


LLAMA_FLAGS = [
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--ffn-hidden-size",
    "64",
    "--rotary-base",
    "500000",
    "--no-save-optim",
    "--no-save-rng",
    "--lr-warmup-iters",
    "1",
]  # 2 iterations: warmup must be shorter than the decay


def _trained_body(rank, world_size, save, hf_dir):
    tokens = torch.randint(0, 601, (2, 32), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        expected = hf(tokens).logits
    return (_our_logits(save, tokens, ps.initialize_model_parallel(1, 1)) - expected).abs().max().item()


def test_trained_checkpoint_to_hf(tmp_path):
    save, hf_dir = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    flags = tiny_gpt_flags(2) + mock_flags() + LLAMA_FLAGS + ["--save", save, "--save-interval", "2"]
    assert_ok(run_gpt(1, flags, cwd=str(tmp_path)), "pretrain_gpt.py")
    assert convert.megatron_to_hf(save, hf_dir, "llama") == 1024  # NullTokenizer: no converter record, kept
    diff = run_distributed(_trained_body, 1, save, hf_dir)[0]
    assert diff <= MAX_ABS, f"trained checkpoint: max |logits diff| {diff:.3g}"


def test_gpt2_export_keeps_bos_and_eos_inside_the_vocabulary(tmp_path):
    from tools.checkpoint.hf_config import gpt2_end_of_text_id

    vocab = tmp_path / "vocab.json"
    vocab.write_text('{"a": 0, "<|endoftext|>": 7999, "b": 1}')  # a trained 8000-token vocabulary
    assert gpt2_end_of_text_id({"vocab_file": str(vocab)}, 8000) == 7999
    assert gpt2_end_of_text_id({"vocab_file": str(tmp_path / "gone.json")}, 50304) == 50256  # GPT-2's own
    assert gpt2_end_of_text_id({}, 1024) is None  # never an id outside the exported vocabulary
