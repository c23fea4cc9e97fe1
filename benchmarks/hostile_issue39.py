"""Issue 39's cases re-run as a hostile user would, on the current code: one outcome per case.

Method: every numbered case 1-17 of issue 39, the three older silent-wrong cases it names (NaN
through `from_arrays` and `serving_preprocessed`, a transposed square kernel in a save_pretrained
folder) and two leftovers (SIGINT to a multi-process supervisor's pid, `--overwrite` and a user's
files under `logs/` on TensorFlow) are tried in fresh tmp folders: the CLI through `keras-vit`
subprocesses (multi-process cases: two `KERAS_BACKEND=jax keras-vit train --coordinator
127.0.0.1:PORT --num-processes 2 --process-id I` processes, 1 CPU device each), the Python API
through `python -c` subprocesses. Every process runs under a hard timeout (its process group is
killed past it: a hang is recorded, not suffered). Files planted beside a run are hashed before
and after. Each case gets one outcome class:

  refused (a clear error) | ok (as documented) | files lost | silent wrong | crash (rc 134 or a
  traceback or C++ stack trace) | hang (timeout)

with the exit codes, the first error line, the seconds and whether planted files changed.
Models and data are tiny (`vit_digits` at 16 px, a few steps): the machine may be shared.

    python benchmarks/hostile_issue39.py [--only 1,4,17] [--json OUT.json]

prints one JSON line per case and, with --json, writes them all (with the machine and commit).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_model

REPO = Path(__file__).resolve().parents[1]
KERAS_VIT = [sys.executable, "-m", "keras_vit.cli"]
TINY = ["--model", "vit_digits", "--image-size", "16", "--batch-size", "16", "--verbose", "0"]
SHORT = [*TINY, "--steps", "2", "--steps-per-epoch", "1"]
TIMEOUT = 120  # every process; a multi-process mismatch must end within 60 s (issue 39)
CRASH_SIGNS = ("Traceback (most recent call last)", "terminate called", "stack trace", "Fatal Python error")
OUTCOMES = ("refused", "ok", "refused, unclear error", "files lost", "silent wrong", "crash", "hang")


def env(backend: str = "jax", **extra) -> dict:
    """The user's environment, with this checkout first on the path and offline hub access."""
    base = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KERAS_BACKEND")}
    base.update(
        {
            "KERAS_BACKEND": backend,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
            **extra,
        }
    )
    return base


def start(command: list[str], cwd, environment: dict) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: killed whole past the timeout
    )


def finish(process: subprocess.Popen, timeout: float, started: float) -> dict:
    """Wait for `process` (its group SIGKILLed past `timeout` seconds from `started`)."""
    try:
        out, err = process.communicate(timeout=max(1.0, started + timeout - time.monotonic()))
        hung = False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        hung = True
    return {
        "rc": process.returncode,
        "hang": hung,
        "seconds": round(time.monotonic() - started, 1),
        "stdout": out,
        "stderr": err,
    }


def run(command: list[str], cwd, environment: dict, timeout: float = TIMEOUT) -> dict:
    started = time.monotonic()
    return finish(start(command, cwd, environment), timeout, started)


def first_error(text: str) -> str | None:
    for line in text.splitlines():
        if "error:" in line.lower() or re.match(r"^(\w*(Error|Exception)\b|REFUSED|\S+ REFUSED)", line):
            return line.strip()[:300]
    return None


def crashed(result: dict) -> bool:
    return result["rc"] in (134, -6) or any(sign in result["stderr"] for sign in CRASH_SIGNS)


def hashes(paths) -> dict:
    """SHA-256 (or 'missing', or 'link -> target') of every file under `paths`."""
    found = {}
    for root in map(Path, paths):
        items = [root] if not root.is_dir() or root.is_symlink() else sorted(root.rglob("*"))
        for path in items:
            if path.is_symlink():
                found[str(path)] = f"link -> {os.readlink(path)}"
            elif path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def python(code: str, cwd, backend: str = "jax", timeout: float = TIMEOUT, **extra) -> dict:
    return run([sys.executable, "-c", code], cwd, env(backend, **extra), timeout)


def verdict(
    case: str,
    done: str,
    results: list[dict],
    expect: str,
    passed: bool,
    planted_before: dict | None = None,
    planted_after: dict | None = None,
    note: str = "",
) -> dict:
    """One case's record: `expect` is "refused" or "ok"; `passed` whether the documented behaviour held."""
    changed = planted_before is not None and planted_before != planted_after
    if any(result["hang"] for result in results):
        outcome = "hang"
    elif changed:
        outcome = "files lost"
    elif any(crashed(result) for result in results):
        outcome = "crash"
    elif passed:
        outcome = expect
    else:
        outcome = "silent wrong"
    errors = [first_error(result["stderr"] + "\n" + result["stdout"]) for result in results]
    return {
        "case": case,
        "done": done,
        "outcome": outcome,
        "rc": [result["rc"] for result in results],
        "seconds": [result["seconds"] for result in results],
        "first_error": next((error for error in errors if error), None),
        "planted_changed": changed,
        "note": note,
    }


def refused(result: dict, *words: str) -> bool:
    """A non-zero exit with one `error:` line naming every word (case-insensitive)."""
    text = result["stderr"] + result["stdout"]
    lines = [line for line in text.splitlines() if "error" in line.lower()]
    return (
        result["rc"] not in (0, None)
        and bool(lines)
        and all(any(word.lower() in line.lower() for line in lines) for word in words)
    )


def train(cwd, *flags: str, backend: str = "jax", timeout: float = TIMEOUT, **extra) -> dict:
    return run([*KERAS_VIT, "train", *flags], cwd, env(backend, **extra), timeout)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pair(cwd, flags0: list[str], flags1: list[str], timeout: float = TIMEOUT) -> list[dict]:
    """Processes 0 and 1 of a two-process JAX run (`flags0`, `flags1` after the shared ones)."""
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    processes = [
        start([*KERAS_VIT, "train", "--coordinator", address, "--num-processes", "2", *flags], cwd, env())
        for flags in (flags0, flags1)
    ]
    return [finish(process, timeout, started) for process in processes]


# A command as a non-interactive shell starts a background job: SIGINT ignored.
BACKGROUND = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.argv[1], sys.argv[1:])",
]
MP = [*TINY, "--steps", "4", "--steps-per-epoch", "2", "--join-timeout", "10"]


def mismatch(name: str, done: str, flags0: list[str], flags1: list[str], *named: str) -> dict:
    """A multi-process mismatch: both processes end within 60 s, each with one error line naming it."""
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        results = pair(tmp, flags0, flags1)
        ok = all(refused(result, *named) and result["seconds"] < 60 for result in results)
        lines = [
            sum(line.startswith("keras-vit: error:") for line in result["stderr"].splitlines())
            for result in results
        ]
        ok = ok and lines == [1, 1]
        wrote = sorted(str(p.relative_to(tmp)) for p in Path(tmp).rglob("*"))
        return verdict(
            name, done, results, "refused", ok, note=f"error lines per process {lines}; wrote {wrote}"
        )


# ---------------------------------------------------------------------------------------------- cases


def case_1a() -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        backup = Path(tmp, "run", "backup")
        backup.mkdir(parents=True)
        (backup / "settings.json").write_text('{"mine": true}')
        before = hashes([backup / "settings.json"])
        result = train(tmp, *SHORT, "--output-dir", "run")
        after = hashes([backup / "settings.json"])
        ok = (result["rc"] == 0 and Path(tmp, "run", "model.keras").exists()) or refused(result, "backup")
        return verdict(
            "1a",
            "a user's run/backup/settings.json, then a finished run into run/",
            [result],
            "ok" if result["rc"] == 0 else "refused",
            ok,
            before,
            after,
        )


def case_1b() -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        target = Path(tmp, "elsewhere")
        target.mkdir()
        (target / "notes.json").write_text("{}")
        (target / "epoch-000001.weights.h5").write_bytes(b"mine")
        (target / "state.json").write_text('{"mine": 1}')
        Path(tmp, "run").mkdir()
        Path(tmp, "run", "backup").symlink_to(target)
        before = hashes([target])
        result = train(tmp, *SHORT, "--output-dir", "run")
        after = hashes([target])
        return verdict(
            "1b",
            "run/backup -> ../elsewhere (holding .json and .weights.h5), then a run into run/",
            [result],
            "refused",
            refused(result, "backup"),
            before,
            after,
        )


def case_2() -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        precious = Path(tmp, "precious.txt")
        precious.write_text("the user's")
        Path(tmp, "run").mkdir()
        Path(tmp, "run", ".keras_vit-run.lock").symlink_to("../precious.txt")
        before = hashes([precious])
        result = train(tmp, *SHORT, "--output-dir", "run")
        after = hashes([precious])
        return verdict(
            "2",
            "run/.keras_vit-run.lock -> ../precious.txt, then a run into run/",
            [result],
            "refused",
            refused(result, "lock"),
            before,
            after,
        )


TINY_MODEL = (
    "import keras_vit\n"
    "config = keras_vit.ViTConfig('tiny', patch_size=8, hidden_size=32, depth=2, num_heads=2, mlp_dim=64,"
    " image_size=16)\n"
    "model = keras_vit.create_model(config, num_classes=3)\n"
)


def case_3() -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        folder = Path(tmp, "d")
        code = TINY_MODEL + (
            "keras_vit.save_pretrained(model, 'd')\n"
            "open('d/README.md', 'w').write('my own notes')\n"
            "try:\n"
            "    keras_vit.save_pretrained(model, 'd', overwrite=True)\n"
            "    print('ACCEPTED')\n"
            "except FileExistsError as error:\n"
            "    print('REFUSED', error)\n"
        )
        result = python(code, tmp)
        readme = (folder / "README.md").read_text() if (folder / "README.md").exists() else None
        ok = "REFUSED" in result["stdout"] and "README.md" in result["stdout"]
        return verdict(
            "3",
            "save_pretrained(model, d) ; user writes d/README.md ; save_pretrained(..., overwrite=True)",
            [result],
            "refused",
            ok,
            {"README.md": "my own notes"},
            {"README.md": readme},
        )


_RUN = [*MP, "--output-dir", "run"]
# Cases 4-7, multi-process mismatches (`mismatch`): what differs, process 0's and process 1's flags, the
# word each error line names.
MISMATCHES = {
    "4": (
        "two processes, --output-dir a / --output-dir b",
        ["--process-id", "0", *MP, "--output-dir", "a"],
        ["--process-id", "1", *MP, "--output-dir", "b"],
        "output",
    ),
    "5": (
        "two processes, --batch-size 16 / 32",
        ["--process-id", "0", *_RUN],
        ["--process-id", "1", *_RUN, "--batch-size", "32"],
        "batch",
    ),
    "6": (
        "two processes, --steps 4 / 6",
        ["--process-id", "0", *_RUN],
        ["--process-id", "1", *_RUN, "--steps", "6"],
        "steps",
    ),
    "7": (
        "two processes, both --process-id 0",
        ["--process-id", "0", *_RUN],
        ["--process-id", "0", *_RUN],
        "process",
    ),
}


def training_pair(cwd: str, prefix: list[str] = ()) -> tuple[list[subprocess.Popen], Path]:
    """Two processes of a 400-step multi-process run into `cwd/run` (each command after `prefix`),
    returned once the first backup is written (or one ended, or TIMEOUT), with that backup's state file."""
    address = f"127.0.0.1:{free_port()}"
    flags = [
        *TINY,
        "--steps",
        "400",
        "--steps-per-epoch",
        "10",
        "--join-timeout",
        "10",
        "--output-dir",
        "run",
    ]
    started = time.monotonic()
    processes = [
        start(
            [
                *prefix,
                *KERAS_VIT,
                "train",
                "--coordinator",
                address,
                "--num-processes",
                "2",
                "--process-id",
                str(index),
                *flags,
            ],
            cwd,
            env(),
        )
        for index in (0, 1)
    ]
    state = Path(cwd, "run", "backup", "state.json")
    while (
        not state.exists()
        and all(process.poll() is None for process in processes)
        and time.monotonic() - started < TIMEOUT
    ):
        time.sleep(0.1)
    return processes, state


def case_8a() -> dict:
    """A partner SIGKILLed after the first backup: the other ends in time, one line, backup intact."""
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        processes, state = training_pair(tmp)
        time.sleep(1.0)
        os.killpg(processes[1].pid, signal.SIGKILL)  # the whole process 1 (supervisor and child)
        killed = time.monotonic()
        survivor = finish(processes[0], 90, killed)
        victim = finish(processes[1], 10, killed)
        epoch = json.loads(state.read_text())["epoch"] if state.exists() else 0
        ok = refused(survivor, "process 1") and survivor["seconds"] < 60 and epoch >= 1
        return verdict(
            "8a",
            "two processes training; process 1's group SIGKILLed after the first backup",
            [survivor],
            "refused",
            ok,
            note=f"survivor ended {survivor['seconds']} s after the kill; backup epoch {epoch}; "
            f"victim rc {victim['rc']}",
        )


def case_8b() -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        address = f"127.0.0.1:{free_port()}"
        result = train(
            tmp,
            "--coordinator",
            address,
            "--num-processes",
            "2",
            "--process-id",
            "0",
            *TINY,
            "--steps",
            "2",
            "--output-dir",
            "run",
        )
        ok = refused(result, address) and result["seconds"] < 60
        return verdict("8b", "process 0 alone of 2 (default --join-timeout)", [result], "refused", ok)


def case_8c() -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        address = f"127.0.0.1:{free_port()}"  # nobody listens there
        result = train(
            tmp,
            "--coordinator",
            address,
            "--num-processes",
            "2",
            "--process-id",
            "1",
            *TINY,
            "--steps",
            "2",
            "--output-dir",
            "run",
        )
        ok = refused(result, address) and result["seconds"] < 60
        return verdict(
            "8c",
            "process 1 with an unreachable coordinator (default --join-timeout)",
            [result],
            "refused",
            ok,
        )


def case_9a() -> dict:
    flags = [*MP, "--output-dir", "run"]
    return mismatch(
        "9a",
        "two processes, --seed 0 / 1",
        ["--process-id", "0", *flags],
        ["--process-id", "1", *flags, "--seed", "1"],
        "seed",
    )


def case_9b() -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        result = train(
            tmp, "--coordinator", "http://127.0.0.1:1234", "--num-processes", "2", "--process-id", "0", *SHORT
        )
        return verdict(
            "9b",
            "--coordinator http://127.0.0.1:1234",
            [result],
            "refused",
            refused(result, "coordinator") and result["rc"] == 2,
        )


DISTRIBUTION = (
    "import time, numpy as np, keras, keras_vit\n"
    "from keras_vit.models.parallel import make_distribution\n"
    "def attempt(label, call):\n"
    "    started = time.monotonic()\n"
    "    try:\n"
    "        call()\n"
    "        print(label, 'ACCEPTED', round(time.monotonic() - started, 1))\n"
    "    except ValueError as error:\n"
    "        print(label, 'REFUSED', round(time.monotonic() - started, 1), str(error).splitlines()[0])\n"
    "devices = keras.distribution.list_devices()\n"
    "attempt('empty', lambda: make_distribution(devices=[]))\n"
    "attempt('twice', lambda: make_distribution(devices=[devices[0], devices[0]]))\n"
    "def fit(batch_size):\n"
    "    with make_distribution().scope():  # as its docstring says: build and fit in the scope\n"
    "        config = keras_vit.ViTConfig('tiny', 8, 32, 2, 2, 64, image_size=16)\n"
    "        model = keras_vit.create_model(config, num_classes=3)\n"
    "        model.compile('sgd', 'sparse_categorical_crossentropy')\n"
    "        x, y = np.zeros((5, 16, 16, 3), 'float32'), np.zeros(5, 'int32')\n"
    "        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)\n"
    "attempt('uneven', lambda: fit(3))\n"
    "attempt('last', lambda: fit(4))\n"
)


def case_10() -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        result = python(DISTRIBUTION, tmp, XLA_FLAGS="--xla_force_host_platform_device_count=2")
        lines = result["stdout"].splitlines()
        ours = [line for line in lines if not line.startswith("last ")]
        last = [line for line in lines if line.startswith("last ")]
        first = verdict(
            "10",
            "make_distribution(devices=[]), devices twice, fit 5 rows at batch 3 on 2 replicas (JAX)",
            [result],
            "refused",
            len(ours) == 3 and all("REFUSED" in line for line in ours),
            note=" | ".join(ours),
        )
        second = verdict(
            "10-last",
            "fit 5 rows at batch 4 on 2 replicas: the last batch (1 row) cannot be split (JAX)",
            [result],
            "refused",
            bool(last) and "REFUSED" in last[0] and "replicas" in last[0],
            note=" | ".join(last),
        )
        if second["outcome"] == "silent wrong" and last and "REFUSED" in last[0]:
            second["outcome"] = "refused, unclear error"  # a ValueError, but not one that names the batch
        return [first, second]


def image_folder(root: Path, link: bool, empty: bool) -> None:
    from PIL import Image

    for split in ("train", "test"):
        for name in ("cat", "dog"):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(4):
                pixels = (i * 40 + (name == "dog") * 100) % 256
                Image.new("RGB", (20, 20), (pixels, 0, 0)).save(folder / f"{i}.png")
        if link:
            (root / split / "kitten").symlink_to("cat")
        if empty:
            (root / split / "zebra").mkdir()


def case_11(kind: str, backend: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        image_folder(Path(tmp, "data"), link=kind == "link", empty=kind == "empty")
        before = hashes([Path(tmp, "data")])
        result = train(tmp, *SHORT, "--dataset", "data", "--output-dir", "run", backend=backend)
        after = hashes([Path(tmp, "data")])
        word = "kitten" if kind == "link" else "zebra"
        return verdict(
            f"11-{kind}-{backend}",
            f"image folder with a class folder {'kitten -> cat' if kind == 'link' else 'zebra/ empty'}"
            f" ({backend})",
            [result],
            "refused",
            refused(result, word),
            before,
            after,
        )


TAMPER = TINY_MODEL + (
    "import numpy as np\n"
    "from safetensors.numpy import load_file, save_file\n"
    "keras_vit.save_pretrained(model, 'd')\n"
    "tensors = load_file('d/model.safetensors')\n"
    "name = 'blocks.0.attn.proj.weight'\n"
    "tensors[name] = np.ascontiguousarray(tensors[name].T) if MODE == 'transpose' else tensors[name] * 1.01\n"
    "save_file(tensors, 'd/model.safetensors', metadata={'format': 'pt'})\n"
    "for path in ('d', 'd/model.safetensors'):\n"
    "    try:\n"
    "        keras_vit.load_weights(keras_vit.create_model(config, num_classes=3), path)\n"
    "        print(path, 'ACCEPTED')\n"
    "    except Exception as error:\n"
    "        print(path, 'REFUSED', type(error).__name__, str(error).splitlines()[0][:160])\n"
)


def case_tamper(name: str, mode: str, done: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        result = python(f"MODE = {mode!r}\n" + TAMPER, tmp)
        lines = result["stdout"].splitlines()
        ok = len(lines) == 2 and all("REFUSED ChecksumError" in line for line in lines)
        return verdict(name, done, [result], "refused", ok, note=" | ".join(lines))


NAN_ARRAYS = (
    "import numpy as np\n"
    "from keras_vit.data import {module}\n"
    "images = np.random.default_rng(0).uniform(-1, 1, (4, 16, 16, 3)).astype('float32')\n"
    "images[1, 3, 3, 0] = np.nan\n"
    "try:\n"
    "    {module}.from_arrays(images, np.array([0, 1, 0, 1]))\n"
    "    print('ACCEPTED')\n"
    "except ValueError as error:\n"
    "    print('REFUSED', str(error).splitlines()[0])\n"
)


def case_nan_arrays(module: str, backend: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        result = python(NAN_ARRAYS.format(module=module), tmp, backend=backend)
        ok = result["stdout"].startswith("REFUSED") and "NaN" in result["stdout"]
        return verdict(
            f"old-nan-{module}",
            f"one NaN pixel through data.{module}.from_arrays ({backend})",
            [result],
            "refused",
            ok,
            note=result["stdout"].strip()[:200],
        )


NAN_SERVING = TINY_MODEL.replace("num_classes=3)", "num_classes=3, classifier_activation=None)") + (
    "import numpy as np, tensorflow as tf\n"
    "from keras_vit.deploy.export import export_serving\n"
    "path = export_serving(model, 'served', top_k=3, warmup=False)\n"
    "signature = tf.saved_model.load(path).signatures['serving_preprocessed']\n"
    "try:\n"
    "    out = signature(pixels=tf.fill((1, 16, 16, 3), float('nan')))\n"
    "    print('ACCEPTED', {k: v.numpy().tolist() for k, v in out.items()})\n"
    "except Exception as error:\n"
    "    lines = str(getattr(error, 'message', error)).splitlines()\n"
    "    message = next((line for line in lines if 'NaN' in line), lines[0])[:200]\n"
    "    print('REFUSED', type(error).__name__, message)\n"
)


def case_nan_serving() -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        result = python(NAN_SERVING, tmp, backend="tensorflow", TF_CPP_MIN_LOG_LEVEL="3", timeout=240)
        ok = result["stdout"].startswith("REFUSED") and "NaN" in result["stdout"]
        return verdict(
            "old-nan-serving",
            "NaN pixels into an exported model's serving_preprocessed signature",
            [result],
            "refused",
            ok,
            note=result["stdout"].strip()[:240],
        )


def case_13() -> dict:
    """Tests never read the working folder: no test names README output folders without a tmp cwd."""
    started = time.monotonic()
    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        text = path.read_text()
        if "chdir(tmp_path" in text:  # the test works in a tmp folder: its relative paths are there
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if "tmp_path /" in line or "tmp_path/" in line:
                continue
            if re.search(
                r"""["'](vit_run|quick_check|vit_mpp|site)/?["']|Path\.cwd\(\)|os\.getcwd\(\)""", line
            ):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    # and the two tests the issue named, run with a finished vit_run/ planted in the working folder
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        shutil.copytree(
            REPO, tmp + "/clone", ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "site")
        )
        clone = Path(tmp, "clone")
        for folder in ("vit_run", "quick_check"):
            (clone / folder).mkdir()
            (clone / folder / "model.keras").write_bytes(b"a finished run")
            (clone / folder / "report.json").write_text('{"accuracy": 0.9}')
        before = hashes([clone / "vit_run", clone / "quick_check"])
        result = run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-n",
                "0",
                "-p",
                "no:randomly",
                "tests/test_inputs_honoured.py",
                "-k",
                "output_dir or without or default",
            ],
            clone,
            env("tensorflow", PYTHONPATH=str(clone), TF_CPP_MIN_LOG_LEVEL="3"),
            timeout=600,
        )
        after = hashes([clone / "vit_run", clone / "quick_check"])
    summary = (result["stdout"].strip().splitlines() or [""])[-1]
    ok = result["rc"] in (0, 5) and "failed" not in summary
    record = verdict(
        "13",
        "tests/test_inputs_honoured.py (-k output_dir/without/default) with vit_run/ planted in "
        "the clone; grep tests for the README's output folders and cwd reads",
        [result],
        "ok",
        ok and not offenders,
        before,
        after,
        note=f"pytest: {summary}; grep hits: {offenders[:6]}",
    )
    record["seconds"] = [round(time.monotonic() - started, 1)]
    return record


def case_14() -> dict:
    """tests/run_all.sh runs every section when each fails, and names them all at the end."""
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        fake = Path(tmp, "python")
        fake.write_text('#!/bin/sh\necho fake python "$@"\nexit 1\n')
        fake.chmod(0o755)
        environment = {**os.environ, "PATH": f"{tmp}:{os.environ['PATH']}"}
        result = run(["bash", str(REPO / "tests" / "run_all.sh")], REPO, environment, timeout=60)
        sections = [
            line[4:] for line in result["stdout"].splitlines() if line.startswith("=== ") and ": " not in line
        ]
        ok = result["rc"] == 1 and len(sections) == 8 and "FAILED: 8 section(s)" in result["stderr"]
        return verdict(
            "14",
            "tests/run_all.sh with a python that fails every section",
            [result],
            "ok",
            ok,
            note=f"sections run: {sections}; last line: {result['stderr'].strip().splitlines()[-1:]}",
        )


def case_15() -> dict:
    """Each README install line's extras hold what the main job imports (scikit-learn's digits)."""
    import configparser

    started = time.monotonic()
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    extras = {
        name: [
            line.strip().split(">")[0].split("=")[0].split("<")[0]
            for line in value.splitlines()
            if line.strip()
        ]
        for name, value in config["options.extras_require"].items()
    }
    readme = (REPO / "README.md").read_text()
    lines = {}
    for backend in ("TensorFlow", "JAX", "PyTorch"):
        match = re.search(
            rf"^\| {backend}[^|]*main job[^|]*\| `pip install -e \"\.\[([\w,]+)\]\"`", readme, re.M
        )
        lines[backend] = match.group(1).split(",") if match else None
    missing = {
        backend: [
            need for need in ("scikit-learn",) if not any(need in extras.get(e, []) for e in chosen or [])
        ]
        for backend, chosen in lines.items()
    }
    backends = {"TensorFlow": "tensorflow", "JAX": "jax", "PyTorch": "torch"}
    for backend, chosen in lines.items():
        if chosen and not any(backends[backend] in extras.get(e, []) for e in chosen):
            missing[backend].append(backends[backend])
    ok = all(chosen for chosen in lines.values()) and not any(missing.values())
    fake = {
        "rc": 0,
        "hang": False,
        "seconds": round(time.monotonic() - started, 1),
        "stdout": "",
        "stderr": "",
    }
    return verdict(
        "15",
        "README's install line per backend vs setup.cfg extras (scikit-learn, the backend)",
        [fake],
        "ok",
        ok,
        note=f"lines {lines}; missing {missing}",
    )


def case_16() -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        first = train(tmp, *SHORT)
        second = train(tmp, *SHORT)
        names = sorted(os.listdir(tmp))
        ok = (
            first["rc"] == 0
            and second["rc"] == 0
            and all(Path(tmp, name, "model.keras").exists() for name in ("vit_run", "vit_run-2"))
            and "vit_run-2" in second["stderr"] + second["stdout"]
        )
        again = train(tmp, *SHORT, "--output-dir", "quick_check")
        refused_again = train(tmp, *SHORT, "--output-dir", "quick_check")
        ok = ok and again["rc"] == 0 and refused(refused_again, "--overwrite")
        return verdict(
            "16",
            "keras-vit train twice in a fresh folder without --output-dir; then --output-dir "
            "quick_check twice",
            [first, second, again, refused_again],
            "ok",
            ok,
            note=f"folders {names}; 4th run: {first_error(refused_again['stderr'])}",
        )


PRETRAINED = (
    "import time\n"
    "started = time.monotonic()\n"
    "import keras_vit\n"
    "try:\n"
    "    keras_vit.vit_ti16(pretrained=True)\n"
    "    print('LOADED')\n"
    "except Exception as error:\n"
    "    print('ERROR', type(error).__name__, round(time.monotonic() - started, 2))\n"
    "    print(error)\n"
)


def case_17_offline(name: str, backend: str, **extra) -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        home = Path(tmp, "hf")
        home.mkdir()
        environment = env(backend, HF_HOME=str(home), **extra)
        environment.pop("HF_HUB_OFFLINE", None)
        environment.update(extra)
        result = run([sys.executable, "-c", PRETRAINED], tmp, environment)
        message = result["stdout"]
        offline_set = extra.get("HF_HUB_OFFLINE") == "1"
        advice_fits = not (offline_set and re.search(r"set(ting)? HF_HUB_OFFLINE", message))
        ok = (
            message.startswith("ERROR")
            and result["seconds"] < 5
            and advice_fits
            and "vit_ti16" in message.lower()
        )
        note = f"{result['seconds']} s whole process; message: {' '.join(message.split())[:300]}"
        record = verdict(
            name,
            f"vit_ti16(pretrained=True), empty HF_HOME, {backend}, {extra}",
            [result],
            "ok",
            ok,
            note=note,
        )
        return record


def case_17_noise() -> dict:
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        environment = env("tensorflow")
        environment.pop("TF_CPP_MIN_LOG_LEVEL", None)
        plain = run([sys.executable, "-c", "import keras_vit"], tmp, environment)
        quick = run(
            [
                sys.executable,
                "-c",
                TINY_MODEL + "import numpy as np\nmodel.predict(np.zeros((1, 16, 16, 3)), verbose=0)\n",
            ],
            tmp,
            environment,
        )
        lines = [line for line in (plain["stderr"] + quick["stderr"]).splitlines() if line.strip()]
        # TensorFlow's start-up lines (INFO / WARNING as its libraries load, oneDNN, the CPU instructions);
        # an ERROR-level line (e.g. cuInit failing where a CUDA driver library exists without a GPU) is
        # TensorFlow reporting the machine, counted apart
        startup = re.compile(
            r"^[IW]\d{4} |oneDNN|This TensorFlow binary|To enable the following|cuda drivers"
        )
        noise = [line for line in lines if startup.search(line)]
        return verdict(
            "17-noise",
            "python -c 'import keras_vit' and a tiny create_model + predict on TensorFlow "
            "(TF_CPP_MIN_LOG_LEVEL unset): stderr lines",
            [plain, quick],
            "ok",
            not noise,
            note=f"{len(noise)} start-up lines {noise[:4]}; others: {sorted(set(lines) - set(noise))[:3]}",
        )


def case_17_gitignore() -> dict:
    names = ["vit_run/", "vit_run-2/", "quick_check/", "site/", "vit_mpp/"]
    result = run(["git", "check-ignore", "--no-index", *names], REPO, dict(os.environ))
    ignored = result["stdout"].split()
    fake = {**result, "rc": 0}
    return verdict(
        "17-gitignore",
        "git check-ignore of what README commands write",
        [fake],
        "ok",
        sorted(ignored) == sorted(names),
        note=f"ignored: {ignored}",
    )


def case_sigint(ignored: bool = False) -> dict:
    """SIGINT to the supervisor's pid alone (not its group) stops a multi-process run like SIGTERM
    (`ignored`: the commands start with SIGINT ignored, as a shell script's `keras-vit train ... &`)."""
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        processes, _ = training_pair(tmp, BACKGROUND if ignored else [])
        os.kill(processes[0].pid, signal.SIGINT)
        sent = time.monotonic()
        results = [finish(process, 60, sent) for process in processes]
        ended = [not result["hang"] for result in results]
        ok = (
            all(ended)
            and results[0]["rc"] == 130
            and refused(results[1], "process 0")
            and all(r["seconds"] < 60 for r in results)
        )
        return verdict(
            "sigint-background" if ignored else "sigint",
            "two processes training; SIGINT to process 0's keras-vit pid alone"
            + (" (started with SIGINT ignored)" if ignored else ""),
            results,
            "ok",
            ok,
            note=f"seconds after SIGINT {[r['seconds'] for r in results]}",
        )


def case_logs() -> dict:
    """--overwrite on TensorFlow: the run's own TensorBoard files go, a user's files under logs/ stay."""
    with tempfile.TemporaryDirectory(prefix="h39-") as tmp:
        environment = {"TF_CPP_MIN_LOG_LEVEL": "3"}
        first = train(tmp, *SHORT, "--output-dir", "run", backend="tensorflow", timeout=240, **environment)
        mine = [
            Path(tmp, "run", "logs", "train", "my_notes.txt"),
            Path(tmp, "run", "logs", "validation", "x.csv"),
        ]
        for path in mine:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("the user's")
        before = hashes(mine)
        old_events = sorted(str(p) for p in Path(tmp, "run", "logs").rglob("events.out.tfevents*"))
        second = train(
            tmp,
            *SHORT,
            "--output-dir",
            "run",
            "--overwrite",
            backend="tensorflow",
            timeout=240,
            **environment,
        )
        after = hashes(mine)
        left = [path for path in old_events if os.path.exists(path)]
        ok = first["rc"] == 0 and second["rc"] == 0 and bool(old_events) and not left
        return verdict(
            "logs",
            "TensorFlow run into run/, user files in run/logs/train and /validation, run again "
            "with --overwrite",
            [first, second],
            "ok",
            ok,
            before,
            after,
            note=f"old event files {len(old_events)}, left after overwrite {len(left)}",
        )


CASES = {
    "1a": case_1a,
    "1b": case_1b,
    "2": case_2,
    "3": case_3,
    **{name: functools.partial(mismatch, name, *row) for name, row in MISMATCHES.items()},
    "8a": case_8a,
    "8b": case_8b,
    "8c": case_8c,
    "9a": case_9a,
    "9b": case_9b,
    "10": case_10,
    "11-link-jax": lambda: case_11("link", "jax"),
    "11-empty-jax": lambda: case_11("empty", "jax"),
    "11-link-torch": lambda: case_11("link", "torch"),
    "11-empty-torch": lambda: case_11("empty", "torch"),
    "12": lambda: case_tamper(
        "12",
        "scale",
        "save_pretrained folder, a weight scaled by 1.01; load_weights(folder) "
        "and load_weights(folder/model.safetensors)",
    ),
    "old-transposed": lambda: case_tamper(
        "old-transposed",
        "transpose",
        "save_pretrained folder, a square kernel transposed; load_weights by folder and by file",
    ),
    "old-nan-pyinput": lambda: case_nan_arrays("pyinput", "jax"),
    "old-nan-tfdata": lambda: case_nan_arrays("tfdata", "tensorflow"),
    "old-nan-serving": case_nan_serving,
    "13": case_13,
    "14": case_14,
    "15": case_15,
    "16": case_16,
    "17-offline-set": lambda: case_17_offline("17-offline-set", "tensorflow", HF_HUB_OFFLINE="1"),
    "17-no-network": lambda: case_17_offline("17-no-network", "tensorflow", HF_ENDPOINT="http://127.0.0.1:9"),
    "17-offline-jax": lambda: case_17_offline("17-offline-jax", "jax", HF_HUB_OFFLINE="1"),
    "17-noise": case_17_noise,
    "17-gitignore": case_17_gitignore,
    "sigint": case_sigint,
    "sigint-background": lambda: case_sigint(ignored=True),
    "logs": case_logs,
}


def machine() -> dict:
    model = cpu_model()
    commit = (
        os.environ.get("PROBE_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    )
    dirty = bool(
        subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    )
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit + (" (with uncommitted changes)" if dirty else ""),
        "python": sys.version.split()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated case names (default: all)")
    parser.add_argument("--json", help="write the machine and every case here")
    arguments = parser.parse_args()
    names = arguments.only.split(",") if arguments.only else list(CASES)
    records = []
    for name in names:
        try:
            found = CASES[name]()
        except Exception as error:  # the probe's own failure: recorded, never hidden
            found = {"case": name, "outcome": "probe error", "note": f"{type(error).__name__}: {error}"}
        for record in found if isinstance(found, list) else [found]:
            records.append(record)
            print(json.dumps(record), flush=True)
    if arguments.json:
        counts = {
            outcome: sum(r["outcome"] == outcome for r in records) for outcome in (*OUTCOMES, "probe error")
        }
        Path(arguments.json).write_text(
            json.dumps({"machine": machine(), "counts": counts, "cases": records}, indent=1)
        )


if __name__ == "__main__":
    main()
