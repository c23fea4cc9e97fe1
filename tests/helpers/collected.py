"""A pytest plugin that writes the collected tests, with their markers, to `$KERAS_VIT_COLLECTED` (JSON).

    PYTHONPATH=tests/helpers KERAS_VIT_COLLECTED=out.json python -m pytest --collect-only -q -n 0 -p collected

(A top-level module: `helpers/__init__.py` imports Keras, which must come after PyTorch.)

Used by `tests/test_doc_counts.py` to count what the docs quote.
"""

import json
import os


def pytest_collection_finish(session):
    tests = [
        {"nodeid": item.nodeid, "markers": sorted({marker.name for marker in item.iter_markers()})}
        for item in session.items
    ]
    with open(os.environ["KERAS_VIT_COLLECTED"], "w", encoding="utf-8") as file:
        json.dump(tests, file)
