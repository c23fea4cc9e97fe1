"""Multi-process training on JAX through the driver (`keras.distribution.initialize`).

Two processes on localhost, each with 2 host CPU devices and joined by the driver (process 0:
`training.train` with the `coordinator`, `num_processes`, `process_id` options, in
`tests/helpers/backend_training_worker.py` with TensorFlow blocked; process 1: `keras-vit train`
with Keras's `KERAS_DISTRIBUTION_*` variables), train the digits data or model parallel over
the 4 devices: every step's loss, the held-out accuracy and loss must be those of one process
with 4 devices at the same global batch, and only process 0 writes the run's files. The input
split and the bad flags are checked in this process or before the backend is imported.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import HELPERS, backup_epoch, keras_vit_train_on_jax, subprocess_env

from keras_vit.data import pyinput
from keras_vit.training import options

WORKER = HELPERS / "backend_training_worker.py"
TIMEOUT = 600
TOLERANCE = 1e-5
# The main job's model at 16 px, the digits and the from-scratch recipe (AdamW, mixup, stochastic
# depth) for 4 one-step epochs: the per-epoch history is every step's loss.
RUN = {
    "model": "vit_digits",
    "image_size": 16,
    "batch_size": 16,
    "steps": 4,
    "steps_per_epoch": 1,
    "verbose": 0,
}


def _free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return f"localhost:{probe.getsockname()[1]}"


def _start(
    arguments: dict, folder: Path, devices: int, command_line: bool = False, slow: bool = False, **env
) -> subprocess.Popen:
    """`training.train(**arguments)` in the TensorFlow-blocked worker (its summary in `folder/out.json`;
    `slow`: 0.3 s more per step), or with `command_line` the same as `keras-vit train` flags."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "arguments.json").write_text(json.dumps(arguments))
    command = [str(WORKER), str(folder / "arguments.json"), str(folder / "out.json"), *(["slow"] * slow)]
    if command_line:
        flags = [[f"--{name.replace('_', '-')}", str(value)] for name, value in arguments.items()]
        command = ["-m", "keras_vit.cli", "train", *(word for flag in flags for word in flag)]
    return subprocess.Popen(
        [sys.executable, *command],
        env=subprocess_env(
            KERAS_BACKEND="jax", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **env
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _logs(processes: list[subprocess.Popen]) -> list[str]:
    """Each process's output once all have ended (all killed if one overruns)."""
    try:
        return [process.communicate(timeout=TIMEOUT)[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _two_processes(arguments: dict, folder: Path) -> list[subprocess.Popen]:
    """Processes 0 and 1 of a run, 2 devices each: 0 `training.train` joined by the options,
    1 `keras-vit train` joined by Keras's variables."""
    address = _free_address()
    return [
        _start(
            {**arguments, "coordinator": address, "num_processes": 2, "process_id": 0},
            folder / "process-0",
            devices=2,
        ),
        _start(
            arguments,
            folder / "process-1",
            devices=2,
            command_line=True,
            KERAS_DISTRIBUTION_JOB_ADDRESSES=address,
            KERAS_DISTRIBUTION_NUM_PROCESSES="2",
            KERAS_DISTRIBUTION_PROCESS_ID="1",
        ),
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, mesh",
    [
        ({}, {"shape": [4], "axis_names": ["batch"]}),
        ({"model_parallel": 2}, {"shape": [2, 2], "axis_names": ["batch", "model"]}),
    ],
    ids=["data-parallel", "model-parallel"],
)
def test_two_processes_train_as_one_process_of_the_same_devices(extra, mesh, tmp_path):
    """Per-step losses and held-out metrics equal one 4-device process's; process 0 alone writes.
    Model parallel: each process holds one replica split over its 2 devices."""
    one_dir, two_dir = tmp_path / "one" / "run", tmp_path / "two" / "run"
    started = [
        _start({**RUN, **extra, "output_dir": str(one_dir)}, tmp_path / "one", devices=4),
        *_two_processes({**RUN, **extra, "output_dir": str(two_dir)}, tmp_path),
    ]
    for process, log in zip(started, _logs(started), strict=True):
        assert process.returncode == 0, log[-3000:]
    one, chief = (json.loads((tmp_path / name / "out.json").read_text()) for name in ("one", "process-0"))
    assert len(one["history"]["loss"]) == 4 and one["mesh"] == mesh
    np.testing.assert_allclose(chief["history"]["loss"], one["history"]["loss"], rtol=0, atol=TOLERANCE)
    assert chief["tensorflow_import_attempts"] == []
    assert sorted(os.listdir(two_dir)) == ["labels.txt", "model.keras", "report.json"]  # no worker files
    reference = json.loads((one_dir / "report.json").read_text())
    report = json.loads((two_dir / "report.json").read_text())
    assert (report["mesh"], report["processes"], len(report["devices"])) == (mesh, 2, 4)
    assert report["replicas"] == reference["replicas"] and "processes" not in reference
    assert report["test_examples"] == reference["test_examples"]
    assert abs(report["accuracy"] - reference["accuracy"]) <= TOLERANCE
    assert abs(report["loss"] - reference["loss"]) <= TOLERANCE


@pytest.mark.slow
def test_two_processes_killed_after_an_epoch_resume_from_their_backups(tmp_path):
    """Both processes SIGKILLed once each has backed up the same epoch, then started again: each
    restores its own backup (process 1's in backup/worker-1) and the run ends as one 4-device process's."""
    one_dir, two_dir = tmp_path / "one" / "run", tmp_path / "two" / "run"
    address = _free_address()
    reference = _start({**RUN, "output_dir": str(one_dir)}, tmp_path / "one", devices=4)

    def pair(slow: bool) -> list[subprocess.Popen]:
        return [
            _start(
                {
                    **RUN,
                    "output_dir": str(two_dir),
                    "coordinator": address,
                    "num_processes": 2,
                    "process_id": index,
                },
                tmp_path / f"process-{index}",
                devices=2,
                slow=slow,
            )
            for index in (0, 1)
        ]

    killed, backups = pair(slow=True), [two_dir / "backup", two_dir / "backup" / "worker-1"]
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (1 <= backup_epoch(backups[0]) == backup_epoch(backups[1]) < 4):
            assert all(process.poll() is None for process in killed) and time.monotonic() < deadline
            time.sleep(0.02)
        for process in killed:
            process.kill()
    finally:
        _logs(killed)
    killed_at = backup_epoch(backups[0])
    assert killed_at == backup_epoch(backups[1]) and not (two_dir / "model.keras").exists()
    resumed = pair(slow=False)
    for process, log in zip([reference, *resumed], _logs([reference, *resumed]), strict=True):
        assert process.returncode == 0, log[-3000:]
    one, chief = (json.loads((tmp_path / name / "out.json").read_text()) for name in ("one", "process-0"))
    assert chief["resumed_from_epoch"] == killed_at and one["resumed_from_epoch"] == 0
    np.testing.assert_allclose(chief["history"]["loss"], one["history"]["loss"], rtol=0, atol=TOLERANCE)
    assert abs(chief["accuracy"] - one["accuracy"]) <= TOLERANCE
    assert sorted(os.listdir(two_dir)) == ["labels.txt", "model.keras", "report.json"]


@pytest.mark.slow
def test_a_model_replica_split_between_processes_is_refused(tmp_path):
    """model_parallel=4 over two processes of 2 devices: one clear error in each, nothing written. Each
    names the refusal, or (a process that had not met it within the supervisor's few seconds, on a
    loaded machine) says its partner stopped with an error of its own; at least one names it."""
    started = _two_processes({**RUN, "model_parallel": 4, "output_dir": str(tmp_path / "run")}, tmp_path)
    refusal = "model_parallel=4 would split each model replica between processes"
    logs = _logs(started)
    for process, log in zip(started, logs, strict=True):
        assert process.returncode != 0
        assert refusal in log or "of this multi-process run stopped before the run ended" in log, log[-3000:]
    assert any(refusal in log for log in logs), logs[0][-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_processes_whose_backups_disagree_stop_with_one_clear_error(tmp_path):
    """Before training, the processes compare the epoch their backups resume after
    (`same_in_every_process`): processes stopped at different moments do not train out of step."""
    address = _free_address()
    code = (
        "import sys; from keras_vit.training.options import Processes; "
        "from keras_vit.training.runs import keras_distribution as distribution; "
        "index = int(sys.argv[1]); distribution.join_processes(Processes(sys.argv[2], 2, index)); "
        "distribution.same_in_every_process('the epoch their backups resume after', index + 3)"
    )
    started = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(index), address],
            env=subprocess_env(KERAS_BACKEND="jax"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for index in (0, 1)
    ]
    for process, log in zip(started, _logs(started), strict=True):
        assert process.returncode != 0
        assert "disagree on the epoch their backups resume after: [3, 4] (by process)" in log, log[-3000:]


# Every process ends within this (the processes wait --join-timeout for each other).
AGREEMENT_SECONDS = 60
JOIN = {
    "model": "vit_digits",
    "image_size": 16,
    "batch_size": 16,
    "steps": 4,
    "verbose": 0,
    "join_timeout": 5,
}


def _cli(arguments: dict, cwd: Path) -> subprocess.Popen:
    """`keras-vit train` with `arguments` as flags, on JAX with 2 CPU devices, in `cwd`."""
    flags = [
        word for name, value in arguments.items() for word in (f"--{name.replace('_', '-')}", str(value))
    ]
    return keras_vit_train_on_jax(flags, cwd)


def _errors_within(processes: list[subprocess.Popen], seconds: float) -> list[str]:
    """Each process's one `keras-vit: error:` line; every process must end with status 1 within `seconds`."""
    started, lines = time.monotonic(), []
    try:
        for process in processes:
            _, stderr = process.communicate(timeout=max(seconds - (time.monotonic() - started), 1))
            errors = [line for line in stderr.splitlines() if "error:" in line]
            assert process.returncode == 1 and len(errors) == 1, stderr[-3000:]
            assert errors[0].startswith("keras-vit: error: ") and "Traceback" not in stderr
            lines.append(errors[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return lines


def _pair(first: dict, second: dict, cwd: Path) -> list[subprocess.Popen]:
    coordinator = {"coordinator": _free_address(), "num_processes": 2}
    return [
        _cli({**JOIN, "output_dir": "run", **coordinator, "process_id": 0, **first}, cwd),
        _cli({**JOIN, "output_dir": "run", **coordinator, "process_id": 1, **second}, cwd),
    ]


def test_processes_started_with_different_seeds_stop_naming_the_seed(tmp_path):
    lines = _errors_within(_pair({}, {"seed": 3}, tmp_path), AGREEMENT_SECONDS)
    for line in lines:
        assert "different arguments: --seed: 0 (process 0), 3 (process 1)" in line
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "second, named",
    [
        ({"batch_size": 32}, "--batch-size: 16 (process 0), 32 (process 1)"),
        ({"steps": 8}, "--steps: 4 (process 0), 8 (process 1)"),
        ({"output_dir": "other"}, "--output-dir: "),
        ({"process_id": 0}, None),
    ],
    ids=["batch-size", "steps", "output-dir", "process-id-twice"],
)
def test_processes_that_disagree_all_stop_with_one_line_naming_it(second, named, tmp_path):
    lines = _errors_within(_pair({}, second, tmp_path), AGREEMENT_SECONDS)
    if named is not None:
        assert all(named in line for line in lines), lines
    else:  # the process 0 that comes second cannot take the port; the first waits for a process 1 in vain
        waited, refused = sorted(lines, key=lambda line: "given twice?" in line)
        assert "did not join within 5 s" in waited and "--process-id 0 given twice?" in refused
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("process_id", [0, 1])
def test_a_process_without_partners_stops_within_its_wait(process_id, tmp_path):
    """Process 0 alone: its partner never came; process 1 alone: nobody listens at the coordinator."""
    alone = _cli(
        {
            **JOIN,
            "output_dir": "run",
            "coordinator": _free_address(),
            "num_processes": 2,
            "process_id": process_id,
        },
        tmp_path,
    )
    (line,) = _errors_within([alone], AGREEMENT_SECONDS)
    assert (
        "did not join within 5 s" if process_id == 0 else "Cannot reach process 0 at the coordinator"
    ) in line
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_partner_killed_mid_run_stops_the_other_with_one_line(victim, tmp_path):
    """Process 0 or 1 SIGKILLed after the first backup: the other stops within the wait, its backup
    intact, with one `keras-vit: error:` line naming the dead process, whether JAX's coordination
    client or gloo would have aborted it (the training runs in a child of `keras_vit.utils.supervisor`)."""
    started = _pair({"steps": 400, "steps_per_epoch": 10}, {"steps": 400, "steps_per_epoch": 10}, tmp_path)
    backup = tmp_path / "run" / "backup"
    try:
        deadline = time.monotonic() + TIMEOUT
        while backup_epoch(backup) < 1:
            assert all(process.poll() is None for process in started) and time.monotonic() < deadline
            time.sleep(0.05)
        started[victim].kill()
        started[victim].wait()
        survivor = started[1 - victim]
        _, stderr = survivor.communicate(timeout=AGREEMENT_SECONDS)  # ends within the wait: no hang
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert survivor.returncode == 1 and len(errors) == 1, stderr[-3000:]
    assert errors[0].startswith(f"keras-vit: error: process {victim} (pid {started[victim].pid} on ")
    assert "stopped before the run ended" in errors[0] and "backup is kept" in errors[0]
    assert not any(sign in stderr for sign in ("Traceback", "stack trace", "terminate called")), stderr[
        -3000:
    ]
    assert backup_epoch(backup) >= 1  # the last complete backup, verified


@pytest.mark.parametrize("mixup_alpha", [0.0, 0.2])
def test_the_processes_rows_make_up_the_global_batch(mixup_alpha):
    """Each process prepares its rows of a global batch (with mixup, blended with the rows they mirror)."""
    source = pyinput.load_digits()[0]
    arguments = dict(image_size=16, batch_size=8, seed=3, steps_per_epoch=5, mixup_alpha=mixup_alpha)
    whole = pyinput.train_pipeline(source, **arguments).batch(2, 3)
    parts = [
        pyinput.train_pipeline(source, **arguments, rows=rows).batch(2, 3)
        for rows in (slice(0, 4), slice(4, 8))
    ]
    for position in (0, 1):  # images, labels
        np.testing.assert_array_equal(np.concatenate([part[position] for part in parts]), whole[position])


@pytest.mark.parametrize(
    "backend, flags, env, message",
    [
        (
            "jax",
            ["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "2"],
            {},
            "out of range",
        ),
        ("jax", ["--num-processes", "0"], {}, "--num-processes"),
        ("jax", ["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], {}, "HOST:PORT"),
        (
            "jax",
            ["--coordinator", "http://localhost:1234", "--num-processes", "2", "--process-id", "0"],
            {},
            "HOST:PORT",
        ),
        ("jax", ["--coordinator", "localhost:1234"], {}, "give --num-processes, --process-id too"),
        (
            "jax",
            [],
            {
                "KERAS_DISTRIBUTION_JOB_ADDRESSES": "localhost:1234",
                "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
                "KERAS_DISTRIBUTION_PROCESS_ID": "5",
            },
            "$KERAS_DISTRIBUTION_PROCESS_ID 5 is out of range",
        ),
        (
            "torch",
            ["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "0"],
            {},
            "needs the JAX backend",
        ),
        (
            "tensorflow",
            ["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "0"],
            {},
            "TF_CONFIG",
        ),
    ],
    ids=[
        "id-out-of-range",
        "no-processes",
        "no-port",
        "scheme",
        "not-together",
        "variable-out-of-range",
        "torch",
        "tensorflow",
    ],
)
def test_a_multi_process_run_that_cannot_start_is_one_error_and_writes_nothing(
    backend, flags, env, message, tmp_path
):
    done = subprocess.run(
        [sys.executable, "-m", "keras_vit.cli", "train", *flags, "--output-dir", "run"],
        env=subprocess_env(KERAS_BACKEND=backend, **env),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and os.listdir(tmp_path) == []


def test_the_options_read_keras_variables_and_refuse_other_backends(monkeypatch):
    """`RunOptions.processes`: the options, else Keras's variables; off JAX one error before anything runs."""
    monkeypatch.setattr(options, "keras_backend", lambda: "jax")
    assert options.RunOptions().processes() is None
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "10.0.0.1:1234")
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "4")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "3")
    assert options.RunOptions().processes() == options.Processes("10.0.0.1:1234", 4, 3)
    assert options.RunOptions(process_id=0).processes() == options.Processes("10.0.0.1:1234", 4, 0)
    monkeypatch.setattr(options, "keras_backend", lambda: "torch")
    named = "($KERAS_DISTRIBUTION_JOB_ADDRESSES, $KERAS_DISTRIBUTION_NUM_PROCESSES, --process-id)"
    with pytest.raises(ValueError, match=re.escape(f"{named} needs the JAX backend")):
        options.RunOptions(process_id=0).check()
