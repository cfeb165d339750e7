"""Started the way ``srun`` starts tasks (Slurm variables, no torchrun), a run stops cleanly on SIGTERM.

Two ranks read their place from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and the master from
SLURM_NODELIST. Once training is under way, SIGTERM goes to rank 0 only: with
--exit-signal-handler both ranks agree to stop after the current step, save a checkpoint and
exit 0, and the tracker names the last logged iteration.
"""

import os
import signal
import subprocess
import sys
import time

from megatron.training.training_log import parse_log_line
from tests.functional_tests.gpt_runs import REPO, mock_flags, tiny_gpt_flags
from tests.ports import free_port

DEADLINE_S = 240


def _launch(rank: int, port: int, flags, log_path: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(
        SLURM_PROCID=str(rank),
        SLURM_NTASKS="2",
        SLURM_LOCALID=str(rank),
        SLURM_NODELIST="localhost",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONPATH=REPO,
    )
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *flags],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _logged_iterations(path: str):
    with open(path) as f:
        return [p["iteration"] for p in map(parse_log_line, f.read().splitlines()) if p is not None]


def test_sigterm_saves_and_exits_zero(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = tiny_gpt_flags(100000) + mock_flags() + ["--exit-signal-handler", "--save", str(ckpt)]
    port = free_port()
    logs = [str(tmp_path / f"rank{r}.log") for r in range(2)]
    procs = [_launch(r, port, flags, logs[r]) for r in range(2)]
    try:
        start = time.monotonic()
        while len(_logged_iterations(logs[1])) < 3:  # the last rank prints the training lines
            assert time.monotonic() - start < DEADLINE_S, open(logs[1]).read()[-3000:]
            assert all(p.poll() is None for p in procs), open(logs[0]).read()[-3000:]
            time.sleep(0.2)
        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=DEADLINE_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], [open(path).read()[-2000:] for path in logs]
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    iterations = _logged_iterations(logs[1])
    assert 3 <= saved < 100000 and iterations[-1] == saved
    assert (ckpt / f"iter_{saved:07d}" / "metadata.json").exists()
