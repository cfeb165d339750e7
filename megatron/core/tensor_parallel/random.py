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
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_TP_SEED_OFFSET = 2718
_EXPERT_SEED_OFFSET = 1024


def _refuse(where: str, **switches: bool) -> None:
    """Raise for CUDA-graph / Transformer Engine RNG switches, which this package does not have."""
    active = sorted(name for name, on in switches.items() if on)
    if active:
        raise ValueError(f"{where}: not supported yet: {active} (CUDA graphs / Transformer Engine RNG)")


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

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False) -> None:
        _refuse("CudaRNGStatesTracker", use_cudagraphable_rng=use_cudagraphable_rng)
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: set = set()

    def is_initialized(self) -> bool:
        """Whether at least one state has been added."""
        return bool(self.states_)

    def get_states(self) -> Dict[str, torch.Tensor]:
        """The states by name, in a new dict (the tensors are not copied: ``fork`` replaces, never mutates them)."""
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Use ``states`` as given (Megatron's contract; seeds are not tracked by this)."""
        self.states_ = states

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


class _InferenceRNGStatesTracker(CudaRNGStatesTracker):
    """Megatron's inference tracker: streams are neither added nor restored, and ``fork`` draws from the default."""

    def add(self, name: str, seed: int) -> None:
        pass

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        pass

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        yield


_DEFAULT_RNG_TRACKER = CudaRNGStatesTracker()  # library users' tracker, until a run installs its own
_current_rng_tracker = _DEFAULT_RNG_TRACKER


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
) -> None:
    """Replace the process default tracker when ``force_reset`` (Megatron's lazy creation is eager here).

    ``inference_rng_tracker`` makes the new one an inference tracker (no streams, ``fork`` is a no-op).
    """
    global _DEFAULT_RNG_TRACKER, _current_rng_tracker
    _refuse(
        "initialize_rng_tracker", use_te_rng_tracker=use_te_rng_tracker, use_cudagraphable_rng=use_cudagraphable_rng
    )
    if not force_reset:
        return
    kind = _InferenceRNGStatesTracker if inference_rng_tracker else CudaRNGStatesTracker
    replaced = _current_rng_tracker is _DEFAULT_RNG_TRACKER
    _DEFAULT_RNG_TRACKER = kind(is_inference_rng_tracker=inference_rng_tracker)
    if replaced:
        _current_rng_tracker = _DEFAULT_RNG_TRACKER


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False
) -> CudaRNGStatesTracker:
    """The tracker in use: the run's own inside ``use_rng_tracker``, else the process default.

    Megatron's accessor, kept as a facade: the training loop owns its run's tracker
    (``RunState.rng_tracker``) and installs it with ``use_rng_tracker`` for the run's duration,
    so the modules' dropout forks, activation recomputation and checkpoints all see that one.
    The switches select Megatron's tracker kinds at first creation; only the defaults exist here.
    """
    _refuse("get_cuda_rng_tracker", use_te_rng_tracker=use_te_rng_tracker, use_cudagraphable_rng=use_cudagraphable_rng)
    return _current_rng_tracker


get_rng_tracker = get_cuda_rng_tracker


def get_all_rng_states() -> Dict[str, torch.Tensor]:
    """The tracked states of the tracker in use (the tracker's own dict)."""
    return get_cuda_rng_tracker().states_


def get_expert_parallel_rng_tracker_name() -> str:
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def is_graph_safe_cuda_rng_tracker(cuda_rng_tracker: CudaRNGStatesTracker) -> bool:
    """False: no tracker here is safe to capture in a CUDA graph."""
    return bool(getattr(cuda_rng_tracker, "use_cudagraphable_rng", False))


def convert_cuda_rng_state(
    state: Union[torch.Tensor, torch.Generator], to_graphable: bool = False
) -> Union[torch.Tensor, torch.Generator]:
    """A state as a tensor (``to_graphable=False``); the graph-safe generator form is not supported yet."""
    if isinstance(state, torch.Generator):
        return state if to_graphable else state.get_state()
    if not isinstance(state, torch.Tensor):
        raise ValueError(f"Invalid state type: {type(state)}")
    if to_graphable:
        raise ValueError("convert_cuda_rng_state(to_graphable=True): CUDA-graph RNG states are not supported yet")
    return state


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
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: Optional[int] = None,
    ep_rank: Optional[int] = None,
    etp_rank: Optional[int] = None,
    force_reset_rng: bool = False,
) -> None:
    """Seed the default generator and the tracked streams of ``get_cuda_rng_tracker()`` (Megatron's signature).

    Streams: ``"data-parallel-rng"`` (``seed``), and the TP and expert streams of the module doc.
    Ranks left as None are read from the groups built by ``initialize_model_parallel``. The
    training application does not call this: it seeds its run's own tracker with ``seed_rng_tracker``.
    """
    if tp_rank is None or ep_rank is None or etp_rank is None:
        groups = parallel_state.ProcessGroupCollection.use_mpu_process_groups()
        tp_rank = groups.rank_in("tp") if tp_rank is None else tp_rank
        ep_rank = groups.rank_in("ep") if ep_rank is None else ep_rank
        etp_rank = groups.rank_in("expt_tp") if etp_rank is None else etp_rank
    initialize_rng_tracker(te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=force_reset_rng)
    _seed_device_rng(seed)
    tracker = get_cuda_rng_tracker()
    seed_rng_tracker(tracker, seed, tp_rank, ep_rank, etp_rank)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)


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
    get_cuda_rng_tracker().set_states(dict(tracked))  # the tracker may update its dict; keep the snapshot


_CHECKPOINTING: List[bool] = []  # per running checkpointed forward / recompute: will backward rerun it
_GRAD_AT_CALL: List[bool] = []  # per CheckpointFunction.apply running: grad mode of its caller


def is_checkpointing() -> bool:
    """Whether a ``checkpoint`` forward or its recompute is running (Megatron's flag)."""
    return bool(_CHECKPOINTING)


def checkpointed_forward_reruns() -> bool:
    """Inside the first (graph-free) forward of a ``checkpoint``: whether its backward will run it again
    (its output needs a gradient). False outside one, in a recompute, and under ``no_grad`` (evaluation)."""
    return bool(_CHECKPOINTING) and _CHECKPOINTING[-1] and not torch.is_grad_enabled()


@contextlib.contextmanager
def _checkpointing(reruns: bool = False) -> Iterator[None]:
    _CHECKPOINTING.append(reruns)
    try:
        yield
    finally:
        _CHECKPOINTING.pop()


def _distribute_group(distribute: Union[bool, dist.ProcessGroup, None]) -> Optional[dist.ProcessGroup]:
    """The group to spread a saved input over: a given group, or the default TP group for ``True``."""
    if distribute is None or distribute is False:
        return None
    # A group of one too (as upstream): the caller's tensor is then its flat copy until backward.
    return parallel_state.get_tensor_model_parallel_group_if_none(None if distribute is True else distribute)


class CheckpointFunction(torch.autograd.Function):
    """Run ``function`` without keeping its activations; rerun it in backward.

    The RNG states (CPU, CUDA, tracked streams) at forward are restored for the
    rerun, so dropout draws the same masks; the states after backward are the ones
    backward found, so checkpointing does not shift later random numbers.

    ``distribute_saved_activations`` (True: the default TP group, or a group) replaces the
    storage of the first input by this rank's 1/tp flat piece until backward gathers it back,
    as Megatron does: the caller's tensor object itself shrinks, so the full copy is freed.
    """

    @classmethod
    def apply(cls, *args: Any) -> Any:
        """Notes whether gradients are on where it is called (inside ``forward`` they never are)."""
        _GRAD_AT_CALL.append(torch.is_grad_enabled())
        try:
            return super().apply(*args)
        finally:
            _GRAD_AT_CALL.pop()

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        ctx.function = run_function
        ctx.group = _distribute_group(distribute_saved_activations)
        ctx.rng_states = _capture_rng()
        reruns = _GRAD_AT_CALL[-1] and any(ctx.needs_input_grad)  # backward will rerun the function
        with torch.no_grad(), _checkpointing(reruns):
            outputs = run_function(*args)
        if ctx.group is not None and args and torch.is_tensor(args[0]):
            ctx.first_shape = args[0].shape
            args[0].data = split_tensor_into_1d_equal_chunks(args[0].data, new_buffer=True, tp_group=ctx.group)
            # Backward regrows this very object: a saved-tensor hook may unpack another one.
            ctx.first = args[0]
        ctx.tensor_slots = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_slots))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint() does not work with torch.autograd.grad(); use .backward()")
        args = list(ctx.others)
        for slot, saved in zip(ctx.tensor_slots, ctx.saved_tensors):
            if slot == 0 and hasattr(ctx, "first"):
                saved, ctx.first = ctx.first, None
                saved.data = gather_split_1d_tensor(saved.data, tp_group=ctx.group).view(ctx.first_shape)
            # +2: forward's own inputs start with ``run_function`` and the distribute flag.
            args[slot] = saved.detach().requires_grad_(ctx.needs_input_grad[slot + 2])
        with _checkpointing():
            outputs = _rerun(ctx.function, ctx.rng_states, args)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if torch.is_tensor(a) else None for a in args)
        return (None, None) + input_grads


def _rerun(function: Callable[..., Any], rng_states: tuple, args: list) -> Any:
    """``function(*args)`` with grad, under the RNG states of the forward; the current states come back after."""
    after_forward = _capture_rng()
    _restore_rng(rng_states)
    try:
        with torch.enable_grad():
            return function(*args)
    finally:
        _restore_rng(after_forward)


def checkpoint(
    function: Callable[..., Any],
    distribute_saved_activations: bool,
    *args: Any,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> Any:
    """Activation checkpointing with RNG replay (Megatron's ``tensor_parallel.checkpoint``).

    Args:
        function: computes the block; called with ``*args``.
        distribute_saved_activations: keep only this rank's 1/tp of the first (tensor)
            argument until backward (its storage is replaced, see ``CheckpointFunction``);
            its element count must be divisible by the TP size.
        *args: inputs of ``function``.
        tp_group: group to distribute over (None: the default TP group; only read
            when ``distribute_saved_activations``).
    """
    distribute = (
        tp_group if distribute_saved_activations and tp_group is not None else bool(distribute_saved_activations)
    )
    return CheckpointFunction.apply(function, distribute, *args)


class CheckpointWithoutOutputFunction(torch.autograd.Function):
    """Forward without a graph; backward through the outputs ``CheckpointWithoutOutput`` recomputed."""

    @staticmethod
    def forward(ctx, run_function, owner, *args):
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.tensor_slots = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i].detach() for i in ctx.tensor_slots))
        ctx.owner = owner
        owner.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not hasattr(ctx, "outputs"):  # the outputs were kept: recompute now
            ctx.owner._recompute(None)
        pairs = [(o, g) for o, g in zip(ctx.outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if torch.is_tensor(a) else None for a in ctx.inputs)
        del ctx.outputs, ctx.inputs
        return (None, None) + input_grads


class CheckpointWithoutOutput:
    """Checkpoint a block and also free its outputs until they are needed (Megatron's class).

    ``checkpoint(run_function, *args)`` runs the block without a graph.
    ``discard_output_and_register_recompute(hook_tensor)`` then frees the outputs' storage
    (their shape stays) and recomputes them, with the forward's RNG states, when the gradient
    of ``hook_tensor`` is computed, before the consumers of the outputs need them in backward.
    """

    def __init__(self, fp8: bool = False) -> None:
        if fp8 not in (False, None):
            raise ValueError("CheckpointWithoutOutput(fp8=...): FP8 is not supported yet")
        self.fp8 = False
        self.run_function: Optional[Callable[..., Any]] = None
        self.rng_states: Optional[tuple] = None
        self.ctx = None
        self.outputs: Optional[Tuple[torch.Tensor, ...]] = None

    def checkpoint(self, run_function: Callable[..., Any], *args: Any) -> Any:
        """``run_function(*args)`` without saving its activations."""
        self.run_function = run_function
        self.rng_states = _capture_rng()
        outputs = CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        return outputs

    def _recompute(self, _: Any) -> None:
        """Rerun the block and put its outputs back into the freed tensors (once)."""
        ctx = self.ctx
        if ctx is None:
            return
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("CheckpointWithoutOutput does not work with torch.autograd.grad(); use .backward()")
        inputs = list(ctx.others)
        for slot, saved in zip(ctx.tensor_slots, ctx.saved_tensors):
            inputs[slot] = saved
        # +2: the function's own inputs start with ``run_function`` and this object.
        needs = ctx.needs_input_grad[2:]
        inputs = [t.detach().requires_grad_(n) if torch.is_tensor(t) else t for t, n in zip(inputs, needs)]
        outputs = _rerun(self.run_function, self.rng_states, inputs)
        outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        with torch.no_grad():
            for kept, fresh in zip(self.outputs, outputs):
                kept.untyped_storage().resize_(fresh.untyped_storage().nbytes())
                kept.untyped_storage().copy_(fresh.untyped_storage())
        ctx.outputs, ctx.inputs = outputs, inputs
        self.run_function = self.rng_states = self.outputs = self.ctx = None

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' storage; recompute them when ``hook_tensor``'s gradient is computed."""
        for output in self.outputs:
            output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)
