"""The parity record (`tests/parity_gaps.json`, written by `--parity-record`) against the tests and
the docs: every tolerance at most three times the largest gap recorded for it on the backends that
run it, every recorded test still there, docs/testing.md's gap table made from the record
(tests/helpers/parity_table.py)."""

import re

from helpers import parity_table

MAX_RATIO = 3  # the tests aim at about twice the largest gap; above three times, tighten the test
GAP_FLOOR = 1e-7  # float32 rounding on logits of size ~1: a smaller gap is noise, not the test's margin
# Comparisons that are not parity: the error a lossy format may add, checked against its own scale.
NOT_PARITY = {
    "tests/deploy/test_export_formats.py::test_litert_runs_in_the_interpreter": "LiteRT int8 weights",
}


def _entries():
    for nodeid, labels in parity_table.load_record().items():
        for label, runs in labels.items():
            yield nodeid, label, runs


def test_every_tolerance_is_at_most_three_times_its_largest_gap():
    """A tolerance is one value at one assert: the parametrized cases and backends that share it are
    one group (test function, label, tolerance), and its largest gap must be at least a third of it."""
    groups: dict[tuple[str, str, float], list[float]] = {}
    for nodeid, label, runs in _entries():
        function = re.sub(r"\[.*\]$", "", nodeid)
        if label.startswith(NOT_PARITY.get(function, "\0")):
            continue
        for gap, tolerance in runs.values():
            groups.setdefault((function, label, tolerance), []).append(gap)
    too_loose = [
        f"{function} [{label}]: tolerance {tolerance:.2g}, largest gap {max(gaps):.2g}"
        for (function, label, tolerance), gaps in sorted(groups.items())
        if tolerance > MAX_RATIO * max(max(gaps), GAP_FLOOR)
    ]
    assert not too_loose, "tolerances above 3x their recorded gap (tighten them):\n" + "\n".join(too_loose)


def test_every_recorded_gap_is_within_its_tolerance():
    """The record's gaps of every backend pass the test's current tolerance (recorded by its last run)."""
    failing = [
        f"{nodeid} [{label}] on {backend}: gap {gap:.2g} above {tolerance:.2g}"
        for nodeid, label, runs in _entries()
        for backend, (gap, tolerance) in runs.items()
        if gap > tolerance
    ]
    assert not failing, "\n".join(failing)


def test_every_recorded_test_exists():
    missing = []
    for nodeid, _, _ in _entries():
        path, name = nodeid.split("::", 1)
        function = re.sub(r"\[.*\]$", "", name)
        source = parity_table.TESTS.parent / path
        if not source.exists() or not re.search(rf"^def {function}\(", source.read_text(), re.M):
            missing.append(nodeid)
    assert not missing, f"recorded tests that no longer exist (refresh {parity_table.RECORD.name}): {missing}"


def test_docs_table_is_made_from_the_record():
    assert parity_table.table_in(parity_table.DOCS.read_text()) == parity_table.parity_table(
        parity_table.load_record()
    ), "docs/testing.md's parity table is not the record's: run python tests/helpers/parity_table.py"
