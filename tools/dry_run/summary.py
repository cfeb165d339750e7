"""The dry run's final report: a line per job, the problems found, and the per-iteration detail."""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Sequence

from tools.dry_run.report import Event, IterationInfo, Recorder, format_report
from tools.dry_run.scheduler import Outcome


def recorder_of(data: Dict[str, Any]) -> Recorder:
    """A Recorder rebuilt from a phase result's JSON."""
    recorder = Recorder()
    recorder.events = [Event(**e) for e in data.get("events", [])]
    recorder.iterations = [IterationInfo(**i) for i in data.get("iterations", [])]
    return recorder


def attention_summary(outcome: Outcome) -> Dict[str, Any]:
    """How many attention calls were flash-eligible, and why the others were not."""
    calls = [e for r in outcome.results for e in r["recorder"].get("events", []) if e["kind"] == "attention"]
    flash = sum(1 for e in calls if e["detail"].get("flash"))
    reasons = Counter(e["what"] for e in calls if not e["detail"].get("flash"))
    return {"calls": len(calls), "flash": flash, "not_flash": dict(reasons)}


def as_json(outcomes: Sequence[Outcome]) -> List[Dict[str, Any]]:
    """One plain entry per job (what the tests and gpu_smoke.sh read)."""
    out = []
    for outcome in outcomes:
        job = outcome.job
        per_iteration: Dict[str, int] = {}
        for result in outcome.results:
            per_iteration.update(result["recorder"].get("syncs_per_iteration", {}))
        steady = outcome.steady_syncs()
        out.append(
            {
                "case": job.name,
                "rank": job.rank,
                "world_size": job.world_size,
                "ok": outcome.ok,
                "problems": outcome.problems,
                "seconds": round(outcome.seconds, 2),
                "syncs_per_iteration": per_iteration,
                "steady_max_syncs": max(steady.values(), default=0),
                "max_syncs": job.max_syncs,
                "attention": attention_summary(outcome),
                "errors": [r["error"] for r in outcome.results if r.get("error")],
                "phases": [r["phase"]["name"] for r in outcome.results],
                "workdir": job.workdir,
            }
        )
    return out


def _attention_text(summary: Dict[str, Any]) -> str:
    if not summary["calls"]:
        return "no attention"
    if summary["flash"] == summary["calls"]:
        return f"flash {summary['flash']}/{summary['calls']}"
    return f"flash {summary['flash']}/{summary['calls']}: " + "; ".join(summary["not_flash"])


def render(outcomes: Sequence[Outcome], verbose: bool, seconds: float) -> str:
    """The report: per-iteration detail (verbose), one line per job, then every problem."""
    lines: List[str] = []
    if verbose:
        for outcome in outcomes:
            for result in outcome.results:
                title = (
                    f"{outcome.job.name}: rank {outcome.job.rank} of {outcome.job.world_size}, "
                    f"phase {result['phase']['name']}"
                )
                lines.append(format_report(recorder_of(result["recorder"]), title))
    lines.append(f"{'case':34s} {'rank':>9s}  {'result':6s} {'syncs/iter':>10s} {'bound':>5s} {'s':>6s}  attention")
    for entry in as_json(outcomes):
        rank = f"{entry['rank']}/{entry['world_size']}"
        bound = "-" if entry["max_syncs"] is None else str(entry["max_syncs"])
        lines.append(
            f"{entry['case']:34s} {rank:>9s}  {'PASS' if entry['ok'] else 'FAIL':6s} "
            f"{entry['steady_max_syncs']:>10d} {bound:>5s} {entry['seconds']:6.1f}  "
            f"{_attention_text(entry['attention'])}"
        )
    for outcome in outcomes:
        for problem in outcome.problems:
            lines.append(f"FAIL {outcome.job.name} rank {outcome.job.rank}: {problem}")
        for result in outcome.results:
            error = result.get("error")
            if error and error.get("via"):
                lines.append(f"     called from {error['via']}")
    passed = sum(o.ok for o in outcomes)
    lines.append(f"{len(outcomes)} dry-run job(s): {passed} passed, {len(outcomes) - passed} failed, {seconds:.1f} s")
    return "\n".join(lines)
