"""What the dry run saw: events with their source line, grouped by training phase and iteration.

An event is a host synchronisation, a collective or point-to-point call, an attention call,
or a checkpoint tensor written / read. Its site is the first stack frame inside this
repository (outside the dry-run machinery itself), e.g.
``megatron/core/optimizer/clip_grads.py:89 (get_grad_norm_fp32)``, with that line's code.
"""

from __future__ import annotations

import linecache
import os
import sys
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from types import FrameType, TracebackType
from typing import Any, Dict, List, Optional, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/dry_run/ -> repo
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))
_TOOL = os.path.join(REPO_ROOT, "tools", "gpu_dry_run.py")


class DeviceRuleError(RuntimeError):
    """A tensor on the wrong device for a GPU + NCCL run (the message names the call, rule and site)."""


class CheckpointRuleError(RuntimeError):
    """A legacy checkpoint object that ``torch.load(weights_only=True)`` would refuse at resume."""


def _is_repo_code(filename: str) -> bool:
    path = os.path.abspath(filename)
    return (
        path.startswith(REPO_ROOT + os.sep)
        and not path.startswith(_OWN_DIR)
        and path != _TOOL
        and f"{os.sep}.venv{os.sep}" not in path
    )


def _describe(filename: str, lineno: int, function: str) -> Tuple[str, str]:
    rel = os.path.relpath(os.path.abspath(filename), REPO_ROOT)
    return f"{rel}:{lineno} ({function})", linecache.getline(filename, lineno).strip()


def current_site(depth_limit: int = 80) -> Tuple[str, str]:
    """("file:line (function)", code) of the innermost calling frame inside this repository."""
    frame: Optional[FrameType] = sys._getframe(1)
    for _ in range(depth_limit):
        if frame is None:
            break
        if _is_repo_code(frame.f_code.co_filename):
            return _describe(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return "<outside the repository>", ""


def traceback_site(tb: Optional[TracebackType], callers: int = 2) -> Tuple[str, str, List[str]]:
    """(site, code, outer sites) of the innermost repository frames of an exception's traceback."""
    frames = [s for s in traceback.extract_tb(tb) if _is_repo_code(s.filename)]
    found = [_describe(s.filename, s.lineno or 0, s.name) for s in frames]
    if not found:
        return "<outside the repository>", "", []
    site, code = found[-1]
    return site, code, [s for s, _ in found[-1 - callers : -1]][::-1]


@dataclass
class Event:
    """One observation. ``kind``: sync, collective, p2p, attention, ckpt-write, ckpt-read."""

    kind: str
    what: str
    site: str
    code: str
    segment: str
    detail: Dict[str, Any] = field(default_factory=dict)


@dataclass
class IterationInfo:
    """What the training loop returned for one iteration (values are the dry run's stand-ins)."""

    segment: str
    skipped: int = 0
    losses: Dict[str, float] = field(default_factory=dict)


class Recorder:
    """Collects events; ``segment`` names where the run is (``setup``, ``iteration 3``, ``save 3``, ``load``...)."""

    def __init__(self) -> None:
        self.segment = "setup"
        self.events: List[Event] = []
        self.iterations: List[IterationInfo] = []

    def add(self, kind: str, what: str, detail: Optional[Dict[str, Any]] = None) -> Event:
        site, code = current_site()
        event = Event(kind, what, site, code, self.segment, detail or {})
        self.events.append(event)
        return event

    def in_segment(self, segment: str, kind: Optional[str] = None) -> List[Event]:
        return [e for e in self.events if e.segment == segment and (kind is None or e.kind == kind)]

    def syncs_per_iteration(self) -> Dict[str, int]:
        """Host synchronisations of every training iteration, by segment."""
        return {info.segment: len(self.in_segment(info.segment, "sync")) for info in self.iterations}

    def to_json(self) -> Dict[str, Any]:
        return {
            "events": [asdict(e) for e in self.events],
            "iterations": [asdict(i) for i in self.iterations],
            "syncs_per_iteration": self.syncs_per_iteration(),
        }


def _grouped(events: List[Event]) -> List[Tuple[int, str, str, str]]:
    counts = Counter((e.what, e.site, e.code) for e in events)
    return sorted(((n, what, site, code) for (what, site, code), n in counts.items()), key=lambda r: r[2])


def format_segment(recorder: Recorder, segment: str) -> List[str]:
    """Lines describing one segment: its syncs (grouped by site) and attention calls."""
    lines = []
    syncs = recorder.in_segment(segment, "sync")
    lines.append(
        f"  {segment}: {len(syncs)} host sync(s), "
        f"{len(recorder.in_segment(segment, 'collective'))} collective(s), "
        f"{len(recorder.in_segment(segment, 'p2p'))} p2p batch(es)"
    )
    for n, what, site, code in _grouped(syncs):
        lines.append(f"    {n:3d} x {what:34s} {site}: {code}")
    for n, what, site, _ in _grouped(recorder.in_segment(segment, "attention")):
        lines.append(f"    {n:3d} x attention {what} at {site}")
    return lines


def format_report(recorder: Recorder, title: str) -> str:
    """The per-iteration report of one dry run."""
    lines = [f"== {title}"]
    seen = []
    for event in recorder.events:
        if event.segment not in seen:
            seen.append(event.segment)
    for info in recorder.iterations:
        if info.segment not in seen:
            seen.append(info.segment)
    for segment in seen:
        lines.extend(format_segment(recorder, segment))
    writes = [e for e in recorder.events if e.kind == "ckpt-write"]
    if writes:
        lines.append(
            f"  checkpoint: {len(writes)} tensor piece(s) written, "
            f"{len([e for e in recorder.events if e.kind == 'ckpt-read'])} read"
        )
    return "\n".join(lines)
