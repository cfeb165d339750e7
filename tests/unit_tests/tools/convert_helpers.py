"""Helpers the converter tests share: editing a saved ``config.json`` and running ``convert.py`` as a script."""

import json
import os
import subprocess
import sys
from typing import List, Tuple

from tests.functional_tests.gpt_runs import REPO

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
    """``convert.py --direction hf-to-megatron`` in a subprocess: (stdout, the printed training flags)."""
    cmd = [sys.executable, CONVERT, "--direction", "hf-to-megatron", "--hf-dir", hf_dir, "--save", save]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, proc.stdout.splitlines()[-1].split()
