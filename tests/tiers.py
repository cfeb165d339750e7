"""The test tiers: which collected tests the default run leaves to the full run, and the rule that keeps
every test file represented in the default run.

Rule: a test moves to the full tier only when a default-tier test covers the same feature and layout
family (the reason names that sibling). A whole file may move only when its covering sibling lives in
another file, and ``FULL_ONLY`` then lists the file itself; otherwise every test file keeps at least one
default-tier test, and ``tier_problems`` (called by ``tests/conftest.py`` on every run of the whole
suite) names the files that do not.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping


def full_only_reason(nodeid: str, full_only: Mapping[str, str]) -> str | None:
    """The covering sibling when ``nodeid`` is in the full tier: its own entry, its function's or its file's."""
    path, _, rest = nodeid.partition("::")
    function = f"{path}::{rest.split('[')[0]}" if rest else path
    for key in (nodeid, function, path):
        if key in full_only:
            return full_only[key]
    return None


def stale_entries(nodeids: Iterable[str], full_only: Mapping[str, str]) -> List[str]:
    """``full_only`` keys whose file was collected but that match no collected test."""
    nodeids = list(nodeids)
    files = {n.partition("::")[0] for n in nodeids}
    matched = set()
    for nodeid in nodeids:
        path, _, rest = nodeid.partition("::")
        matched.update((nodeid, f"{path}::{rest.split('[')[0]}" if rest else path, path))
    return [key for key in full_only if key.partition("::")[0] in files and key not in matched]


def stale_entries_of_run(args: Iterable[str], nodeids: Iterable[str], full_only: Mapping[str, str]) -> List[str]:
    """``stale_entries`` for a run given ``args`` (pytest's command-line paths), none when one is a node id.

    A node id collects only that test of its file, so the file's other ``full_only`` entries match nothing
    then without being stale: a run of one test beside full-only siblings would otherwise fail at collection.
    """
    if any("::" in str(arg) for arg in args):
        return []
    return stale_entries(nodeids, full_only)


def tier_problems(default: Mapping[str, bool], full_only: Mapping[str, str]) -> List[str]:
    """Files with no default-tier test that ``full_only`` does not list whole.

    ``default`` maps each collected node id to whether it runs in the default tier.
    """
    has_default: Dict[str, bool] = {}
    for nodeid, in_default in default.items():
        path = nodeid.partition("::")[0]
        has_default[path] = has_default.get(path, False) or in_default
    return sorted(path for path, ok in has_default.items() if not ok and path not in full_only)
