"""Helpers the converter tests share: editing a saved ``config.json`` and running ``convert.py`` as a script."""

import json
import os
from typing import List, Tuple

from tests.entry_launcher import launch
from tests.functional_tests.gpt_runs import REPO, RUN_TIMEOUT_S, free_port

CONVERT = os.path.join(REPO, "tools", "checkpoint", "convert.py")


def write_config(path: str, drop: Tuple[str, ...] = (), **changes) -> None:
    """Set ``changes`` (and remove the ``drop`` fields) in ``path/config.json``."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    for field in drop:
        config.pop(field, None)
    with open(file, "w") as f:
        json.dump(config, f)


def convert_to_megatron(hf_dir: str, save: str) -> Tuple[str, List[str]]:
    """``convert.py --direction hf-to-megatron`` run as a script, as ``python convert.py`` runs it (by the
    tests' entry-point launcher, which skips the interpreter's and torch's start-up): (stdout, the printed
    training flags)."""
    argv = [CONVERT, "--direction", "hf-to-megatron", "--hf-dir", hf_dir, "--save", save]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    code, stdout, stderr = launch(1, argv, os.path.dirname(save), env, free_port(), RUN_TIMEOUT_S)
    assert code == 0, stderr
    return stdout, stdout.splitlines()[-1].split()
