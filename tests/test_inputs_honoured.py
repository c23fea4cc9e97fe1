"""Every input is honoured or refused with a message naming it (issue 29, items 3 to 5).

Prefixes: `test_pixels_...` integer, bool, NaN or empty pixels given to public entry points;
`test_backend_...` the same on JAX and PyTorch, one subprocess per backend.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sklearn.datasets
from helpers import subprocess_env
from PIL import Image

import keras_vit
from keras_vit import cli
from keras_vit.checkpoints import CheckpointError
from keras_vit.data import tfdata as data
from keras_vit.inspection import analysis as inspection
from keras_vit.models.build import build_vit
from keras_vit.registry.variants import ViTConfig
from keras_vit.training import classification as training

TINY = ViTConfig("tiny_inputs", patch_size=8, hidden_size=32, depth=1, num_heads=2, mlp_dim=64, image_size=32)


@pytest.fixture(scope="module")
def tiny_model():
    return build_vit(TINY, num_classes=3)


def _images(dtype="float32", batch=2) -> np.ndarray:
    return np.random.default_rng(0).uniform(0, 255, (batch, 32, 32, 3)).astype(dtype)


@pytest.mark.parametrize("dtype", ["uint8", "int32", "int64", "bool"])
@pytest.mark.parametrize("entry", ["predict", "call"])
def test_pixels_integer_or_bool_refused_with_pointer(tiny_model, dtype, entry):
    images = _images(dtype)
    run = tiny_model.predict if entry == "predict" else tiny_model
    with pytest.raises(TypeError, match=rf"got {dtype} pixels: pass them through keras_vit.preprocess_input"):
        run(images)
    assert np.isfinite(tiny_model.predict(_images() / 128 - 1, verbose=0)).all()  # still works


def test_pixels_nan_refused_by_predict(tiny_model):
    images = _images() / 128 - 1
    images[1, 3, 4, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite pixel values"):
        tiny_model.predict(images, verbose=0)


def test_pixels_empty_batch_refused(tiny_model):
    with pytest.raises(ValueError, match=r"empty batch \(shape \(0, 32, 32, 3\)\)"):
        tiny_model.predict(np.zeros((0, 32, 32, 3), "float32"), verbose=0)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_pixels_decode_predictions_refuses_nan(bad):
    predictions = np.full((2, 1000), 1e-3, "float32")
    predictions[0, 7] = bad
    with pytest.raises(ValueError, match="decode_predictions got NaN or infinite predictions"):
        keras_vit.decode_predictions(predictions)


def test_pixels_preprocess_input_refuses_nan():
    images = _images()
    images[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        keras_vit.preprocess_input(images)


def test_pixels_inspection_refuses_integers_and_nan(tiny_model):
    with pytest.raises(TypeError, match="preprocess_input"):
        inspection.attention_rollout(tiny_model, _images("uint8"))
    images = _images() / 128 - 1
    images[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        inspection.attention_rollout(tiny_model, images)


_BACKEND_SCRIPT = """
import json, sys
import keras
import numpy as np
import keras_vit
from keras_vit.checkpoints import CheckpointError
from keras_vit.inspection import analysis as inspection
from keras_vit.models.build import build_vit
from keras_vit.registry.variants import ViTConfig

model = build_vit(ViTConfig("t", patch_size=8, hidden_size=32, depth=1, num_heads=2, mlp_dim=64,
                            image_size=32), num_classes=3)
good = np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)).astype("float32")
before = model.predict(good, verbose=0)
errors = {}
for name, images in [("empty", good[:0]), ("uint8", (good * 100 + 100).astype("uint8")),
                     ("bool", good > 0), ("nan", np.where(good > 0.9, np.nan, good))]:
    try:
        model.predict(images, verbose=0)
        errors[name] = None
    except (ValueError, TypeError) as error:
        errors[name] = str(error)


class FailingBatches(keras.utils.PyDataset):
    def __init__(self, at):
        super().__init__()
        self.at = at

    def __len__(self):
        return 3

    def __getitem__(self, index):
        if index == self.at:
            raise RuntimeError("a bad batch")
        return good, np.array([0, 1])


model.compile(loss="sparse_categorical_crossentropy")
for call in ("predict", "evaluate"):
    for at in (0, 1):
        try:
            getattr(model, call)(FailingBatches(at), verbose=0)
        except RuntimeError as error:
            errors[f"{call} batch {at}"] = str(error)
after = model.predict(good, verbose=0)
errors["evaluate after"] = float(model.evaluate(good, np.array([0, 1]), verbose=0))
wrong_labels = np.zeros((2, 5, 7))
for name, call in [("fit batch 0", lambda: model.fit(FailingBatches(0), shuffle=False, verbose=0)),
                   ("fit labels", lambda: model.fit(good, wrong_labels, verbose=0)),
                   ("train_on_batch labels", lambda: model.train_on_batch(good, wrong_labels))]:
    try:
        call()
    except (RuntimeError, ValueError) as error:
        errors[name] = str(error)
after_failed_fits = model.predict(good, verbose=0)
try:
    model.fit(FailingBatches(1), shuffle=False, verbose=0)  # one step trained, then the bad batch
except RuntimeError as error:
    errors["fit batch 1"] = str(error)
errors["fit after"] = model.fit(good, np.array([0, 1]), verbose=0).history["loss"][-1]
print(json.dumps({"errors": errors, "unchanged": bool(np.array_equal(before, after)),
                  "unchanged by failed fits": bool(np.array_equal(before, after_failed_fits)),
                  "trained": not np.array_equal(before, model.predict(good, verbose=0))}))
"""


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_backend_bad_batches_refused_and_model_still_works(backend, tmp_path):
    """On JAX an empty batch, or a failing batch or wrong labels in Keras's predict, evaluate or fit
    loop, used to break the model for good."""
    result = subprocess.run(
        [sys.executable, "-c", _BACKEND_SCRIPT],
        env=subprocess_env(KERAS_BACKEND=backend),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["unchanged"]
    assert "empty batch" in outcome["errors"]["empty"]
    assert "preprocess_input" in outcome["errors"]["uint8"]
    assert "preprocess_input" in outcome["errors"]["bool"]
    assert "NaN" in outcome["errors"]["nan"]
    for call in ("predict", "evaluate", "fit"):
        assert outcome["errors"][f"{call} batch 0"] == outcome["errors"][f"{call} batch 1"] == "a bad batch"
    assert np.isfinite(outcome["errors"]["evaluate after"])
    for call in ("fit", "train_on_batch"):  # a shape error while tracing the first step
        assert "must have the same shape" in outcome["errors"][f"{call} labels"]
    assert outcome["unchanged by failed fits"] and outcome["trained"]
    assert np.isfinite(outcome["errors"]["fit after"])


# --- a damaged keras_vit.json: an error naming the file and the fault ---------------------------


@pytest.fixture(scope="module")
def shared_folder(tmp_path_factory, tiny_model):
    folder = tmp_path_factory.mktemp("shared") / "tiny"
    keras_vit.save_pretrained(tiny_model, folder)
    return folder


def _damaged_copy(shared_folder, tmp_path, edit) -> str:
    folder = tmp_path / "copy"
    shutil.copytree(shared_folder, folder)
    metadata_file = folder / "keras_vit.json"
    metadata = json.loads(metadata_file.read_text())
    text = edit(metadata)
    metadata_file.write_text(text if isinstance(text, str) else json.dumps(metadata))
    return str(folder)


def _drop(*keys):
    def edit(metadata):
        target = metadata
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda metadata: json.dumps(metadata)[:-40], "is not valid JSON"),
        (lambda metadata: "[1, 2]", "holds a list, not an object"),
        (_drop("model"), "field 'model' is missing"),
        (_drop("weights"), "field 'weights' is missing"),
        (
            lambda metadata: metadata.update(weights="../../elsewhere.safetensors"),
            "a file in the same folder",
        ),
        (_drop("model", "num_classes"), "field 'model' lacks 'num_classes'"),
        (
            lambda metadata: metadata["model"]["config"].update(depth_typo=3),
            "'model.config' is no ViT config",
        ),
    ],
    ids=["truncated", "not-object", "no-model", "no-weights", "weights-path", "no-num-classes", "bad-config"],
)
def test_damaged_metadata_names_file_and_fault(shared_folder, tmp_path, edit, message):
    folder = _damaged_copy(shared_folder, tmp_path, edit)
    with pytest.raises(CheckpointError, match=message) as caught:
        keras_vit.load_pretrained(folder)
    assert os.path.join(folder, "keras_vit.json") in str(caught.value)
    with pytest.raises(CheckpointError, match=message):
        keras_vit.create_model("vit_ti16", folder)  # the same reader for pretrained=FOLDER


# --- image folders: decoded in full when checked ------------------------------------------------

SAMPLE_JPEG = Path(sklearn.datasets.__file__).parent / "images" / "china.jpg"  # a real photograph


def _damaged_mid_file(data: bytes, how: str) -> bytes:
    """The JPEG with bytes lost mid-file; its header and end-of-image marker are intact."""
    half = len(data) // 2
    if how == "zeroed":
        return data[:half] + bytes(len(data) // 4) + data[half + len(data) // 4 :]
    return data[:half] + data[-2:]  # "cut": the second half of the scan gone


@pytest.mark.parametrize("how", ["zeroed", "cut"])
def test_image_folder_lists_a_jpeg_damaged_mid_file_without_decoding_it(tmp_path, how):
    """Listing a folder decodes nothing (a header check only): a JPEG damaged mid-file, whose
    header and end marker are intact, is listed and read as libjpeg recovers it (grey blocks),
    as timm and tf.data read it; `load_image` refuses it (below)."""
    photo = SAMPLE_JPEG.read_bytes()
    damaged = _damaged_mid_file(photo, how)
    root = tmp_path / "train"
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        for index in range(2):
            (root / name / f"{index}.jpg").write_bytes(photo)
    bad = root / "b" / "1.jpg"
    bad.write_bytes(damaged)
    source = data.from_directory(root)
    assert str(bad) in source.files and source.class_counts == (2, 2)


@pytest.mark.parametrize("how", ["zeroed", "cut"])
def test_load_image_refuses_a_jpeg_damaged_mid_file(tmp_path, how, capfd):
    damaged = tmp_path / "damaged.jpg"
    damaged.write_bytes(_damaged_mid_file(SAMPLE_JPEG.read_bytes(), how))
    assert keras_vit.load_image(SAMPLE_JPEG, 32).shape == (32, 32, 3)  # the intact photograph
    message = rf"Image '{damaged}' could not be decoded: damaged JPEG data \(libjpeg: Corrupt JPEG data"
    with pytest.raises(OSError, match=message):
        keras_vit.load_image(damaged, 32)
    with (
        open(damaged, "rb") as file,
        pytest.raises(OSError, match="Image file could not be decoded: damaged JPEG"),
    ):
        keras_vit.load_image(file, 32)
    assert "Corrupt JPEG" not in capfd.readouterr().err  # said once, in the error


# --- the command line: every flag honoured or refused before anything runs ----------------------


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory, tiny_model):
    """What keras-vit train leaves: model.keras and labels.txt in the run folder."""
    folder = tmp_path_factory.mktemp("vit_run")
    tiny_model.save(folder / "model.keras")
    (folder / "labels.txt").write_text("cat\ndog\nowl\n")
    Image.fromarray(_images("uint8", 1)[0]).save(folder / "photo.png")
    return folder


def _cli(capsys, *arguments) -> tuple[int, str, str]:
    code = cli.main([str(argument) for argument in arguments])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_predict_names_a_damaged_jpeg(run_folder, tmp_path, capsys):
    damaged = tmp_path / "damaged.jpg"
    damaged.write_bytes(_damaged_mid_file(SAMPLE_JPEG.read_bytes(), "zeroed"))
    code, out, err = _cli(capsys, "predict", damaged, "--model", run_folder / "model.keras")
    assert code == 1 and out == ""
    assert f"Image '{damaged}' could not be decoded: damaged JPEG data" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("how", ["keras-file", "shared-folder"])
def test_cli_predict_takes_the_runs_model_and_its_class_names(run_folder, shared_folder, capsys, how):
    model = run_folder / "model.keras" if how == "keras-file" else shared_folder
    code, out, err = _cli(capsys, "predict", run_folder / "photo.png", "--model", model, "--top", 2)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == str(run_folder / "photo.png") and len(lines) == 3
    if how == "keras-file":  # labels.txt, written beside model.keras by keras-vit train
        assert {line.split()[-1] for line in lines[1:]} <= {"cat", "dog", "owl"}


def test_cli_inspect_takes_the_runs_model(run_folder, tmp_path, capsys):
    code, out, err = _cli(
        capsys,
        "inspect",
        run_folder / "photo.png",
        "--model",
        run_folder / "model.keras",
        "--out",
        tmp_path / "pngs",
    )
    assert code == 0, err
    assert "wrote" in out and any((tmp_path / "pngs").iterdir())


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            ["predict", "{photo}", "--model", "{model}", "--weights", "true"],
            "--weights cannot be used with --model",
        ),
        (
            ["predict", "{photo}", "--saved-model", "{run}", "--model", "vit_ti16", "--max-pixels", "10"],
            "--model, --max-pixels cannot be used with --saved-model",
        ),
        (["predict", "{photo}", "--model", "{model}", "--top", "4"], "--top 4 is more than the 3 classes"),
        (["predict", "{photo}", "--model", "{model}", "--labels", "{two_names}"], "holds 2 class names but"),
        (["inspect", "{photo}", "--model", "{model}", "--weights", "false"], "--weights cannot be used"),
        (["inspect", "{photo}", "--model", "{model}", "--out", "{photo}"], "is a file, not a folder"),
        (
            ["export", "{out}", "--format", "onnx", "--labels", "{two_names}"],
            "--labels cannot be used with --format onnx",
        ),
        (
            ["export", "{out}", "--format", "litert", "--top-k", "2", "--version", "3", "--no-warmup"],
            "--version, --top-k, --no-warmup cannot be used with --format litert",
        ),
        (["export", "{out}", "--format", "onnx", "--int8"], "--int8 cannot be used with --format onnx"),
        (["export", "{out}", "--preprocessing"], "--preprocessing cannot be used with --format saved_model"),
        (
            ["export", "{out}", "--model", "{model}", "--weights", "true"],
            "--weights cannot be used with --model",
        ),
        (["export", "{out}", "--model", "{model}", "--labels", "{two_names}"], "holds 2 class names but"),
        (["convert", "vit_ti16", "{photo}/out", "--to", "timm"], "OUTPUT '{photo}/out' cannot be made: "),
        (["convert", "vit_ti16", "{photo}/out.keras"], "OUTPUT '{photo}/out.keras' cannot be made: "),
        (["export", "{photo}/v", "--model", "vit_ti16"], "EXPORT_DIR '{photo}/v' cannot be made: "),
        (["export", "{run}", "--format", "onnx", "--model", "vit_ti16"], "EXPORT_DIR '{run}' is a folder"),
        (["convert", "{model}", "{out}", "--num-classes", "5"], "--num-classes cannot be used with SOURCE"),
        (["convert", "{model}", "{out}", "--model", "vit_s16"], "--model cannot be used with SOURCE"),
        (
            ["convert", "vit_ti16", "{out}", "--model", "vit_s16"],
            "--model cannot be used with SOURCE vit_ti16",
        ),
        (["convert", "{photo}", "{out}", "--weights", "false"], "--weights cannot be used with SOURCE"),
        (["convert", "vit_ti16", "{out}", "--labels", "{two_names}"], "--labels cannot be used without --to"),
        (["push", "{model}", "me/tiny", "--weights", "false"], "--weights cannot be used with SOURCE"),
        (
            ["train", "--test-split", "validation"],
            "test_split='validation' (--test-split) applies to tensorflow",
        ),
        (
            ["train", "--dataset", "{run}", "--data-dir", "{run}"],
            "--data-dir) applies to tensorflow-datasets",
        ),
        (["pretrain", "--on-bad-image", "skip"], "(--on-bad-image) applies to image folders only"),
    ],
)
def test_cli_flag_a_mode_cannot_honour_is_refused_first(
    run_folder, tmp_path, capsys, monkeypatch, arguments, message
):
    monkeypatch.chdir(tmp_path)  # train and pretrain without --output-dir: never the user's vit_run/
    two_names = tmp_path / "two.txt"
    two_names.write_text("cat\ndog\n")
    values = dict(
        photo=run_folder / "photo.png",
        model=run_folder / "model.keras",
        run=run_folder,
        out=tmp_path / "out",
        two_names=two_names,
    )
    before = sorted(run_folder.rglob("*"))
    code, out, err = _cli(capsys, *(argument.format(**values) for argument in arguments))
    assert code in (1, 2) and out == ""
    assert message.format(**values) in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists() and sorted(run_folder.rglob("*")) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["two.txt"]  # no run folder either


@pytest.mark.parametrize("command", ["train", "pretrain"])
def test_cli_output_dir_that_is_a_file_is_refused_when_parsed(tmp_path, capsys, command):
    in_the_way = tmp_path / "report.txt"
    in_the_way.write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--output-dir", str(in_the_way)])
    assert exit_info.value.code == 2
    assert f"argument --output-dir: '{in_the_way}' is a file, not a folder" in capsys.readouterr().err
    assert in_the_way.read_text() == "mine"
    with pytest.raises(NotADirectoryError, match="cannot be made: .* is a file"):
        training.train(TINY, "digits", output_dir=in_the_way / "run", steps=1)


def test_cli_predict_takes_a_checkpoint_file_as_model(run_folder, tmp_path, shared_folder, capsys):
    keras_vit.save_pretrained(keras_vit.create_model("vit_ti16", num_classes=4), tmp_path / "ti16")
    checkpoint = tmp_path / "ti16" / "model.safetensors"
    code, out, err = _cli(capsys, "predict", run_folder / "photo.png", "--model", checkpoint, "--labels", "-")
    assert code == 1 and "labels file '-' does not exist" in err  # checked before the model is built
    code, out, err = _cli(capsys, "predict", run_folder / "photo.png", "--model", checkpoint)
    assert code == 0, err
    assert len(out.splitlines()) == 5 and "4 classes have no names: pass --labels FILE" in err
    code, out, err = _cli(
        capsys, "predict", run_folder / "photo.png", "--model", shared_folder / "model.safetensors"
    )
    assert code == 1 and "no keras_vit variant has" in err
    code, out, err = _cli(capsys, "predict", run_folder / "photo.png", "--model", run_folder)
    assert code == 1 and f"no keras_vit.json): pass {run_folder / 'model.keras'}" in err


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_backend_cli_predict_and_inspect_take_the_runs_model(run_folder, tmp_path, backend):
    """The run's own model.keras (saved under TensorFlow) works with predict and inspect on every backend."""
    outputs = []
    for argv in (
        ["predict", run_folder / "photo.png", "--model", run_folder / "model.keras"],
        [
            "inspect",
            run_folder / "photo.png",
            "--model",
            run_folder / "model.keras",
            "--out",
            tmp_path / backend,
        ],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "keras_vit.cli", *map(str, argv)],
            env=subprocess_env(KERAS_BACKEND=backend),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
        outputs.append(result.stdout.splitlines())
    predicted, _ = outputs
    assert {line.split()[-1] for line in predicted[1:]} == {"cat", "dog", "owl"}  # labels.txt's names
    assert any((tmp_path / backend).iterdir())
