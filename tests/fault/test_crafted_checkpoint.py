"""A crafted ``.metadata`` that runs a command when unpickled is refused on every load path.

The payload is live: plain ``pickle.loads`` (what torch's ``FileSystemReader`` does) creates
the marker file, which the test checks first, so the refusals below prove something.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import CheckpointingError, ShardedTensor
from megatron.core.dist_checkpointing.checksums import file_digest
from megatron.core.dist_checkpointing.safe_metadata import load_metadata_file
from tests.functional_tests.gpt_runs import mock_flags, run_gpt, tiny_gpt_flags
from tools.checkpoint import convert


class _Payload:
    """Unpickles into ``os.system("touch <marker>")``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(iter_dir: str, marker: str) -> None:
    """Replace the checkpoint's ``.metadata`` by the payload, as an attacker would: the size and
    SHA-256 recorded in ``metadata.json`` are rewritten to match, so only the unpickler stands
    between the file and the command."""
    path = os.path.join(iter_dir, ".metadata")
    with open(path, "wb") as f:
        pickle.dump(_Payload(marker), f)
    info_path = os.path.join(iter_dir, "metadata.json")
    with open(info_path) as f:
        info = json.load(f)
    info["checksums"]["files"][".metadata"] = {"bytes": os.path.getsize(path), "sha256": file_digest(path)}
    with open(info_path, "w") as f:
        json.dump(info, f)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real 4-iteration torch_dist checkpoint of the tiny GPT."""
    root = tmp_path_factory.mktemp("crafted")
    save = str(root / "ckpt")
    result = run_gpt(1, [*tiny_gpt_flags(4), *mock_flags(), "--save", save, "--save-interval", "4"], str(root))
    assert result.returncode == 0, result.output[-3000:]
    return save, os.path.join(save, "iter_0000004")


def test_payload_is_live(tmp_path):
    marker = tmp_path / "pwned"
    code = "import pickle,sys; pickle.load(open(sys.argv[1], 'rb'))"
    path = tmp_path / "payload"
    with open(path, "wb") as f:
        pickle.dump(_Payload(str(marker)), f)
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=60)
    assert marker.exists()


def _crafted_copy(trained, tmp_path, marker: str):
    """A copy of the trained checkpoint whose ``.metadata`` is the payload; returns (save, iter_dir)."""
    save = str(tmp_path / "ckpt")
    shutil.copytree(trained[0], save)
    iter_dir = os.path.join(save, os.path.basename(trained[1]))
    _plant(iter_dir, marker)
    return save, iter_dir


def test_refused_by_reader_and_api(trained, tmp_path):
    real = load_metadata_file(os.path.join(trained[1], ".metadata"))  # the genuine file reads fine
    key = next(iter(real.state_dict_metadata))
    size = tuple(real.state_dict_metadata[key].size)
    marker = tmp_path / "pwned_api"
    _, iter_dir = _crafted_copy(trained, tmp_path, str(marker))
    with pytest.raises(CheckpointingError, match=r"\.metadata.*refusing to load posix\.system"):
        dc.read_metadata(iter_dir)
    with pytest.raises(CheckpointingError, match=r"\.metadata"):
        dc.load({key: ShardedTensor.from_global(key, torch.zeros(size), size, (0,) * len(size))}, iter_dir)
    assert not marker.exists()


def test_refused_by_training_resume_and_converter(trained, tmp_path, capsys):
    marker = tmp_path / "pwned_cli"
    save, _ = _crafted_copy(trained, tmp_path, str(marker))
    resumed = run_gpt(1, [*tiny_gpt_flags(6), *mock_flags(), "--load", save], str(tmp_path))
    assert resumed.returncode != 0
    assert "refusing to load posix.system" in resumed.output and ".metadata" in resumed.output
    code, output = _convert_to_hf(save, tmp_path, capsys)
    assert code != 0, output
    assert "refusing to load posix.system" in output
    assert not marker.exists()


def _convert_to_hf(save: str, tmp_path, capsys, *extra: str):
    """``tools/checkpoint/convert.py --direction megatron-to-hf`` on ``save`` (its ``main``, in this process: the
    same code without another interpreter's start-up); (exit status, what it printed)."""
    argv = ["--direction", "megatron-to-hf", "--load", save, "--hf-dir-out", str(tmp_path / "hf")]
    capsys.readouterr()
    code = convert.main([*argv, "--model-type", "gpt2", *extra])
    out, err = capsys.readouterr()
    return code, out + err


def test_structure_checked_after_unpickling(tmp_path):
    path = tmp_path / ".metadata"
    with open(path, "wb") as f:
        pickle.dump({"not": "metadata"}, f)
    with pytest.raises(CheckpointingError, match="not DCP Metadata"):
        load_metadata_file(str(path))


def test_a_pickle_may_not_modify_an_allowed_class(tmp_path):
    # GLOBAL pathlib.PurePosixPath; slot state {'__repr__': torch.Size}; BUILD on the class itself.
    path = tmp_path / ".metadata"
    path.write_bytes(b"cpathlib\nPurePosixPath\nN}(X\x08\x00\x00\x00__repr__ctorch\nSize\nu\x86b.")
    with pytest.raises(CheckpointingError, match="modifies the class PurePosixPath"):
        load_metadata_file(str(path))
    assert repr(pathlib.PurePosixPath("/a")) == "PurePosixPath('/a')"  # undone, not just refused


# GLOBAL torch.serialization._get_layout (the one allowed function), then BUILD on it with slot
# state {'__defaults__': ('torch.sparse_coo',)}, or with dict state {'note': 1} (its __dict__).
_FUNCTION_GLOBAL = b"ctorch.serialization\n_get_layout\n"
_SET_DEFAULTS = _FUNCTION_GLOBAL + b"N}(X\x0c\x00\x00\x00__defaults__(X\x10\x00\x00\x00torch.sparse_cootu\x86b."
_SET_DICT = _FUNCTION_GLOBAL + b"}(X\x04\x00\x00\x00noteK\x01ub."


@pytest.mark.parametrize("payload", [_SET_DEFAULTS, _SET_DICT], ids=["__defaults__", "__dict__"])
def test_a_pickle_may_not_modify_an_allowed_function(tmp_path, payload):
    from megatron.core.dist_checkpointing.safe_metadata import _RestrictedUnpickler

    function = _RestrictedUnpickler._ALLOWED[("torch.serialization", "_get_layout")]
    defaults, attrs = function.__defaults__, dict(vars(function))
    path = tmp_path / ".metadata"
    path.write_bytes(payload)
    with pytest.raises(CheckpointingError, match="modifies the function _get_layout"):
        load_metadata_file(str(path))
    assert function.__defaults__ is defaults and vars(function) == attrs  # undone, not just refused
    # The payload is live: the same bytes through the same unpickler without the guard change it.
    try:
        _RestrictedUnpickler(io.BytesIO(payload)).load()
        assert function.__defaults__ is not defaults or vars(function) != attrs
    finally:
        function.__defaults__ = defaults
        vars(function).clear()
        vars(function).update(attrs)


def test_crafted_legacy_file_refused_on_resume(tmp_path):
    save = str(tmp_path / "ckpt")
    flags = [*tiny_gpt_flags(4), *mock_flags(), "--ckpt-format", "torch"]
    assert run_gpt(1, [*flags, "--save", save, "--save-interval", "4"], str(tmp_path)).returncode == 0
    iter_dir = os.path.join(save, "iter_0000004")
    relative = "mp_rank_00/model_optim_rng.pt"
    marker = tmp_path / "pwned_legacy"
    torch.save({"model": _Payload(str(marker))}, os.path.join(iter_dir, relative))
    table_path = os.path.join(iter_dir, "checksums.json")
    with open(table_path) as f:
        table = json.load(f)
    full = os.path.join(iter_dir, relative)
    table["files"][relative] = {"bytes": os.path.getsize(full), "sha256": file_digest(full)}
    with open(table_path, "w") as f:
        json.dump(table, f)
    resumed = run_gpt(1, [*tiny_gpt_flags(6), *mock_flags(), "--ckpt-format", "torch", "--load", save], str(tmp_path))
    assert resumed.returncode != 0 and "Weights only load failed" in resumed.output, resumed.output[-3000:]
    assert not marker.exists()


def test_converter_checks_checksums_unless_told_not_to(trained, tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    shutil.copytree(trained[0], save)
    common = os.path.join(save, os.path.basename(trained[1]), "common.json")
    with open(common, "a") as f:
        f.write(" ")  # still valid JSON, no longer the recorded bytes
    code, output = _convert_to_hf(save, tmp_path, capsys)
    assert code == 2 and "common.json" in output, output
    code, output = _convert_to_hf(save, tmp_path, capsys, "--no-verify-checkpoint")
    assert code == 0, output


def test_crafted_fsdp2_checkpoint_refused_on_resume(tmp_path):
    """A checkpoint saved under --use-torch-fsdp2 (2 ranks), its .metadata replaced by the payload: the FSDP2
    resume (which reads whole tensors and copies each rank's rows) refuses it before unpickling anything."""
    fsdp2 = ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion", "--untie-embeddings-and-output-weights"]
    save = str(tmp_path / "ckpt")
    save_flags = ["--save", save, "--save-interval", "2", "--exit-interval", "2"]
    saved = run_gpt(2, [*tiny_gpt_flags(4), *mock_flags(), *fsdp2, *save_flags], str(tmp_path))
    assert saved.returncode == 0, saved.output[-3000:]
    marker = tmp_path / "pwned_fsdp2"
    _plant(os.path.join(save, "iter_0000002"), str(marker))
    resumed = run_gpt(2, [*tiny_gpt_flags(4), *mock_flags(), *fsdp2, "--load", save], str(tmp_path))
    assert resumed.returncode != 0
    assert "refusing to load posix.system" in resumed.output and ".metadata" in resumed.output
    assert not marker.exists()
