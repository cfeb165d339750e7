"""The fake-CUDA dry-run grid, through the CI half of ``scripts/gpu_smoke.sh`` (run once).

Every case of ``tools/dry_run/grid.py`` (TP/SP, PP 1F1B and interleaved, DP with the distributed optimizer and
both overlaps, CP, EP/MoE, bf16, fp16, per-token loss, recompute full/selective, grouped-query attention,
torch_dist and legacy checkpoints, a 64-rank layout, each FP8 recipe and NVFP4, a hybrid Mamba model through
pretrain_mamba.py, DeepSeek-V4's compressed attention, hyper-connections and hash MoE, every ``torch._scaled_mm``
call meeting CUDA's layout checks on fake CUDA tensors) trains, saves, resumes and trains again as its first, a
middle and its last rank: no device mismatch, no CPU tensor in an NCCL call, at most the case's bound of host syncs
per steady-state iteration (6 for dense models, see grid.py), and every bf16/fp16 attention call outside context
parallelism is flash-eligible (DeepSeek-V4's attention makes none: batched matmuls over gathered keys,
``Case.sdpa``). The default tier plays each of its cases as one rank (``default_rank``); the full tier adds the
rank at the other end and each middle rank (``DRY_RUN_GRID``'s ``NAME:RANKS`` tells the script which).
"""

import json
import os
import subprocess
import sys

import pytest

from tools.dry_run.grid import GRID, pick_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


MIDDLE_RANK_CASES = [
    c for c in GRID if pick_ranks("middle", c.world_size)[0] not in pick_ranks("first,last", c.world_size)
]


# The 1F1B pipeline case played as its last stage (it receives activations, computes the loss under PP and sends
# gradients back); the interleaved pipeline case as its first (it sends activations and receives gradients): between
# them the default tier covers both stages and both p2p directions.
LAST_STAGE_CASE = "tp2-sp-pp2-dp2-distopt-bf16"


def default_rank(case) -> str:
    """The rank ``test_case_is_gpu_safe`` plays: the first, but the 1F1B pipeline case's last (a case without
    pipeline stages runs the same code on every rank, on its own TP/CP/EP/DP coordinates)."""
    return "last" if case.name == LAST_STAGE_CASE else "first"


def other_end(case) -> str:
    """The end rank ``default_rank`` does not play (the full tier's)."""
    return "first" if default_rank(case) == "last" else "last"


_RANKS_OF_TEST = {
    "test_case_is_gpu_safe": default_rank,
    "test_case_is_gpu_safe_at_its_other_end": other_end,
    "test_case_is_gpu_safe_as_its_middle_rank": lambda case: "middle",
}


def cases_to_run(items) -> str:
    """``all`` when this session checks the whole grid, else the cases whose tests run, each as
    ``NAME:RANKS`` (the ranks those tests read, joined by ``+``).

    The default tier runs a subset of the cases (tests/conftest.py FULL_ONLY lists the others) at
    ``default_rank``, so the script plays only those; a test that needs every case asks for ``all``.
    """
    wanted = {}
    for item in _selected(items):
        if item.originalname == "test_every_case_runs_as_first_middle_and_last_rank":
            return "all"
        if item.originalname in _RANKS_OF_TEST:
            case = item.callspec.params["case"]
            wanted.setdefault(case.name, set()).update(_RANKS_OF_TEST[item.originalname](case).split(","))
    if not wanted:
        return f"{GRID[0].name}:first"
    order = ("first", "middle", "last")
    return ",".join(f"{name}:{'+'.join(r for r in order if r in ranks)}" for name, ranks in wanted.items())


def _selected(items):
    """This module's tests that run in this session."""
    return [i for i in items if i.module.__name__ == __name__ and i.get_closest_marker("skip") is None]


@pytest.fixture(scope="module")
def grid(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_smoke")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "DRY_RUN_GRID": cases_to_run(request.session.items)}
    env["DRY_RUN_RANKS"] = "first,middle,last"  # the cases given without ranks: all of them (``all``)
    # The script's 300 s per step is for a GPU. On 2 CPU cores the default tier's grid took 100-600 s, and 1,158 s
    # at load 10-16 (the limits were 1,100 / 1,200 s then): these are hang detectors, with room for a busier CI.
    env["STEP_TIMEOUT_S"] = "2700"
    run = subprocess.run(
        ["bash", "scripts/gpu_smoke.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=3000
    )
    path = out / "dry_run_grid.json"
    assert path.is_file(), run.stdout[-4000:] + run.stderr[-4000:]
    return run, {(e["case"], e["rank"]): e for e in json.loads(path.read_text())}


def test_script_passes_and_writes_its_summary(grid):
    run, _ = grid
    assert run.returncode == 0, run.stdout[-6000:]
    assert "PASS dry-run-grid" in run.stdout


def test_every_case_runs_as_first_middle_and_last_rank(grid):
    _, entries = grid
    expected = {(case.name, rank) for case in GRID for rank in pick_ranks("first,middle,last", case.world_size)}
    assert set(entries) == expected
    assert {e["world_size"] for e in entries.values()} >= {2, 4, 8, 64}


def _assert_gpu_safe(entries, case, rank):
    entry = entries[(case.name, rank)]
    assert entry["errors"] == [] and entry["problems"] == [], (rank, entry["problems"])
    assert entry["phases"] == ["train", "resume"]
    assert 0 < entry["steady_max_syncs"] <= case.max_syncs, (rank, entry["syncs_per_iteration"])
    attention = entry["attention"]
    half = "--bf16" in case.flags or "--fp16" in case.flags
    if half and case.sdpa and "--context-parallel-size" not in case.flags:
        assert attention["calls"] > 0 and attention["flash"] == attention["calls"], (rank, attention)


@pytest.mark.parametrize("case", GRID, ids=[c.name for c in GRID])
def test_case_is_gpu_safe(grid, case):
    """The case played as ``default_rank``."""
    _, entries = grid
    _assert_gpu_safe(entries, case, pick_ranks(default_rank(case), case.world_size)[0])


@pytest.mark.parametrize("case", GRID, ids=[c.name for c in GRID])
def test_case_is_gpu_safe_at_its_other_end(grid, case):
    _, entries = grid
    _assert_gpu_safe(entries, case, pick_ranks(other_end(case), case.world_size)[0])


@pytest.mark.parametrize("case", MIDDLE_RANK_CASES, ids=[c.name for c in MIDDLE_RANK_CASES])
def test_case_is_gpu_safe_as_its_middle_rank(grid, case):
    _, entries = grid
    _assert_gpu_safe(entries, case, pick_ranks("middle", case.world_size)[0])
