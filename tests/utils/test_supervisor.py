"""`keras_vit.utils.supervisor`: a multi-process run's process outlives the native aborts of its training.

Two supervised stand-ins for the training processes (`tests/helpers/supervised_worker.py`: the real
agreement, then a "collective" connection that ends the process as gloo does when the partner
dies: a C++ message and SIGABRT, or the driver's lost-connection error). Whichever process dies,
at any moment of the collective, the other ends with one `keras-vit: error:` line naming the dead
process (its index, pid and host), and nothing of the abort; a supervisor's training process dies
with it. The real run (`keras-vit train`, JAX) is tests/training/test_multi_process.py's.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import HELPERS, subprocess_env

from keras_vit.utils import supervisor

WORKER = HELPERS / "supervised_worker.py"
SECONDS = 60  # each process ends within this (the supervisor's own wait is 5 s)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _pair(how: str = "abort", sigint_ignored: bool = False) -> list[subprocess.Popen]:
    """Processes 0 and 1, each `supervisor.run` of the stand-in; each prints `training PID` once joined.
    Each has a process group of its own, as a command started from a terminal (`sigint_ignored`: with
    SIGINT ignored, as a script's background job)."""
    address, port = f"localhost:{_free_port()}", _free_port()
    code = (
        "import sys; from keras_vit.utils import supervisor; worker = sys.argv.pop(1); "
        "sys.exit(supervisor.run(sys.argv[1:], int(sys.argv[2]), program=[sys.executable, worker]))"
    )
    return [
        subprocess.Popen(
            [sys.executable, "-c", code, str(WORKER), address, str(index), str(port), how],
            env=subprocess_env(KERAS_BACKEND="jax"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None,
        )
        for index in (0, 1)
    ]


def _training_pids(processes: list[subprocess.Popen]) -> list[int]:
    """The stand-ins' pids, once both are in their collective."""
    pids = []
    for process in processes:
        line = process.stdout.readline()
        assert line.startswith("training "), (
            line,
            process.stderr.read() if process.poll() is not None else "",
        )
        pids.append(int(line.split()[1]))
    return pids


def _end(processes: list[subprocess.Popen]) -> list[tuple[int, str]]:
    started, ends = time.monotonic(), []
    try:
        for process in processes:
            _, stderr = process.communicate(timeout=max(SECONDS - (time.monotonic() - started), 1))
            ends.append((process.returncode, stderr))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return ends


def _gone(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["abort", "fail"])
@pytest.mark.parametrize("victim", [0, 1])
def test_a_partner_killed_stops_the_other_with_one_line_naming_it(victim, how):
    """The victim's supervisor SIGKILLed: its training process dies with it; the survivor's training
    ends in its "collective" (an abort or an error), and its supervisor prints one line instead."""
    processes = _pair(how)
    pids = _training_pids(processes)
    processes[victim].kill()
    (status, stderr), _ = _end([processes[1 - victim], processes[victim]])
    assert _gone(pids[victim]), "the victim's training process outlived its supervisor"
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert status == 1 and len(errors) == 1, stderr
    assert errors[0].startswith(f"keras-vit: error: process {victim} (pid {processes[victim].pid} on ")
    assert "stopped before the run ended" in errors[0] and "last complete backup is kept" in errors[0]
    assert "terminate called" not in stderr and "gloo" not in stderr and "Another process" not in stderr


def test_a_killed_training_process_is_named_by_both(tmp_path):
    """The training process itself SIGKILLed (as by the kernel's out-of-memory killer): its supervisor
    says so, and the partner names that process."""
    processes = _pair()
    pids = _training_pids(processes)
    os.kill(pids[1], signal.SIGKILL)
    (survivor_status, survivor), (victim_status, victim) = _end(processes)
    assert victim_status == 128 + signal.SIGKILL
    assert [line for line in victim.splitlines() if "error:" in line] == [
        f"keras-vit: error: the training process of process 1 (pid {pids[1]}) was killed (SIGKILL; out of "
        "memory?). The last complete backup is kept: start every process again with the same arguments "
        "to resume."
    ]
    errors = [line for line in survivor.splitlines() if "error:" in line]
    assert survivor_status == 1 and len(errors) == 1 and "process 1 (pid " in errors[0], survivor


def test_sigterm_reaches_the_training_process_and_ends_the_supervisor_as_it():
    processes = _pair()
    pids = _training_pids(processes)
    processes[0].terminate()
    (first, _), (second, survivor) = _end(processes)
    assert first == -signal.SIGTERM and _gone(pids[0])
    assert second == 1 and "keras-vit: error: process 0 (pid " in survivor


@pytest.mark.parametrize("to", ["pid", "group", "background-pid"])
def test_sigint_stops_the_run_as_sigterm_does(to):
    """SIGINT to the supervisor's pid alone (`kill -INT PID`; also when the command started with
    SIGINT ignored, as a script's `keras-vit train ... &`), or to its process group (a terminal's
    Ctrl-C), reaches the training process once: it stops as interrupted (status 130), the supervisor
    with it, and the partner names process 0."""
    processes = _pair(sigint_ignored=to == "background-pid")
    pids = _training_pids(processes)
    if to != "group":
        os.kill(processes[0].pid, signal.SIGINT)
    else:
        os.killpg(processes[0].pid, signal.SIGINT)
    (first, stderr), (second, survivor) = _end(processes)
    assert first == 130 and _gone(pids[0]), stderr
    assert stderr.count("keras-vit: interrupted") == 1, stderr
    assert second == 1 and "keras-vit: error: process 0 (pid " in survivor


def test_a_partner_that_finished_first_is_no_news():
    """Process 1 ends well and exits while process 0 still works: its `done` reaches process 0 before
    its connection closes, and both end with status 0, without a word."""
    processes = _pair("finish")
    _training_pids(processes)
    for status, stderr in _end(processes):
        assert status == 0 and "error:" not in stderr, stderr


def test_partner_news():
    """`done` is no news; a closed connection names the partner; `lost K` names process K."""
    for said, news in [(b"done\n", None), (b"", 1), (b"lost 2\n", 2), (b"lo", 1), (b"lost x\ndone\n", None)]:
        ours, theirs = socket.socketpair()
        with ours:
            theirs.sendall(said)
            theirs.close()
            assert supervisor.partner_news(ours, 1) == news
