"""How a multi-process `keras-vit train` ends when one process dies (issue 39).

    python benchmarks/partner_death.py VICTIM,DELAY,SIGNAL,TARGET ...

Per case: two `keras-vit train` processes (JAX, 2 CPU devices each, `vit_digits` at 16 px) on
localhost; once the first epoch is backed up, after DELAY seconds, SIGNAL (e.g. SIGKILL, SIGTERM)
goes to process VICTIM's `keras-vit` process (TARGET `parent`) or its training process (`child`).
Prints one JSON line per case: the survivor's exit status, its seconds to end, its error lines
and whether the one line names the victim, and whether a stack trace or traceback leaked.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import backup_epoch, keras_vit_train_on_jax  # noqa: E402


def _start(index: int, address: str, cwd: str) -> subprocess.Popen:
    flags = [
        "--model", "vit_digits", "--image-size", "16", "--batch-size", "16", "--steps", "400",
        "--steps-per-epoch", "10", "--verbose", "0", "--join-timeout", "10", "--output-dir", "run",
        "--coordinator", address, "--num-processes", "2", "--process-id", str(index),
    ]  # fmt: skip
    return keras_vit_train_on_jax(flags, cwd)


def case(victim: int, delay: float, number: int, target: str) -> dict:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        address = f"localhost:{probe.getsockname()[1]}"
    cwd = tempfile.mkdtemp(prefix="partner-death-")
    processes = [_start(0, address, cwd), _start(1, address, cwd)]
    backup = os.path.join(cwd, "run", "backup")
    while backup_epoch(backup) < 1:
        assert all(process.poll() is None for process in processes), [p.communicate() for p in processes]
        time.sleep(0.05)
    time.sleep(delay)
    pid = processes[victim].pid
    if target == "child":
        pid = int(subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()[0])
    os.kill(pid, number)
    killed, survivor = time.monotonic(), processes[1 - victim]
    try:
        _, stderr = survivor.communicate(timeout=90)
        hang = False
    except subprocess.TimeoutExpired:
        survivor.kill()
        _, stderr = survivor.communicate()
        hang = True
    seconds = time.monotonic() - killed
    processes[victim].communicate(timeout=60)
    lines = [line for line in stderr.splitlines() if "error:" in line]
    return {
        "case": [victim, delay, signal.Signals(number).name, target],
        "survivor_status": survivor.returncode,
        "hang": hang,
        "seconds": round(seconds, 1),
        "backup_epoch": backup_epoch(backup),
        "error_lines": len(lines),
        "names_victim": len(lines) == 1 and lines[0].startswith(f"keras-vit: error: process {victim} ("),
        "leaked": any(sign in stderr for sign in ("Traceback", "stack trace", "terminate called")),
    }


if __name__ == "__main__":
    for argument in sys.argv[1:]:
        victim, delay, name, target = argument.split(",")
        print(json.dumps(case(int(victim), float(delay), getattr(signal, name), target)), flush=True)
