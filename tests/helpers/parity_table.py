"""The record of the gaps the `parity` fixture measured (`tests/parity_gaps.json`) and the table of
docs/testing.md made from it.

To refresh both: run the parity tests on each backend with `--parity-record=tests/parity_gaps.json`
(each run replaces that backend's entries for the tests it ran), then `python tests/helpers/parity_table.py`
rewrites the table between its markers in docs/testing.md; tests/test_parity_record.py checks the table
against the record, and every tolerance against the gaps recorded for it.
"""

import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
RECORD = TESTS / "parity_gaps.json"
DOCS = TESTS.parent / "docs" / "testing.md"
BACKENDS = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "PyTorch"}
BEGIN, END = "<!-- parity-table:begin -->", "<!-- parity-table:end -->"


def _significant(value: float) -> float:
    return float(f"{value:.3g}")


def load_record(path: Path = RECORD) -> dict:
    """{node id: {label: {backend: (gap, tolerance)}}}, empty if there is no record yet.

    The file is a JSON list of `[node id, label, backend, gap, tolerance]` rows, one per line.
    """
    path = Path(path)
    record: dict = {}
    for nodeid, label, backend, gap, tolerance in json.loads(path.read_text()) if path.exists() else []:
        record.setdefault(nodeid, {}).setdefault(label, {})[backend] = (gap, tolerance)
    return record


def merge_record(path, backend: str, gaps: list[tuple[str, str, float, float]]) -> None:
    """Put this run's (node id, label, gap, tolerance) rows for `backend` into the record at `path`.

    A gap belongs to a backend; the tolerance to the test's code: this run's tolerance replaces the
    one recorded with the other backends' gaps of the same comparison.
    """
    record = load_record(path)
    for nodeid, label, gap, tolerance in gaps:
        runs = record.setdefault(nodeid, {}).setdefault(label, {})
        runs[backend] = (gap, tolerance)
        runs.update({name: (other, tolerance) for name, (other, _) in runs.items()})
    rows = sorted(
        json.dumps([nodeid, label, name, _significant(gap), _significant(tolerance)])
        for nodeid, labels in record.items()
        for label, runs in labels.items()
        for name, (gap, tolerance) in runs.items()
    )
    Path(path).write_text("[\n" + ",\n".join(rows) + "\n]\n")


def parity_table(record: dict) -> str:
    """The Markdown table: one row per test and label, the gap on each backend, the tolerance."""
    lines = [
        "| test [label] | " + " | ".join(BACKENDS.values()) + " | tolerance |",
        "|---|" + "---|" * (len(BACKENDS) + 1),
    ]
    for nodeid in sorted(record):
        for label in sorted(record[nodeid]):
            runs = record[nodeid][label]
            gaps = [f"{runs[backend][0]:.1e}" if backend in runs else "—" for backend in BACKENDS]
            tolerances = sorted({f"{tolerance:.2g}" for _, tolerance in runs.values()})
            name = (nodeid.removeprefix("tests/") + (f" [{label}]" if label else "")).replace("|", "\\|")
            lines.append(f"| `{name}` | " + " | ".join(gaps) + f" | {' / '.join(tolerances)} |")
    return "\n".join(lines)


def table_in(text: str) -> str:
    """The text between the table's markers."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{DOCS} has no {BEGIN} ... {END} block for the parity table")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main() -> int:
    text = DOCS.read_text()
    table = parity_table(load_record())
    table_in(text)  # the markers are there
    before, rest = text.split(BEGIN, 1)
    DOCS.write_text(f"{before}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")
    print(f"wrote the parity table ({len(table.splitlines()) - 2} rows) into {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
