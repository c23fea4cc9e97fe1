"""Re-probe of issue 29: every concrete fault its text lists, tried against the current code.

`python tests/helpers/probe_issue29.py` (TensorFlow backend; the faults named on JAX or PyTorch
run in one subprocess each) prints one line per fault: `ok` (refused or done right, with the
first line of what the user gets and the seconds it took) or `WRONG` (and what happened), and
exits 1 if any is wrong. Tiny models and files in a temporary folder: about a minute on 2 cores.
The suite's tests of the same faults are named in docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import keras  # noqa: E402
import sklearn.datasets  # noqa: E402
from PIL import Image  # noqa: E402

import keras_vit  # noqa: E402
from keras_vit import cli  # noqa: E402
from keras_vit.data import tfdata as data  # noqa: E402
from keras_vit.deploy.lora import enable_lora  # noqa: E402
from keras_vit.models.vit import build_vit  # noqa: E402
from keras_vit.registry.variants import ViTConfig  # noqa: E402
from keras_vit.utils import files  # noqa: E402

TINY = ViTConfig("tiny_probe", patch_size=8, hidden_size=32, depth=1, num_heads=2, mlp_dim=64, image_size=32)
PHOTO = Path(sklearn.datasets.__file__).parent / "images" / "china.jpg"
RESULTS: list[tuple[str, bool, str, float]] = []


def probe(name: str):
    """Run the decorated check now; it returns the user-facing outcome or raises AssertionError."""

    def run(check):
        start = time.perf_counter()
        try:
            outcome, good = check(), True
        except AssertionError as error:
            outcome, good = f"{error}", False
        except Exception:  # an unexpected crash is itself a finding
            outcome, good = traceback.format_exc(limit=2).strip().splitlines()[-1], False
        seconds = time.perf_counter() - start
        RESULTS.append((name, good, str(outcome).splitlines()[0][:160] if outcome else "", seconds))
        return check

    return run


def raises(call, kind=Exception, *needles) -> str:
    """The message of the error `call()` raises, checked to be a `kind` holding every needle."""
    try:
        call()
    except kind as error:
        message = f"{type(error).__name__}: {error}"
        missing = [needle for needle in needles if str(needle) not in message]
        assert not missing, f"error lacks {missing}: {message[:200]}"
        return message
    raise AssertionError("passed silently")


def run_cli(*arguments) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(argument) for argument in arguments])
        except SystemExit as exit:  # argparse's refusals
            code = exit.code
    said = err.getvalue().strip() or out.getvalue().strip()
    return code, said.splitlines()[-1] if said else ""  # the error, after argparse's usage line


def subprocess_python(backend: str, code: str, timeout: int = 300) -> dict:
    environment = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr.strip()[-300:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def damaged_jpeg(folder: Path) -> Path:
    photo = PHOTO.read_bytes()
    quarter = len(photo) // 4
    path = folder / "damaged.jpg"
    path.write_bytes(photo[: 2 * quarter] + bytes(quarter) + photo[3 * quarter :])
    return path


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="probe29-"))
    model = build_vit(TINY, num_classes=3)
    run = work / "vit_run"
    run.mkdir()
    model.save(run / "model.keras")
    (run / "labels.txt").write_text("a\nb\nc\n")
    (run / "report.json").write_text('{"status": "finished"}')
    Image.open(PHOTO).resize((64, 48)).save(run / "photo.jpg")
    snapshot = {path.name: path.read_bytes() for path in run.iterdir()}

    def run_intact() -> None:
        assert {path.name: path.read_bytes() for path in run.iterdir()} == snapshot, "the run folder changed"

    # ---- crashes --------------------------------------------------------------------------
    @probe("crash: KERAS_BACKEND=torch keras-vit predict/inspect (was exit 139)")
    def _():
        lines = []
        for command in (
            ["predict", run / "photo.jpg", "--model", run / "model.keras"],
            ["inspect", run / "photo.jpg", "--model", run / "model.keras", "--out", work / "torch_pngs"],
        ):
            environment = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=str(REPO))
            result = subprocess.run(
                [sys.executable, "-m", "keras_vit.cli", *map(str, command)],
                env=environment,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert result.returncode == 0, f"{command[0]} exit {result.returncode}: {result.stderr[-300:]}"
            lines.append(f"{command[0]} exit 0")
        return "; ".join(lines) + " (train on PyTorch: tests/test_cli_backends.py)"

    # ---- files lost -----------------------------------------------------------------------
    @probe("files: keras-vit train into a finished run's folder (replaced model.keras, report.json)")
    def _():
        code, said = run_cli("train", "--output-dir", run, "--epochs", 1)
        assert code != 0, "exit 0"
        run_intact()
        assert "--overwrite" in said, said
        return said

    @probe("files: keras-vit convert RUN/model.keras RUN --to timm --overwrite (deleted the run)")
    def _():
        code, said = run_cli("convert", run / "model.keras", run, "--to", "timm", "--overwrite")
        assert code == 1, f"exit {code}"
        run_intact()
        return said

    @probe("files: save_pretrained(overwrite=True) over a folder with the user's files (all gone)")
    def _():
        folder = work / "shared_user"
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
        (folder / "sub").mkdir()
        keras_vit.save_pretrained(model, folder)
        keras_vit.save_pretrained(model, folder, overwrite=True)
        assert (folder / "notes.txt").read_text() == "mine" and (folder / "sub").is_dir(), "user files lost"
        return "notes.txt and sub/ kept"

    @probe("files: two keras-vit train runs into one --output-dir (one lost its run)")
    def _():
        folder = work / "locked"
        with files.RunLock(folder):
            code, said = run_cli("train", "--output-dir", folder, "--epochs", 1)
        assert code != 0 and "in use by another training run" in said, said
        return said

    # ---- damaged or edited files taken as good ---------------------------------------------
    @probe("edited: backup/state.json epoch 3 -> 5, valid JSON (resumed, skipped steps)")
    def _():
        from keras_vit.training import runs
        from keras_vit.training.runs.backup import sign_state

        folder = work / "backup"
        folder.mkdir()
        (folder / "w.weights.h5").write_bytes(b"weights")
        state = {
            "epoch": 3,
            "weights": "w.weights.h5",
            "sha256": {"w.weights.h5": runs.file_sha256(folder / "w.weights.h5")},
            "run": {},
        }
        (folder / "state.json").write_text(json.dumps({**sign_state(state), "epoch": 5}))
        return raises(lambda: runs.EpochBackup(folder, {}), ValueError, "state.json", "SHA-256")

    shared = keras_vit.save_pretrained(model, work / "shared")

    def edited_copy(name: str, edit) -> Path:
        folder = work / name
        shutil.copytree(shared, folder)
        edit(folder)
        return folder

    def flip_weight(folder: Path) -> None:
        weights = bytearray((folder / "model.safetensors").read_bytes())
        weights[-8] ^= 1
        (folder / "model.safetensors").write_bytes(bytes(weights))

    def edit_heads(folder: Path) -> None:
        metadata = json.loads((folder / "keras_vit.json").read_text())
        metadata["model"]["config"]["num_heads"] = 4
        (folder / "keras_vit.json").write_text(json.dumps(metadata))

    for label, edit in (("a weight value changed", flip_weight), ("num_heads edited", edit_heads)):
        folder = edited_copy(label.replace(" ", "_"), edit)

        @probe(f"edited: save_pretrained folder, {label} (loaded silently): load_pretrained")
        def _(folder=folder):
            return raises(lambda: keras_vit.load_pretrained(folder), files.ChecksumError, str(folder))

        @probe(f"edited: save_pretrained folder, {label}: create_model(pretrained=folder)")
        def _(folder=folder):
            return raises(lambda: keras_vit.create_model(TINY, folder), files.ChecksumError, str(folder))

    damaged = damaged_jpeg(work)

    @probe("damaged: JPEG damaged mid-file in an image folder (trained on as partly grey)")
    def _():
        root = work / "images"
        for name in ("a", "b"):
            (root / name).mkdir(parents=True)
            shutil.copy(PHOTO, root / name / "1.jpg")
        shutil.copy(damaged, root / "b" / "2.jpg")
        return raises(lambda: data.from_directory(root), data.BadImageError, "b/2.jpg", "libjpeg")

    @probe("damaged: JPEG damaged mid-file to load_image / keras-vit predict (read as partly grey)")
    def _():
        raises(lambda: keras_vit.load_image(damaged, 32), OSError, str(damaged), "damaged JPEG")
        code, said = run_cli("predict", damaged, "--model", run / "model.keras")
        assert code == 1 and str(damaged) in said, said
        return said

    # ---- inputs and options that pass silently ----------------------------------------------
    good = np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)).astype("float32")

    @probe("input: uint8 / bool images to predict (TensorFlow; JAX and PyTorch below)")
    def _():
        raises(lambda: model.predict((good > 0), verbose=0), TypeError, "preprocess_input")
        return raises(lambda: model.predict((good * 100 + 100).astype("uint8"), verbose=0), TypeError)

    @probe("input: enable_lora(alpha=0) (adapters never trained)")
    def _():
        return raises(lambda: enable_lora(build_vit(TINY, num_classes=3), 2, alpha=0), ValueError, "alpha")

    @probe("input: enable_lora with a huge rank (allocated before any check)")
    def _():
        return raises(lambda: enable_lora(build_vit(TINY, num_classes=3), 10**7), ValueError, "rank")

    @probe("option: keras-vit export --format onnx --top-k / --labels of the wrong length (dropped)")
    def _():
        (work / "two.txt").write_text("a\nb\n")
        code, said = run_cli("export", work / "onnx", "--format", "onnx", "--top-k", 2)
        assert code != 0 and "--top-k cannot be used with --format onnx" in said, said
        code, said = run_cli(
            "export", work / "sm", "--model", run / "model.keras", "--labels", work / "two.txt"
        )
        assert code != 0 and "holds 2 class names" in said, said
        return said

    @probe("option: keras-vit predict --weights with a .keras model (ignored)")
    def _():
        code, said = run_cli(
            "predict", run / "photo.jpg", "--model", run / "model.keras", "--weights", "true"
        )
        assert code != 0 and "--weights cannot be used" in said, said
        return said

    @probe("input: the run's own vit_run/model.keras to keras-vit predict and inspect (refused)")
    def _():
        code, said = run_cli("predict", run / "photo.jpg", "--model", run / "model.keras")
        assert code == 0, said
        code, said = run_cli(
            "inspect", run / "photo.jpg", "--model", run / "model.keras", "--out", work / "pngs"
        )
        assert code == 0, said
        return "predict and inspect exit 0"

    @probe("input: NaN to decode_predictions (class names with probability nan)")
    def _():
        predictions = np.full((1, 1000), 1e-3, "float32")
        predictions[0, 3] = np.nan
        raises(lambda: keras_vit.preprocess_input(np.full((1, 8, 8, 3), np.nan)), ValueError, "NaN")
        return raises(lambda: keras_vit.decode_predictions(predictions), ValueError, "NaN")

    # ---- errors that don't help -------------------------------------------------------------
    @probe("error: save_pretrained into an unwritable place (named a hidden staging folder)")
    def _():
        message = raises(
            lambda: keras_vit.save_pretrained(model, "/proc/probe_out"), OSError, "/proc/probe_out"
        )
        assert ".tmp-" not in message, message
        (work / "afile").write_text("x")
        raises(lambda: keras_vit.save_pretrained(model, work / "afile" / "out"), OSError, "afile is a file")
        return message

    @probe("error: damaged keras_vit.json (raw JSONDecodeError / KeyError: 'model')")
    def _():
        from keras_vit.checkpoints import CheckpointError

        truncated = edited_copy("truncated_json", lambda f: (f / "keras_vit.json").write_text('{"model": '))
        raises(
            lambda: keras_vit.load_pretrained(truncated), CheckpointError, "keras_vit.json", "not valid JSON"
        )
        no_model = edited_copy("no_model", lambda f: (f / "keras_vit.json").write_text('{"format": "timm"}'))
        return raises(lambda: keras_vit.load_pretrained(no_model), CheckpointError, "field 'weights'")

    @probe("error: --output-dir that is a file (failed inside TensorBoard)")
    def _():
        code, said = run_cli("train", "--output-dir", run / "labels.txt", "--epochs", 1)
        assert code != 0 and "is a file" in said, said
        run_intact()
        return said

    @probe("JAX: an empty batch, uint8 pixels, a failed fit (wrong labels or size): model still works")
    def _():
        outcome = subprocess_python("jax", _JAX_AND_TORCH_SCRIPT)
        assert outcome["works"], outcome
        return "; ".join(f"{key}: {value[:40]}" for key, value in outcome["errors"].items())

    @probe("PyTorch: uint8 pixels, an empty batch, a failed fit: refused, model still works")
    def _():
        outcome = subprocess_python("torch", _JAX_AND_TORCH_SCRIPT)
        assert outcome["works"], outcome
        return f"{len(outcome['errors'])} refused"

    shutil.rmtree(work, ignore_errors=True)
    width = max(len(name) for name, *_ in RESULTS)
    for name, good_result, outcome, seconds in RESULTS:
        print(f"{'ok   ' if good_result else 'WRONG'} {name:<{width}} {seconds:6.2f} s  {outcome}")
    wrong = sum(not good_result for _, good_result, _, _ in RESULTS)
    print(f"{len(RESULTS) - wrong} of {len(RESULTS)} faults fixed; {wrong} still wrong")
    return 1 if wrong else 0


_JAX_AND_TORCH_SCRIPT = """
import json
import numpy as np
from keras_vit.models.vit import build_vit
from keras_vit.registry.variants import ViTConfig

model = build_vit(ViTConfig("t", patch_size=8, hidden_size=32, depth=1, num_heads=2, mlp_dim=64,
                            image_size=32), num_classes=3)
model.compile(loss="sparse_categorical_crossentropy")
good = np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)).astype("float32")
errors = {}
for name, call in [("empty", lambda: model.predict(good[:0], verbose=0)),
                   ("uint8", lambda: model.predict((good * 100 + 100).astype("uint8"), verbose=0)),
                   ("fit labels", lambda: model.fit(good, np.zeros((2, 5, 7)), verbose=0)),
                   ("fit images", lambda: model.fit(good[:, :16], np.array([0, 1]), verbose=0))]:
    try:
        call()
        errors[name] = "passed silently"
    except Exception as error:
        errors[name] = f"{type(error).__name__}: {error}"
model.fit(good, np.array([0, 1]), verbose=0)
works = bool(np.isfinite(model.predict(good, verbose=0)).all())
print(json.dumps({"errors": errors, "works": works and "passed silently" not in errors.values()}))
"""

if __name__ == "__main__":
    keras.utils.set_random_seed(0)
    sys.exit(main())
