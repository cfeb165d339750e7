"""Named RNG streams for tensor-parallel regions, and activation checkpointing that replays them.

Inside a TP region each rank holds a different shard (weights, attention heads),
so dropout and initialization there must draw *different* numbers per TP rank,
while everything outside (replicated activations) must draw the *same* numbers on
every TP rank. ``CudaRNGStatesTracker`` keeps extra generator states by name;
``fork(name)`` swaps one in for the duration of a block. The device generator is
the CUDA one when CUDA is available and the CPU default generator otherwise (the
class keeps Megatron's name).

Seeds set by ``model_parallel_cuda_manual_seed(seed)``:
  * default generator: ``seed`` (identical across TP, so replicated dropout agrees);
  * ``"model-parallel-rng"``: ``seed + 2718 + tp_rank``;
  * ``"expert-parallel-rng"``: ``seed + 1024 + 100 * ep_rank + etp_rank``.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_TP_SEED_OFFSET = 2718
_EXPERT_SEED_OFFSET = 1024


def _on_cuda() -> bool:
    return torch.cuda.is_available()


def _get_device_rng_state() -> torch.Tensor:
    """State of the generator the tracker manages (CUDA if present, else CPU)."""
    return torch.cuda.get_rng_state() if _on_cuda() else torch.get_rng_state()


def _set_device_rng_state(state: torch.Tensor) -> None:
    if _on_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _seed_device_rng(seed: int) -> None:
    if _on_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named generator states that can be swapped in with ``fork(name)``.

    Works on CPU (swaps the CPU default generator) and on CUDA (swaps the current
    device's generator).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: set = set()

    def is_initialized(self) -> bool:
        """Whether at least one state has been added."""
        return bool(self.states_)

    def get_states(self) -> Dict[str, torch.Tensor]:
        """Copies of all states, by name (for checkpointing and recomputation)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace all states (seeds are not tracked by this; use ``add`` for new streams)."""
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``.

        Raises:
            ValueError: ``name`` or ``seed`` is already in use.
        """
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already used by another tracked stream")
        if name in self.states_:
            raise ValueError(f"RNG stream {name!r} already exists")
        self.seeds_.add(seed)
        saved = _get_device_rng_state()
        _seed_device_rng(seed)
        self.states_[name] = _get_device_rng_state()
        _set_device_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the outer stream resumes afterwards.

        Raises:
            RuntimeError: no stream named ``name`` (call ``model_parallel_cuda_manual_seed``).
        """
        if name not in self.states_:
            raise RuntimeError(f"RNG stream {name!r} is not tracked; call model_parallel_cuda_manual_seed first")
        outer = _get_device_rng_state()
        _set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_device_rng_state()
            _set_device_rng_state(outer)


_DEFAULT_RNG_TRACKER = CudaRNGStatesTracker()  # library users' tracker, until a run installs its own
_current_rng_tracker = _DEFAULT_RNG_TRACKER


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The tracker in use: the run's own inside ``use_rng_tracker``, else the process default.

    Megatron's accessor, kept as a facade: the training loop owns its run's tracker
    (``RunState.rng_tracker``) and installs it with ``use_rng_tracker`` for the run's duration,
    so the modules' dropout forks, activation recomputation and checkpoints all see that one.
    """
    return _current_rng_tracker


get_rng_tracker = get_cuda_rng_tracker


@contextlib.contextmanager
def use_rng_tracker(tracker: CudaRNGStatesTracker) -> Iterator[CudaRNGStatesTracker]:
    """Make ``tracker`` the one ``get_cuda_rng_tracker()`` returns inside the block, then restore the previous."""
    global _current_rng_tracker
    previous, _current_rng_tracker = _current_rng_tracker, tracker
    try:
        yield tracker
    finally:
        _current_rng_tracker = previous


def seed_rng_tracker(tracker: CudaRNGStatesTracker, seed: int, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    """Reset ``tracker`` to the two seeded streams of the module doc (TP and expert parallel)."""
    tracker.reset()
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TP_SEED_OFFSET + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + _EXPERT_SEED_OFFSET + 100 * ep_rank + etp_rank)


def model_parallel_cuda_manual_seed(
    seed: int, tp_rank: Optional[int] = None, ep_rank: Optional[int] = None, etp_rank: Optional[int] = None
) -> None:
    """Seed the default generator and the tracked TP/expert streams of ``get_cuda_rng_tracker()``.

    Ranks left as None (Megatron's public signature) are read from the groups built by
    ``initialize_model_parallel``. The training application does not call this: it seeds its
    run's own tracker with ``seed_rng_tracker``.
    """
    if tp_rank is None or ep_rank is None or etp_rank is None:
        groups = parallel_state.ProcessGroupCollection.use_mpu_process_groups()
        tp_rank = groups.rank_in("tp") if tp_rank is None else tp_rank
        ep_rank = groups.rank_in("ep") if ep_rank is None else ep_rank
        etp_rank = groups.rank_in("expt_tp") if etp_rank is None else etp_rank
    _seed_device_rng(seed)
    seed_rng_tracker(get_cuda_rng_tracker(), seed, tp_rank, ep_rank, etp_rank)


# ----------------------------------------------------------------------------------
# Activation checkpointing.
# ----------------------------------------------------------------------------------
@contextlib.contextmanager
def initialization_rng(seed: Optional[int], component: str) -> Iterator[None]:
    """Draw a component's initial weights from a CPU generator seeded by (seed, component).

    With CPU initialization this makes a layer's weights depend only on the seed and the
    layer's global name, not on which pipeline stage, virtual chunk or TP rank builds it,
    nor on what was built before. ``seed=None`` leaves the default generator as it is.
    The default generator's state is restored afterwards.
    """
    if seed is None:
        yield
        return
    derived = zlib.crc32(f"{seed}/{component}".encode()) ^ (seed & 0xFFFFFFFF)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derived)
        yield


def _capture_rng() -> Tuple[torch.Tensor, Optional[torch.Tensor], Dict[str, torch.Tensor]]:
    cuda_state = torch.cuda.get_rng_state() if _on_cuda() else None
    return torch.get_rng_state(), cuda_state, get_cuda_rng_tracker().get_states()


def _restore_rng(states: Tuple[torch.Tensor, Optional[torch.Tensor], Dict[str, torch.Tensor]]) -> None:
    cpu_state, cuda_state, tracked = states
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state)
    get_cuda_rng_tracker().set_states(tracked)


class CheckpointFunction(torch.autograd.Function):
    """Run ``function`` without keeping its activations; rerun it in backward.

    The RNG states (CPU, CUDA, tracked streams) at forward are restored for the
    rerun, so dropout draws the same masks; the states after backward are the ones
    backward found, so checkpointing does not shift later random numbers.
    """

    @staticmethod
    def forward(ctx, function, distribute_group, *args):
        ctx.function = function
        ctx.distribute_group = distribute_group
        ctx.rng_states = _capture_rng()
        with torch.no_grad():
            outputs = function(*args)
        first = args[0] if args and torch.is_tensor(args[0]) else None
        if distribute_group is not None and first is not None:
            # Keep only this rank's 1/tp of the first input; re-gathered in backward.
            ctx.first_shape = first.shape
            first = split_tensor_into_1d_equal_chunks(first, distribute_group)
        ctx.tensor_slots = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        tensors = [first if i == 0 and first is not None else args[i] for i in ctx.tensor_slots]
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint() does not work with torch.autograd.grad(); use .backward()")
        args = list(ctx.others)
        for slot, saved in zip(ctx.tensor_slots, ctx.saved_tensors):
            if slot == 0 and ctx.distribute_group is not None:
                saved = gather_split_1d_tensor(saved, ctx.distribute_group).view(ctx.first_shape)
            # +2: forward's own inputs start with ``function`` and the group.
            args[slot] = saved.detach().requires_grad_(ctx.needs_input_grad[slot + 2])
        after_forward = _capture_rng()
        _restore_rng(ctx.rng_states)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*args)
        finally:
            _restore_rng(after_forward)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if torch.is_tensor(a) else None for a in args)
        return (None, None) + input_grads


def checkpoint(
    function: Callable[..., Any],
    distribute_saved_activations: bool,
    *args: Any,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> Any:
    """Activation checkpointing with RNG replay (Megatron's ``tensor_parallel.checkpoint``).

    Args:
        function: computes the block; called with ``*args``.
        distribute_saved_activations: store only 1/tp of the first (tensor) argument
            per TP rank and all-gather it for the recompute; its element count must
            be divisible by the TP size.
        *args: inputs of ``function``.
        tp_group: group to distribute over (None: the default TP group; only read
            when ``distribute_saved_activations``).
    """
    group = None
    if distribute_saved_activations:
        group = parallel_state.get_tensor_model_parallel_group_if_none(tp_group)
        if dist.get_world_size(group) == 1:
            group = None
    return CheckpointFunction.apply(function, group, *args)
