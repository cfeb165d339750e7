"""One dry-run phase in this process: ``pretrain_gpt`` as one rank, under every stand-in.

``run_phase`` starts torch.distributed through Megatron's ``--fake-process-group`` (rank and
world size from RANK / WORLD_SIZE), installs the one-GPU ``torch.cuda``, the NCCL rules,
the checkpoint storage stand-ins, the attention probe and the training-loop hooks, and runs
``pretrain`` under ``DryRunMode``. The data pipeline runs outside the fake mode (real host
tensors, as on a GPU machine); ``get_batch`` moves each batch to the GPU.

The result (events by segment, iterations, the error if any, with its kind and source
line) is plain JSON: a phase runs in a forked child (``scheduler.py``) and reports through
a file.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from tools.dry_run.attention_probe import install_attention_probe
from tools.dry_run.checkpoint_io import CheckpointIO
from tools.dry_run.fake_cuda import Patcher, patch_cuda_api
from tools.dry_run.fake_mode import DryRunMode, install_tensor_methods
from tools.dry_run.nccl_rules import install_nccl_rules
from tools.dry_run.report import (
    REPO_ROOT,
    CheckpointRuleError,
    DeviceRuleError,
    IterationInfo,
    Recorder,
    traceback_site,
)

_MISMATCH_TEXT = (
    "Expected all tensors to be on the same device",
    "Mismatching",
    "device mismatch",
    "found two different devices",
)
# torch >= 2.12 raises its own class for a device mismatch; older versions a RuntimeError (matched by text).
_MISMATCH_ERRORS = tuple(c for c in (getattr(fake_tensor, "FakeTensorDeviceMismatchError", None),) if c)


@dataclass
class Phase:
    """One ``pretrain`` call: ``argv`` are ``pretrain_{entry_point}.py`` flags, played as ``rank`` of ``world_size``."""

    name: str
    argv: List[str]
    rank: int
    world_size: int
    entry_point: str = "gpt"  # a key of ENTRY_POINTS


@dataclass
class PhaseResult:
    """What a phase saw, and how it ended (``error`` None: it finished)."""

    phase: Phase
    recorder: Dict[str, Any] = field(default_factory=dict)
    error: Optional[Dict[str, str]] = None


class _HostIterator:
    """A data iterator whose batches are made outside the fake mode (real host tensors)."""

    def __init__(self, inner: Iterator) -> None:
        self.inner = inner

    def __iter__(self) -> _HostIterator:
        return self

    def __next__(self) -> Any:
        with unset_fake_temporarily():
            return next(self.inner)


def _host_data(build: Callable) -> Callable:
    def build_data_iterators(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            data = build(*args, **kwargs)
        for split in ("train", "valid", "test"):
            iterators = getattr(data, split)
            if iterators is not None:
                setattr(data, split, [_HostIterator(it) for it in iterators])
        return data

    return build_data_iterators


def install_loop_hooks(patcher: Patcher, recorder: Recorder) -> None:
    """Name segments after iterations / evaluation and record what each iteration returned."""
    from megatron.training import training

    original_step, original_eval = training.train_step, training._evaluate_and_log

    def train_step(loop: Any) -> tuple:
        recorder.segment = f"iteration {loop.state.iteration + 1}"
        losses, skipped, grad_norm, num_zeros = original_step(loop)
        recorder.iterations.append(IterationInfo(recorder.segment, int(skipped), dict(losses)))
        return losses, skipped, grad_norm, num_zeros

    def evaluate_and_log(loop: Any, prefix: str, iterators: Any, final: bool = False) -> None:
        previous, recorder.segment = recorder.segment, prefix
        try:
            original_eval(loop, prefix, iterators, final=final)
        finally:
            recorder.segment = previous

    patcher.set(training, "train_step", train_step)
    patcher.set(training, "_evaluate_and_log", evaluate_and_log)
    patcher.set(training, "build_data_iterators", _host_data(training.build_data_iterators))


def _fake_tensors_count_as_foreach_capable(patcher: Patcher) -> None:
    """torch picks its foreach optimizer path for plain tensors only; fake ones stand for them here."""
    import torch.optim.optimizer as optimizer_module
    import torch.utils._foreach_utils as foreach_utils

    for module in {id(m): m for m in (foreach_utils, optimizer_module)}.values():
        supported = getattr(module, "_foreach_supported_types", None)
        if isinstance(supported, list) and FakeTensor not in supported:
            patcher.set(module, "_foreach_supported_types", supported + [FakeTensor])


class _WeakrefsOfRealTensors:
    """``weakref`` as ``torch.utils.swap_tensors`` sees it: fake tensors report none.

    ``Module.cuda()`` swaps fake parameters into their CUDA copies, and a fake parameter
    carries a weakref of the fake mode's bookkeeping, which would refuse the swap.
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(weakref, name)

    @staticmethod
    def getweakrefs(obj: Any) -> list:
        return [] if isinstance(obj, FakeTensor) else weakref.getweakrefs(obj)


def swap_keeping_attributes(original: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """``torch.utils.swap_tensors`` that keeps ``t1``'s own attributes, as ``param.data = ...`` does.

    ``Module.cuda()`` swaps a fake parameter with its CUDA copy, ``__dict__`` included, which would
    drop what the model set on it (``tensor_model_parallel``, ``sequence_parallel``, ``allreduce``,
    ``shared``...); on a GPU the parameter keeps them (``.data`` is replaced, not the object).
    """

    def swap_tensors(t1: Any, t2: Any) -> None:
        original(t1, t2)
        for name, value in vars(t2).items():  # t2 now holds t1's former attributes
            if name not in vars(t1):
                setattr(t1, name, value)

    return swap_tensors


def install_module_moves(patcher: Patcher) -> None:
    """``Module.cuda()`` / ``.to()`` on fake parameters: swaps allowed, the parameters' attributes kept."""
    patcher.set(torch.utils, "weakref", _WeakrefsOfRealTensors())
    patcher.set(torch.utils, "swap_tensors", swap_keeping_attributes(torch.utils.swap_tensors))


def classify(error: BaseException) -> Dict[str, str]:
    """Kind (device mismatch / NCCL rule / error), message and source line of a failed phase."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    root = next((e for e in chain if isinstance(e, (DeviceRuleError, CheckpointRuleError) + _MISMATCH_ERRORS)), None)
    if root is None:
        root = next((e for e in chain if any(t in str(e) for t in _MISMATCH_TEXT)), chain[-1])
    if isinstance(root, DeviceRuleError):
        kind = "nccl/device rule"
    elif isinstance(root, CheckpointRuleError):
        kind = "checkpoint rule"
    elif isinstance(root, _MISMATCH_ERRORS) or any(t in str(root) for t in _MISMATCH_TEXT):
        kind = "device mismatch"
    else:
        kind = "error"
    site, code, callers = traceback_site(root.__traceback__)
    tail = "".join(traceback.format_exception(type(root), root, root.__traceback__)[-6:])
    message = str(root).splitlines()[0][:600] if str(root) else type(root).__name__
    return {
        "kind": kind,
        "type": type(root).__name__,
        "message": message,
        "site": site,
        "code": code,
        "via": " <- ".join(callers),
        "traceback": tail[-3000:],
    }


def _entry_points() -> Dict[str, Any]:
    """The entry-point modules a phase can run, by ``Phase.entry_point``."""
    import pretrain_gpt
    import pretrain_mamba

    return {"gpt": pretrain_gpt, "mamba": pretrain_mamba}


def preload() -> None:
    """Import what every phase needs once, before forking (each child then starts at once)."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    import torch.distributed.checkpoint  # noqa: F401
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    from megatron.training import checkpointing, training  # noqa: F401

    _entry_points()


def _pretrain(argv: List[str], entry_point: str) -> None:
    preload()
    from megatron.core.transformer.enums import ModelType
    from megatron.training.training import pretrain

    module = _entry_points()[entry_point]
    pretrain(
        module.train_valid_test_datasets_provider,
        module.model_provider,
        ModelType.encoder_or_decoder,
        module.forward_step,
        argv=argv,
        entry_point=entry_point,
    )


def run_phase(phase: Phase) -> PhaseResult:
    """Run ``phase`` in this process (which must have loaded the CUDA shim before torch)."""
    os.environ.update(RANK=str(phase.rank), WORLD_SIZE=str(phase.world_size), LOCAL_RANK="0")
    recorder = Recorder()
    result = PhaseResult(phase)
    patcher = Patcher()
    try:
        patch_cuda_api(patcher, recorder)
        install_nccl_rules(patcher, recorder)
        CheckpointIO(patcher, recorder).install()
        install_attention_probe(patcher, recorder)
        install_loop_hooks(patcher, recorder)
        install_tensor_methods(patcher, recorder)
        _fake_tensors_count_as_foreach_capable(patcher)
        install_module_moves(patcher)
        with torch.autograd.set_multithreading_enabled(False), DryRunMode(recorder):
            _pretrain(list(phase.argv) + ["--fake-process-group"], phase.entry_point)
        recorder.segment = "finished"
    except (Exception, SystemExit) as error:  # noqa: BLE001 - every failure is reported with its source line
        result.error = classify(error)
    finally:
        patcher.restore()
    result.recorder = recorder.to_json()
    return result


def result_to_json(result: PhaseResult) -> Dict[str, Any]:
    return {"phase": asdict(result.phase), "recorder": result.recorder, "error": result.error}


@contextlib.contextmanager
def redirected_output(path: str) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors included) to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    with open(path, "w") as log:
        saved = os.dup(1), os.dup(2)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
