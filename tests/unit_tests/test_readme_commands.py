"""The README's shell commands cannot drift from the code: each is checked here or run by a named test.

Every ```bash block of README.md is split into commands (``\\`` continuations joined). Each command's
program (the script it runs, or the tool) must be in ``COVERED``: either checked here (its
``pretrain_gpt.py`` / server flags parse and pass validation for the world size it launches, the files
it names exist) or run by a test file that exists and names it. A README command with a program
nobody covers fails ``test_every_readme_command_is_covered``. Nothing here launches a run: fast.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Dict, List, Optional, Tuple

import pytest

from megatron.training.arguments import parse_args, validate_args
from tools.plan_parallelism import hf_config_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ACTIVATE = ". .venv/bin/activate"
SERVER = "tools/run_text_generation_server.py"
FLAGS_CHECKED_HERE = ("pretrain_gpt.py", SERVER)
# program -> the test file that runs it (that file must exist and mention the program).
COVERED: Dict[str, Optional[str]] = {
    "examples/quickstart.sh": "tests/functional_tests/test_example_scripts.py",
    "examples/bert/quickstart.sh": "tests/functional_tests/test_example_scripts.py",
    "examples/t5/quickstart.sh": "tests/functional_tests/test_example_scripts.py",
    "examples/gpt3/train_gpt3_175b_distributed.sh": "tests/functional_tests/example_runs.py",
    "examples/mamba/train.sh": "tests/functional_tests/test_example_scripts.py",
    "examples/slurm/pretrain_gpt.sbatch": "tests/functional_tests/test_slurm_cluster.py",
    "examples/run_simple_mcore_train_loop.py": "tests/functional_tests/test_mcore_simple_loop.py",
    "examples/deepseek_v3/train_deepseek_v3_distributed.sh": "tests/functional_tests/test_example_scripts.py",
    "scripts/run_tests.sh": ".ci/run",
    "tools/text_generation_cli.py": "tests/unit_tests/text_generation/test_ranks.py",
    "tools/checkpoint/convert.py": "tests/fault/test_crafted_checkpoint.py",
    "tools/plan_parallelism.py": "tests/unit_tests/tools/test_plan_parallelism.py",
    "benchmarks/bench_long_context.py": "tests/functional_tests/test_benchmark_commands.py",
    "benchmarks/bench_step_vs_plain.py": "tests/functional_tests/test_benchmark_commands.py",
    "benchmarks/bench_cross_entropy.py": "tests/functional_tests/test_benchmark_commands.py",
    "tools/gpu_dry_run.py": "scripts/gpu_smoke.sh",  # its --dry-run part: tests/functional_tests/test_gpu_dry_run.py
    "lm_eval": "tests/functional_tests/test_text_generation_server.py",
    "curl": "tests/functional_tests/test_text_generation_server.py",
    SERVER: "tests/functional_tests/text_generation_runs.py",
    "pretrain_gpt.py": None,  # flags checked here
    "tensorboard": None,  # requirements-test.txt installs it; reads what --tensorboard-dir writes
    "mkdir": None,
    "echo": None,
    ".": None,  # the activation line
}
SHIPPED_INPUT_FLAGS = ("--hf-config", "--include_path")  # README examples read these from the repository
PLACEHOLDER = re.compile(r"<[^>]+>|\s\.\.\.(\s|$)")  # "<printed flags>", "--data-path ...": a template


def readme_blocks() -> List[str]:
    with open(os.path.join(REPO, "README.md")) as f:
        return re.findall(r"```bash\n(.*?)```", f.read(), re.S)


def block_commands(block: str) -> List[str]:
    """One string per command: continuations joined, comments dropped, ``;`` lists split."""
    joined = re.sub(r"\\\n\s*", " ", block)
    commands = []
    for line in joined.splitlines():
        line = line.split("  #")[0].strip()
        commands += [part.strip() for part in line.split("; ") if part.strip() and not part.startswith("#")]
    return commands


def expand(command: str, variables: Dict[str, str]) -> str:
    return re.sub(r"\$(\w+)", lambda m: variables.get(m[1], m[0]), command)


def program_of(words: List[str]) -> Tuple[str, List[str]]:
    """(program, its arguments): environment assignments, ``bash``/``python``/``sbatch``/``torchrun`` and their
    own options skipped."""
    i = 0
    while i < len(words) and re.fullmatch(r"[A-Z_]+=.*", words[i]):
        i += 1
    if i < len(words) and words[i] in ("bash", "python", "sbatch", "torchrun"):
        launcher, i = words[i], i + 1
        while i < len(words) and words[i].startswith("-"):
            takes_value = launcher == "torchrun" and words[i] == "--nproc-per-node"
            i += 2 if takes_value else 1
    return (words[i], words[i + 1 :]) if i < len(words) else ("", [])


def readme_commands() -> List[Tuple[str, str, List[str], str]]:
    """(command as written, program, its arguments, the command with the block's variables expanded)."""
    found = []
    for block in readme_blocks():
        variables: Dict[str, str] = {}
        for command in block_commands(block):
            assignment = re.fullmatch(r"(\w+)=(\"[^\"]*\"|\S+)", command)
            if assignment:
                variables[assignment[1]] = expand(assignment[2].strip('"'), variables)
                continue
            expanded = expand(command, variables)
            words = shlex.split(expanded.split(" > ")[0])
            program, rest = program_of(words)
            found.append((command, program, rest, expanded))
    return found


def test_every_readme_command_is_covered():
    for command, program, _, _ in readme_commands():
        assert program in COVERED, f"README command not covered by any test: {command}"
        test_file = COVERED[program]
        if test_file is not None:
            with open(os.path.join(REPO, test_file)) as f:
                text = f.read()
            assert os.path.splitext(os.path.basename(program))[0] in text or program == "curl", (program, test_file)


def test_repository_paths_named_by_the_readme_exist():
    for command, program, rest, _ in readme_commands():
        for i, word in enumerate([program, *rest]):
            path = word.split("=")[-1]
            shipped = re.match(r"(examples|tools|scripts|tests|benchmarks)/", path) or path.startswith("pretrain_")
            if shipped or (i > 1 and rest[i - 2] in SHIPPED_INPUT_FLAGS):  # an input the repository ships
                assert os.path.exists(os.path.join(REPO, path)), f"{path} in: {command}"


def test_one_activation_line_and_no_venv_paths():
    """The README says once how to enter the environment; no command reaches into .venv itself."""
    commands = [c for c, _, _, _ in readme_commands()]
    assert commands.count(ACTIVATE) == 1
    assert not [c for c in commands if ".venv/bin/" in c and c != ACTIVATE]


def _world_size(expanded: str) -> int:
    match = re.search(r"--nproc-per-node[ =](\d+)", expanded)
    return int(match[1]) if match else 1


@pytest.mark.parametrize(
    "command", [c for c in readme_commands() if c[1] in FLAGS_CHECKED_HERE and not PLACEHOLDER.search(c[0])]
)
def test_training_and_server_flags_parse_and_validate(command):
    """Flags exist and pass every cross-flag rule for the launched world size (files are the run's concern)."""
    _, program, rest, expanded = command
    extra, defaults = None, None
    if program == SERVER:
        from tools.text_generation.model_loading import SERVER_ARG_DEFAULTS, add_server_args

        extra, defaults = add_server_args, SERVER_ARG_DEFAULTS
    args = parse_args(rest, extra, defaults=defaults)
    validate_args(args, _world_size(expanded))


def test_planner_example_config_is_read():
    flags = hf_config_flags(os.path.join(REPO, "examples", "configs", "llama3_70b", "config.json"))
    assert flags[:2] == ["--num-layers", "80"] and "--num-query-groups" in flags
