"""Shared test setup: quiet TensorFlow, float32 everywhere, deterministic seeds, no silent skips.

Helpers that tests import live in `tests/helpers/` (`from helpers import random_images`); this
file holds the fixtures and hooks only.

The `test` set-up (`pip install -e ".[test]"`) is required: a missing reference library is an
import error here, not a module of silently skipped tests. Only the tests named in `EXPECTED_SKIPS`
may skip, and only on the backends named there (a feature of one Keras backend only); any other
skip is reported as a failure.
"""

import os
import socket
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network

# torchvision (imported by timm) segfaults when loaded after TensorFlow on this stack
# (TF 2.21 + torch 2.14.1): the reference libraries must be imported first.
# isort: off
import timm  # noqa: F401, E402
import torch  # noqa: F401, E402
import transformers  # noqa: F401, E402

# isort: on
import huggingface_hub  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The only tests that may skip, by node id (parameters included), and the backends they may skip on.
EXPECTED_SKIPS = {
    # the eager fast paths of a block and of a model are PyTorch's (models/eager_torch.py)
    "tests/models/test_layers.py::test_eager_torch_block_equals_the_keras_ops_path": {"tensorflow", "jax"},
    "tests/models/test_layers.py::test_eager_torch_block_leaves_what_it_does_not_compute_to_the_sublayers": {
        "tensorflow",
        "jax",
    },
    "tests/models/test_layers.py::test_eager_torch_model_equals_the_functional_graph": {"tensorflow", "jax"},
    "tests/models/test_layers.py::test_eager_torch_fused_attention_takes_q_k_v_strided": {
        "tensorflow",
        "jax",
    },
    "tests/models/test_layers.py::test_eager_torch_model_leaves_what_it_does_not_compute_to_the_graph": {
        "tensorflow",
        "jax",
    },
    "tests/models/test_layers.py::test_eager_torch_jit_compile_compiles_the_forward": {
        "tensorflow",
        "jax",
    },
    "tests/models/test_layers.py::test_eager_torch_model_reads_variables_as_keras_does": {
        "tensorflow",
        "jax",
    },
    "tests/models/test_layers.py::test_eager_torch_layer_norms_take_one_dtype[mixed_bfloat16]": {
        "tensorflow",
        "jax",
    },
    "tests/models/test_layers.py::test_eager_torch_layer_norms_take_one_dtype[bfloat16]": {
        "tensorflow",
        "jax",
    },
    "tests/models/test_layers.py::test_eager_torch_model_trains_after_a_call_in_inference_mode": {
        "tensorflow",
        "jax",
    },
    # ONNX export on JAX needs jax2onnx, which the test set-up does not install
    "tests/models/test_model_contract.py::test_onnx_export_of_a_model_never_called_gives_its_logits": {"jax"},
    # the hand-written GELU derivative is TensorFlow's (models/layers.py)
    "tests/models/test_layers.py::test_training_block_has_the_inference_values_and_gradients": {
        "jax",
        "torch",
    },
    # the lean AdamW update is PyTorch's (training/optimization.py)
    "tests/training/test_optimizer_update.py::test_pytorch_fit_runs_the_lean_update_stateless_apply_not": {
        "tensorflow",
        "jax",
    },
    # the training step without host-device synchronisation is PyTorch's (models/torch_step.py)
    "tests/models/test_torch_step.py::test_pytorch_training_step_never_waits_for_the_device": {
        "tensorflow",
        "jax",
    },
    "tests/models/test_torch_step.py::test_device_constants_give_fresh_copies_of_tensors_made_once": {
        "tensorflow",
        "jax",
    },
    "tests/models/test_torch_step.py::test_draws_are_keras_numbers_from_a_seed_kept_on_the_host": {
        "tensorflow",
        "jax",
    },
    # the erf form of the exact GELU is JAX's (models/layers.py)
    "tests/models/test_layers.py::test_jax_mlp_gelu_gradient_is_the_exact_derivative": {
        "tensorflow",
        "torch",
    },
}

# The modules whose subject does not depend on the Keras backend: under `KERAS_BACKEND=jax|torch`,
# `python -m pytest` collects these only (the rest is TensorFlow by nature: tf.data pipelines,
# tf.distribute, export, the training driver; test_backends.py drives the other backends from there).
BACKEND_NEUTRAL_MODULES = {
    "test_layers.py",
    "test_model_contract.py",
    "test_formats.py",
    "test_hybrid.py",
    "test_quantization_lora.py",
    "test_original_code.py",
    "test_pooling_layouts.py",
    "test_optimizer_update.py",
    "test_torch_step.py",
}

TEST_WORKERS_CAP = 4  # each worker imports TensorFlow, PyTorch and the references (~2 GB), 2-thread ops


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (setup.cfg): one worker per CPU this process may use, at most TEST_WORKERS_CAP.

    Much of the suite's time is single-threaded (imports, subprocesses, Python-side model
    building), so two workers on a 2-core machine finish well before one process.
    """
    return max(1, min(len(os.sched_getaffinity(0)), TEST_WORKERS_CAP))


def pytest_ignore_collect(collection_path, config):
    """On JAX or PyTorch, only BACKEND_NEUTRAL_MODULES are collected."""
    if keras.backend.backend() == "tensorflow" or collection_path.suffix != ".py":
        return None
    if collection_path.name.startswith("test_") and collection_path.name not in BACKEND_NEUTRAL_MODULES:
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """On JAX or PyTorch, the tests marked `backend_free` (no Keras in them) are deselected: they compute
    the same under every backend, and the TensorFlow run runs them."""
    if keras.backend.backend() == "tensorflow":
        return
    dropped = [item for item in items if item.get_closest_marker("backend_free")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not item.get_closest_marker("backend_free")]


@pytest.fixture(autouse=True)
def _float32_policy():
    """Every test starts (and ends) under the float32 policy with fixed seeds."""
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture
def network_attempts(monkeypatch) -> list:
    """Every name lookup and connection the test makes, each refused as on a machine with no network.

    A test asserts on the list (e.g. one probe, then nothing) instead of timing the code.
    """
    attempts = []

    def refuse_lookup(host, port, *args, **kwargs):
        attempts.append((host, port))
        raise socket.gaierror(socket.EAI_NONAME, f"no network in this test ({host}:{port})")

    def refuse_connection(self, address):
        attempts.append(address)
        raise ConnectionRefusedError(f"no network in this test ({address})")

    monkeypatch.setattr(socket, "getaddrinfo", refuse_lookup)
    monkeypatch.setattr(socket.socket, "connect", refuse_connection)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse_connection)
    return attempts


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache under tmp_path that hf_hub_download uses by default; offline mode on."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def parity(record_property):
    """`parity(actual, expected, tolerance)`: asserts max |actual - expected| <= tolerance, records it.

    The recorded gaps are listed at the end of the run ("parity gaps"): the numbers the docs quote.
    """

    def check(actual, expected, tolerance: float, label: str = "") -> float:
        actual, expected = np.asarray(actual, "float64"), np.asarray(expected, "float64")
        assert actual.shape == expected.shape, (actual.shape, expected.shape)
        gap, tolerance = float(np.max(np.abs(actual - expected))), float(tolerance)  # plain floats:
        record_property("parity_gap", (label, gap, tolerance))  # xdist sends them between processes
        assert gap <= tolerance, f"{label} max |difference| {gap:.2e} is above the tolerance {tolerance:.2g}"
        return gap

    return check


def pytest_addoption(parser):
    parser.addoption(
        "--parity-record",
        metavar="FILE",
        help="merge the gaps the `parity` fixture measured in this run into FILE (JSON, per backend); "
        "tests/helpers/parity_table.py makes docs/testing.md's gap table from tests/parity_gaps.json. "
        "Write --parity-record=FILE: after a space, an existing FILE is also taken for a test path",
    )


def pytest_terminal_summary(terminalreporter, config):
    """Every gap the `parity` fixture measured, with its tolerance (and into --parity-record's file)."""
    gaps = [
        (report.nodeid, *value)
        for outcome in ("passed", "failed")
        for report in terminalreporter.stats.get(outcome, [])
        if report.when == "call"
        for name, value in report.user_properties
        if name == "parity_gap"
    ]
    if config.getoption("parity_record") and gaps and not hasattr(config, "workerinput"):  # xdist: once
        from helpers.parity_table import merge_record

        merge_record(config.getoption("parity_record"), keras.backend.backend(), gaps)
    rows = [
        f"{gap:9.2e} (tolerance {tolerance:.2g})  {nodeid}{f' [{label}]' if label else ''}"
        for nodeid, label, gap, tolerance in gaps
    ]
    if rows:
        terminalreporter.write_sep("-", "parity gaps: max |difference|")
        for row in sorted(rows, key=lambda row: row.split("  ", 1)[1]):
            terminalreporter.write_line(row)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


def _skip_reason(report: pytest.TestReport) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip of a test that EXPECTED_SKIPS does not name for this backend fails: the set-up should run it."""
    report = yield
    backend = keras.backend.backend()
    if (
        report.skipped
        and not hasattr(report, "wasxfail")
        and backend not in EXPECTED_SKIPS.get(report.nodeid, ())
    ):
        report.outcome = "failed"
        report.longrepr = (
            f"unexpected skip on {backend}: {_skip_reason(report)!r}. The test set-up "
            '(pip install -e ".[test]") should run this test: install what it needs, or fix the test '
            "(tests/conftest.py: EXPECTED_SKIPS names the tests that may skip, by node id and backend)."
        )
    return report


def pytest_sessionfinish(session, exitstatus):
    """No tests collected is an error (exit 1), never pytest's quiet exit status 5."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("no tests were collected: check the paths, -k and -m", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
