"""Counts quoted in the docs are the code's: each marked number is recomputed here.

A count in README.md or docs/**/*.md is marked with an HTML comment right after it, e.g.
`541<!-- count:tests_collected -->` (invisible once rendered). Every marker must name a counter
in `COUNTERS` and quote its current value; an unknown name fails too.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import subprocess_env

from keras_vit.registry.catalog import list_pretrained

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"(\d[\d,]*)\s*<!--\s*count:\s*([\w-]+)\s*-->")
BAD_INPUT = "tests/test_bad_input.py::"


def _collected(tmp_path) -> list[dict]:
    """Every test `python -m pytest` collects, with its markers (tests/helpers/collected.py)."""
    out = tmp_path / "collected.json"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "collected"],
        cwd=ROOT,
        env=subprocess_env(KERAS_VIT_COLLECTED=str(out), PYTHONPATH=f"{ROOT}:{ROOT / 'tests' / 'helpers'}"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def _cases(tests: list[dict], function: str) -> list[dict]:
    """The parametrised cases of one test function of tests/test_bad_input.py."""
    return [test for test in tests if test["nodeid"].split("[")[0] == BAD_INPUT + function]


def _flags(cases: list[dict]) -> set[str]:
    """The distinct `--flags` in the cases' ids (`...[train --lr 0-]`)."""
    words = (word for case in cases for word in case["nodeid"].split("[", 1)[1].split())
    return {word for word in words if word.startswith("--")}


def _counters(tests: list[dict]) -> dict[str, int]:
    edge = [test for test in tests if test["nodeid"].startswith(BAD_INPUT + "test_edge_")]
    cli_cases = _cases(tests, "test_edge_cli_flag_is_refused_while_parsing")
    return {
        "tests_collected": len(tests),
        "tests_slow": sum("slow" in test["markers"] for test in tests),
        "edge_cases": len(edge),
        "edge_cases_slow": sum("slow" in test["markers"] for test in edge),
        "cli_flags": len(_flags(cli_cases)),
        "cli_flag_cases": len(cli_cases),
        "train_cases": len(_cases(tests, "test_edge_train_argument_is_refused_before_anything_runs"))
        + len(_cases(tests, "test_edge_pretrain_argument_is_refused_before_anything_runs")),
        "image_shape_cases": len(
            _cases(tests, "test_edge_model_refuses_wrong_image_shapes_in_call_and_predict")
        ),
        "load_image_cases": len(_cases(tests, "test_edge_load_image_refuses_ambiguous_arrays")),
        "bad_image_folder_cases": len(_cases(tests, "test_edge_image_folder_names_a_bad_file_or_skips_it")),
        "one_class_cases": len(_cases(tests, "test_edge_one_class_dataset_is_refused")),
        "catalog_checkpoints": len(list_pretrained()),
    }


# Every counter a marker may name, with what it counts (collected under the TensorFlow backend).
COUNTERS = {
    "tests_collected": "tests `python -m pytest` collects",
    "tests_slow": "of those, tests marked `slow`",
    "edge_cases": "test_edge_* cases in tests/test_bad_input.py",
    "edge_cases_slow": "of those, cases marked `slow`",
    "cli_flags": "distinct command-line flags tried by test_edge_cli_flag_is_refused_while_parsing",
    "cli_flag_cases": "cases of test_edge_cli_flag_is_refused_while_parsing",
    "train_cases": "cases of the train and pretrain argument checks (test_edge_*_argument_is_refused_...)",
    "image_shape_cases": "cases of test_edge_model_refuses_wrong_image_shapes_in_call_and_predict",
    "load_image_cases": "cases of test_edge_load_image_refuses_ambiguous_arrays",
    "bad_image_folder_cases": "cases of test_edge_image_folder_names_a_bad_file_or_skips_it",
    "one_class_cases": "cases of test_edge_one_class_dataset_is_refused",
    "catalog_checkpoints": "rows of the pretrained catalog (keras_vit.list_pretrained())",
}


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> dict[str, int]:
    return _counters(_collected(tmp_path_factory.mktemp("collected")))


def _markers(text: str) -> list[tuple[int, int, str]]:
    """`(line, quoted number, counter name)` for every count marker in `text`."""
    return [
        (text.count("\n", 0, match.start()) + 1, int(match[1].replace(",", "")), match[2])
        for match in MARKER.finditer(text)
    ]


def test_markers_are_read_as_written():
    text = "Tests: 541<!-- count:tests_collected --> in all,\n1,024 <!-- count: edge_cases --> and 7 plain."
    assert _markers(text) == [(1, 541, "tests_collected"), (2, 1024, "edge_cases")]


def test_every_counter_counts_something(counts):
    assert set(counts) == set(COUNTERS)
    assert {name: value for name, value in counts.items() if not (isinstance(value, int) and value > 0)} == {}
    assert counts["edge_cases_slow"] < counts["edge_cases"] < counts["tests_collected"]
    assert counts["cli_flags"] <= counts["cli_flag_cases"]


def test_counts_quoted_in_the_docs_match_the_code(counts):
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    wrong = []
    for page in pages:
        for line, quoted, name in _markers(page.read_text(encoding="utf-8")):
            where = f"{page.relative_to(ROOT)}:{line}"
            if name not in counts:
                wrong.append(f"{where}: unknown counter {name!r} (known: {', '.join(sorted(COUNTERS))})")
            elif quoted != counts[name]:
                wrong.append(f"{where}: quotes {quoted} for {name}, the code has {counts[name]}")
    assert wrong == []
