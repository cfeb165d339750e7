"""``tools/checkpoint/convert.py`` refuses wrong weights and configs with one line naming the file and the
tensor, field or flag, and exit status 2; across the families the shared checker serves (GPT-2, Llama, BERT,
T5). Each probe edits a small ``save_pretrained`` directory as a careless or hostile user would.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megatron.core.dist_checkpointing.checksums import file_digest
from megatron.core.dist_checkpointing.safe_metadata import load_metadata_file
from tests.unit_tests.tools.convert_helpers import CONVERT, write_config
from tools.checkpoint import checks, convert

WEIGHTS = "model.safetensors"


def _gpt2(path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_positions=8, n_embd=32, n_layer=2, n_head=4)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


def _llama(path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def _bert(path):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=8,
        architectures=["BertForMaskedLM"],
    )
    transformers.BertForMaskedLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"gpt2": _gpt2(root / "gpt2"), "llama": _llama(root / "llama"), "bert": _bert(root / "bert")}


def _copy(saved, kind, tmp_path):
    return shutil.copytree(saved[kind], tmp_path / kind)


def _edit_weights(hf_dir, edit):
    path = os.path.join(hf_dir, WEIGHTS)
    sd = dict(load_file(path))
    edit(sd)
    save_file(sd, path, metadata={"format": "pt"})


def _convert_error(hf_dir, tmp_path, capsys, *extra):
    rc = convert.main(["--direction", "hf-to-megatron", "--hf-dir", str(hf_dir), "--save", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1, err
    return err


# --- weights: dtype, values, names, shapes ------------------------------------------------------------------
def test_integer_tensor_is_refused_not_zeroed(saved, tmp_path, capsys):
    hf_dir = _copy(saved, "gpt2", tmp_path)
    _edit_weights(
        hf_dir, lambda sd: sd.update({"transformer.h.0.mlp.c_fc.weight": torch.ones(32, 128, dtype=torch.int8)})
    )
    err = _convert_error(hf_dir, tmp_path, capsys)
    assert "'transformer.h.0.mlp.c_fc.weight' is int8; weights must be one of float32, float16, bfloat16" in err


@pytest.mark.parametrize("kind, name", [("gpt2", "transformer.h.1.attn.c_proj.weight"), ("llama", "model.norm.weight")])
def test_nonfinite_values_refused_unless_allowed(saved, tmp_path, capsys, kind, name):
    hf_dir = _copy(saved, kind, tmp_path)

    def poison(sd):
        sd[name] = sd[name].clone()
        sd[name].view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])

    _edit_weights(hf_dir, poison)
    assert f"tensor {name!r} has 3 NaN or infinite values" in _convert_error(hf_dir, tmp_path, capsys)
    argv = ["--direction", "hf-to-megatron", "--hf-dir", str(hf_dir), "--save", str(tmp_path / "ok")]
    assert convert.main(argv + ["--allow-nonfinite"]) == 0


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("llama", "model.layers.2.input_layernorm.weight"),  # a layer beyond num_hidden_layers
        ("gpt2", "transformer.h.2.ln_1.weight"),
        ("bert", "bert.encoder.layer.2.output.dense.bias"),
    ],
)
def test_tensor_the_config_has_no_place_for_is_named(saved, tmp_path, capsys, kind, extra):
    hf_dir = _copy(saved, kind, tmp_path)
    _edit_weights(hf_dir, lambda sd: sd.update({extra: torch.zeros(32)}))
    assert f"1 tensors the config has no place for: {extra}" in _convert_error(hf_dir, tmp_path, capsys)


def test_missing_tensor_is_named(saved, tmp_path, capsys):
    hf_dir = _copy(saved, "llama", tmp_path)
    _edit_weights(hf_dir, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    assert "weight 'model.layers.1.mlp.up_proj.weight' is missing" in _convert_error(hf_dir, tmp_path, capsys)


@pytest.mark.parametrize(
    "kind, name, shape",
    [
        ("gpt2", "transformer.h.0.mlp.c_fc.weight", (32, 100)),
        ("llama", "model.layers.0.self_attn.k_proj.weight", (32, 32)),
    ],
)
def test_wrong_shape_names_tensor_and_both_shapes(saved, tmp_path, capsys, kind, name, shape):
    hf_dir = _copy(saved, kind, tmp_path)
    right = tuple(load_file(os.path.join(hf_dir, WEIGHTS))[name].shape)
    _edit_weights(hf_dir, lambda sd: sd.update({name: torch.zeros(shape)}))
    assert f"tensor {name!r} has shape {shape}; the config needs {right}" in _convert_error(hf_dir, tmp_path, capsys)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/tmp/outside.safetensors"])
def test_shard_outside_the_model_directory_is_refused(saved, tmp_path, capsys, name):
    hf_dir = _copy(saved, "gpt2", tmp_path)
    os.rename(os.path.join(hf_dir, WEIGHTS), tmp_path / "outside.safetensors")
    index = {"metadata": {}, "weight_map": {"transformer.wte.weight": name}}
    with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    assert f"shard file {name!r} is outside the model directory" in _convert_error(hf_dir, tmp_path, capsys)


def test_truncated_weights_file_is_named(saved, tmp_path, capsys):
    hf_dir = _copy(saved, "gpt2", tmp_path)
    path = os.path.join(hf_dir, WEIGHTS)
    os.truncate(path, os.path.getsize(path) // 2)
    assert f"cannot read {path}: " in _convert_error(hf_dir, tmp_path, capsys)


# --- config.json: types, ranges, heads, memory, for every family -------------------------------------------
@pytest.mark.parametrize(
    "kind, field", [("gpt2", "n_layer"), ("llama", "num_hidden_layers"), ("bert", "num_hidden_layers"), ("t5", "d_ff")]
)
def test_config_field_of_the_wrong_type_is_named(saved, tmp_path, capsys, kind, field):
    if kind == "t5":
        hf_dir = tmp_path / "t5"
        hf_dir.mkdir()
        config = transformers.T5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False).to_dict()
        (hf_dir / "config.json").write_text(json.dumps({**config, "architectures": ["T5ForConditionalGeneration"]}))
    else:
        hf_dir = _copy(saved, kind, tmp_path)
    write_config(str(hf_dir), **{field: "2"})
    assert f"field {field!r} is '2'; it must be an integer >= 1" in _convert_error(hf_dir, tmp_path, capsys)


@pytest.mark.parametrize(
    "kind, changes",
    [
        ("gpt2", {"n_head": 5}),
        ("llama", {"num_attention_heads": 5, "num_key_value_heads": 5}),
        ("bert", {"num_attention_heads": 5}),
    ],
)
def test_head_count_must_divide_hidden_size(saved, tmp_path, capsys, kind, changes):
    hf_dir = _copy(saved, kind, tmp_path)
    write_config(str(hf_dir), drop=("head_dim",), **changes)  # a given head_dim need not divide the hidden size
    assert "hidden size 32 is not a multiple of the 5 attention heads" in _convert_error(hf_dir, tmp_path, capsys)


def test_query_groups_must_divide_heads(saved, tmp_path, capsys):
    hf_dir = _copy(saved, "llama", tmp_path)
    write_config(str(hf_dir), num_key_value_heads=3)
    assert "4 attention heads are not a multiple of 3 query groups" in _convert_error(hf_dir, tmp_path, capsys)


def test_vocabulary_too_big_for_memory_is_refused_before_allocating(saved, tmp_path, capsys):
    hf_dir = _copy(saved, "gpt2", tmp_path)
    write_config(str(hf_dir), vocab_size=10**12)
    err = _convert_error(hf_dir, tmp_path, capsys)
    assert "needs about" in err and "GiB for its float32 weights" in err
    # The rule itself, against an independent count: GPT-2 small has 124,439,808 parameters.
    args = dict(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072, padded_vocab_size=50257)
    args.update(position_embedding_type="learned_absolute", max_position_embeddings=1024)
    assert abs(checks.parameter_estimate(args) - 124_439_808) / 124_439_808 < 0.01
    checks.check_memory(args, "x", available=4 * 124_439_808 * 2)
    with pytest.raises(convert.ConversionError, match="needs about 0.5 GiB"):
        checks.check_memory(args, "x", available=4 * 124_439_808 // 2)


# --- the export direction ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(saved, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("ckpt") / "gpt2")
    assert convert.main(["--direction", "hf-to-megatron", "--hf-dir", saved["gpt2"], "--save", save]) == 0
    return save


def _export_error(load, tmp_path, capsys, *extra):
    argv = [
        "--direction",
        "megatron-to-hf",
        "--load",
        load,
        "--hf-dir-out",
        str(tmp_path / "o"),
        "--model-type",
        "gpt2",
    ]
    rc = convert.main(argv + list(extra))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_export_refuses_a_bytes_entry_as_the_resume_path_does(converted, tmp_path, capsys):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    load = shutil.copytree(converted, tmp_path / "ckpt")
    iter_dir = os.path.join(load, "release")
    path = os.path.join(iter_dir, ".metadata")
    metadata = load_metadata_file(path)
    metadata.state_dict_metadata[convert.EMBEDDING_KEY] = BytesStorageMetadata()
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    info_path = os.path.join(iter_dir, "metadata.json")  # checksums rewritten to match, as an attacker would
    with open(info_path) as f:
        info = json.load(f)
    info["checksums"]["files"][".metadata"] = {"bytes": os.path.getsize(path), "sha256": file_digest(path)}
    with open(info_path, "w") as f:
        json.dump(info, f)
    err = _export_error(str(load), tmp_path, capsys)
    assert f"key {convert.EMBEDDING_KEY!r} in {iter_dir} is not a tensor" in err


@pytest.mark.parametrize("field, value", [("num_layers", "2"), ("hidden_dropout", 2.0), ("kv_channels", 0)])
def test_export_refuses_crafted_model_flags(converted, tmp_path, capsys, field, value):
    load = shutil.copytree(converted, tmp_path / "ckpt")
    common_path = os.path.join(load, "release", "common.json")
    with open(common_path) as f:
        common = json.load(f)
    common["args"][field] = value
    with open(common_path, "w") as f:
        json.dump(common, f)
    err = _export_error(str(load), tmp_path, capsys, "--no-verify-checkpoint")
    assert f"flag {field} is {value!r}" in err


def test_script_exits_2_with_one_line_and_no_traceback(saved, tmp_path):
    hf_dir = _copy(saved, "gpt2", tmp_path)
    write_config(str(hf_dir), n_layer="2")
    cmd = [
        sys.executable,
        CONVERT,
        "--direction",
        "hf-to-megatron",
        "--hf-dir",
        str(hf_dir),
        "--save",
        str(tmp_path / "s"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {hf_dir}/config.json: field 'n_layer' is '2'; it must be an integer >= 1"
    ]
