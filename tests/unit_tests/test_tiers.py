"""The tier rule of tests/tiers.py: a file whose every test is full-only must be listed whole."""

from tests.tiers import full_only_reason, stale_entries, stale_entries_of_run, tier_problems

FULL = {
    "tests/a.py::test_x[2]": "[1]",
    "tests/b.py::test_y": "tests/a.py::test_x[1]",
    "tests/c.py": "tests/a.py",
}


def test_an_entry_matches_its_node_its_function_or_its_file():
    assert full_only_reason("tests/a.py::test_x[2]", FULL) == "[1]"
    assert full_only_reason("tests/a.py::test_x[1]", FULL) is None
    assert full_only_reason("tests/b.py::test_y[any]", FULL) == "tests/a.py::test_x[1]"
    assert full_only_reason("tests/c.py::test_z", FULL) == "tests/a.py"


def test_a_file_left_without_a_default_test_is_named_unless_listed_whole():
    default = {"tests/a.py::test_x[1]": True, "tests/a.py::test_x[2]": False}
    default.update({"tests/b.py::test_y[1]": False, "tests/c.py::test_z": False})
    assert tier_problems(default, FULL) == ["tests/b.py"]
    default["tests/b.py::test_w"] = True
    assert tier_problems(default, FULL) == []


def test_entries_of_collected_files_that_match_nothing_are_stale():
    collected = ["tests/a.py::test_x[1]", "tests/a.py::test_x[2]", "tests/b.py::test_gone"]
    assert stale_entries(collected, FULL) == ["tests/b.py::test_y"]


def test_a_run_by_node_id_finds_no_stale_entries():
    """One test picked by node id beside a full-only sibling (tests/a.py::test_x[2]) collects without it."""
    collected = ["tests/a.py::test_x[1]"]
    assert stale_entries_of_run(["tests/a.py::test_x[1]"], collected, FULL) == []
    assert stale_entries_of_run(["tests/b.py", "tests/a.py::test_x[1]"], collected, FULL) == []
    assert stale_entries_of_run(["tests/a.py"], collected, FULL) == ["tests/a.py::test_x[2]"]  # the file: stale
