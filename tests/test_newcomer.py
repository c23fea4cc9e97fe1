"""A newcomer's first hour (issue 18): dataset names, install advice, offline errors, quiet CLI,
truthful reports, class names through export, small CLI things, and the logits trap."""

from __future__ import annotations

import hashlib
import json
import math
import re
import runpy
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import keras
import numpy as np
import pytest
from helpers import subprocess_env
from PIL import Image

import keras_vit
from keras_vit import cli
from keras_vit.checkpoints import pretrained as kp
from keras_vit.data import datasets
from keras_vit.data import tfdata as data
from keras_vit.data.preprocessing import decode_predictions, read_labels
from keras_vit.registry import catalog
from keras_vit.registry.variants import VARIANTS, ViTConfig
from keras_vit.training import classification as training
from keras_vit.utils import environment

ROOT = Path(__file__).resolve().parents[1]
TINY = ViTConfig(
    "vit_tiny_test", patch_size=8, hidden_size=32, depth=2, num_heads=2, mlp_dim=64, image_size=16
)
TIMEOUT = 300


def _image_folder(root: Path, classes=("cat", "dog"), per_class: int = 4) -> Path:
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True)
            for index in range(per_class):
                Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(
                    folder / f"{index}.png"
                )
    return root


def _keras_vit_command() -> list[str]:
    script = Path(sys.executable).with_name("keras-vit")
    return [str(script)] if script.exists() else [sys.executable, "-m", "keras_vit.cli"]


def _run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`keras-vit ARGS` in a fresh process, with TF_CPP_MIN_LOG_LEVEL unset (the CLI must set it)."""
    env = {key: value for key, value in subprocess_env().items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run(
        [*_keras_vit_command(), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )


# ---------------------------------------------------------------- 1. tfds names with a slash or a version


def test_dataset_names_are_folders_only_if_they_exist_or_look_like_paths(tmp_path, monkeypatch):
    for name in ("imagenette/320px", "mnist:3.0.1", "imagenette/320px:1.0.0", "mnist"):
        assert not data.is_folder_name(name), name
    for name in ("./mnist", "../x", "/data/images", "~/images", tmp_path / "missing"):
        assert data.is_folder_name(name), name
    (tmp_path / "imagenette").mkdir()
    monkeypatch.chdir(tmp_path)
    assert data.is_folder_name("imagenette")  # an existing folder wins


@pytest.mark.parametrize("name", ["imagenette/320px", "mnist:3.0.1"])
def test_tfds_names_with_config_or_version_reach_tfds(name, tmp_path):
    """Both drivers send them to tensorflow-datasets, whose not-prepared error names both flag forms."""
    for load in (
        lambda: training.load_dataset(name, data_dir=tmp_path),
        lambda: datasets.load_unlabeled(name, "train", tmp_path),
    ):
        with pytest.raises(data.DataNotPreparedError) as caught:
            load()
        message = str(caught.value)
        assert f"tfds build {name}" in message
        assert "`--data-dir DIR` on the command line" in message and "data_dir=DIR in Python" in message
    for missing in ("./no_such_folder", str(tmp_path / "no_such_folder")):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            training.load_dataset(missing)
        with pytest.raises(FileNotFoundError, match="does not exist"):
            datasets.load_unlabeled(missing, "train", None)


def test_relative_image_folder_without_dot_is_read(tmp_path, monkeypatch):
    _image_folder(tmp_path / "pets")
    monkeypatch.chdir(tmp_path)
    train, test = training.load_dataset("pets")
    assert (train.num_examples, test.num_examples, train.class_names) == (8, 8, ("cat", "dog"))
    source = datasets.load_unlabeled("pets", "train", None)
    assert source.num_examples == 8 and source.flip  # photos' augmentation, not the digits'


# ---------------------------------------------------------------- 2. install advice that works


def test_install_hint_fits_where_the_user_is(monkeypatch, tmp_path):
    assert environment.checkout_root() == str(ROOT)  # the tests run from a checkout
    monkeypatch.chdir(ROOT)
    assert environment.install_hint("train") == 'pip install -e ".[train]"'
    monkeypatch.chdir(tmp_path)
    assert environment.install_hint("plots") == f'pip install -e "{ROOT}[plots]"'
    monkeypatch.setattr(environment, "checkout_root", lambda: None)  # an installed package
    assert environment.install_hint("export") == 'pip install "keras-vit-zoo[export]"'


def test_no_module_hard_codes_the_package_index_install():
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "keras_vit").rglob("*.py")
        if path.name != "environment.py" and re.search(r"keras-vit-zoo\[", path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


# ---------------------------------------------------------------- 4. offline errors, fast


def _without_proxies(monkeypatch) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9", "https://huggingface.invalid"])
def test_download_without_network_probes_once_and_stops(endpoint, tmp_path, monkeypatch, network_attempts):
    """The real download code, online mode, no network: one probe of the hub, then a useful message
    (no download attempt, so none of huggingface_hub's ~25 s of retries)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    _without_proxies(monkeypatch)
    cache = tmp_path / "hub"
    with pytest.raises(kp.WeightsUnavailableError) as caught:
        kp.download_checkpoint("vit_ti16.augreg_in21k_ft_in1k", cache_dir=cache, endpoint=endpoint)
    assert [host for host, _ in network_attempts] == [endpoint.split("://")[1].split(":")[0]]
    message = str(caught.value)
    assert "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k" in message and "'model.safetensors'" in message
    assert "no network connection" in message
    assert "`--weights /path/to/model.safetensors`" in message  # the command-line form
    assert "keras_vit.vit_ti16(pretrained='/path/to/model.safetensors')" in message  # the Python form
    assert str(cache) in message and "HF_HUB_OFFLINE=1" in message
    assert ".." not in message.replace("../", "")


def test_default_hub_unreachable_fails_at_once(tmp_path, monkeypatch, network_attempts):
    """`pretrained=True` as a user types it (default endpoint), no network: one probe, then the error."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    _without_proxies(monkeypatch)
    with pytest.raises(kp.WeightsUnavailableError, match="no network connection"):
        kp.resolve_pretrained(True, "vit_ti16")
    assert [host for host, _ in network_attempts] == ["huggingface.co"]


def test_offline_mode_fails_without_network_and_says_so(tmp_path, monkeypatch, network_attempts):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(kp.WeightsUnavailableError) as caught:
        kp.download_checkpoint("vit_ti16.augreg_in21k_ft_in1k", cache_dir=tmp_path)
    assert network_attempts == []
    message = str(caught.value)
    assert "HF_HUB_OFFLINE is set" in message and "not in the cache" in message and str(tmp_path) in message
    assert "`--weights /path/to/model.safetensors`" in message and ".." not in message


# A checkpoint not in the cache, offline: the error, and whether Keras (and so TensorFlow) had been imported.
_OFFLINE_PROBE = """
import sys
{call}
print("keras imported:", "keras" in sys.modules)
"""


@pytest.mark.parametrize(
    "call",
    [
        "import keras_vit\ntry:\n    keras_vit.vit_ti16(pretrained=True)\nexcept OSError as e:\n    print(e)",
        "from keras_vit.cli import main\nprint('status', main(['predict', IMAGE, '--model', 'vit_ti16']))",
        "from keras_vit.cli import main\n"
        "print('status', main(['finetune', '--model', 'vit_ti16', '--pretrained', 'true',\n"
        "    '--output-dir', OUT]))",
    ],
    ids=["python", "predict", "finetune"],
)
def test_missing_checkpoint_is_refused_before_keras_loads(call, tmp_path):
    """The checkpoint is resolved (and refused) before Keras and the backend are imported: the error
    takes a fraction of a second, not the backend's seconds of start-up."""
    image = tmp_path / "cat.jpg"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(image)
    code = call.replace("IMAGE", repr(str(image))).replace("OUT", repr(str(tmp_path / "run")))
    env = subprocess_env(HF_HOME=str(tmp_path / "hf"))  # offline (subprocess_env), an empty cache
    result = subprocess.run(
        [sys.executable, "-c", _OFFLINE_PROBE.format(call=code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    output = result.stdout + result.stderr
    assert "keras imported: False" in result.stdout, output
    assert "not in the cache" in output and "vit_ti16" in output, output
    assert "status 0" not in result.stdout and not (tmp_path / "run").exists()


def test_cached_file_is_used_when_the_network_refuses(tmp_path, monkeypatch, network_attempts):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    entry = catalog.get_entry("vit_ti16.augreg_in21k_ft_in1k")
    body = b"not really a checkpoint"
    root = tmp_path / f"models--{entry.hub_repo.replace('/', '--')}"
    blob = root / "blobs" / hashlib.sha256(body).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(body)
    link = root / "snapshots" / ("0" * 40) / entry.filename
    link.parent.mkdir(parents=True)
    link.symlink_to(Path("..", "..", "blobs", blob.name))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0" * 40)
    path = kp.download_checkpoint(entry, cache_dir=tmp_path)
    assert Path(path).read_bytes() == body  # huggingface_hub's one revision check was refused
    assert network_attempts == [("huggingface.co", 443)]


# ---------------------------------------------------------------- 5. the command line prints its own messages


def test_cli_prints_only_its_own_messages(tmp_path):
    listing = _run_cli("models", cwd=tmp_path)
    assert listing.returncode == 0 and listing.stderr == ""
    assert "vit_digits" in listing.stdout
    failed = _run_cli("predict", "missing.png", "--model", "vit_digits", "--weights", "false", cwd=tmp_path)
    assert failed.returncode == 1
    assert failed.stderr.splitlines() == [  # the images are checked before the model is built
        "keras-vit: error: image 'missing.png' does not exist.",
    ]


def test_the_python_quick_start_prints_no_tensorflow_start_up_lines(tmp_path):
    """`import keras_vit` then a model: TensorFlow's C++ start-up lines (oneDNN, cuda drivers, printed
    as each of its libraries loads) are hidden when the user set no TF_CPP_MIN_LOG_LEVEL."""
    env = {key: value for key, value in subprocess_env().items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", "import keras_vit; keras_vit.vit_digits(); print('built')"],
        env={**env, "KERAS_BACKEND": "tensorflow"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout == "built\n", done.stderr[-2000:]
    noise = ("oneDNN custom operations", "cudart_stub", "absl::InitializeLog", "To enable the following")
    assert not [line for line in done.stderr.splitlines() if any(part in line for part in noise)]


def test_debug_flag_shows_the_traceback(tmp_path):
    with pytest.raises(FileNotFoundError):
        cli.main(
            [
                "--debug",
                "predict",
                str(tmp_path / "missing.png"),
                "--model",
                "vit_digits",
                "--weights",
                "false",
            ]
        )


@pytest.mark.slow
def test_tensorflow_error_in_the_input_pipeline_is_one_clean_line(tmp_path, capsys):
    folder = _image_folder(tmp_path / "pets")
    (folder / "train" / "cat" / "broken.png").write_text("not an image")
    argv = ["train", "--dataset", str(folder), "--batch-size", "4", "--steps", "8", "--output-dir"]
    assert cli.main([*argv, str(tmp_path / "run"), "--verbose", "0", "--jit-compile", "off"]) == 1
    error = capsys.readouterr().err.splitlines()
    assert len(error) == 1 and error[0].startswith("keras-vit: error: 1 of the ")  # checked before training
    assert "broken.png (UnidentifiedImageError" in error[0] and "--on-bad-image skip" in error[0]


# ---------------------------------------------------------------- 6. and 7. reports, class names, export


@pytest.mark.slow
def test_reports_record_resolved_values_and_class_names_reach_the_export(tmp_path, capsys):
    folder = _image_folder(tmp_path / "pets")
    run = tmp_path / "run"
    result = training.train(
        TINY, str(folder), output_dir=run, batch_size=4, steps=4, jit_compile=False, verbose=0
    )
    report = json.loads((run / "report.json").read_text())
    assert report == json.loads(json.dumps(result.report))
    assert report["arguments"]["learning_rate"] is None and report["arguments"]["drop_path_rate"] is None
    assert report["model"] == "vit_tiny_test" and report["model_config"] == TINY.to_dict()
    assert report["recipe"] == "pretrain" and report["recipe_description"].endswith("from scratch")
    assert report["checkpoint"] is None
    hyper = report["hyperparameters"]
    assert (hyper["learning_rate"], hyper["warmup_steps"], hyper["weight_decay"]) == (3e-3, 0, 0.05)
    assert (hyper["drop_path_rate"], hyper["label_smoothing"], hyper["batch_size"], hyper["steps"]) == (
        0.1,
        0.1,
        4,
        4,
    )
    assert hyper["optimizer"]["class"] == "KernelDecayAdamW" and hyper["optimizer"]["global_clipnorm"] == 1.0
    assert hyper["optimizer"]["learning_rate"]["config"]["peak_learning_rate"] == 3e-3
    data = report.pop("data")
    assert {key: data[key] for key in ("dataset", "train_examples", "test_examples", "num_classes")} == {
        "dataset": str(folder),
        "train_examples": 8,
        "test_examples": 8,
        "num_classes": 2,
    }
    assert sum(data["images_per_class"].values()) == 8 and set(data["images_per_class"]) == {"cat", "dog"}
    assert all(not split["files"] and not split["reads_skipped"] for split in data["bad_images"].values())
    assert report["class_names"] == ["cat", "dog"] and report["labels_file"] == "labels.txt"
    assert read_labels(run / "labels.txt") == ["cat", "dog"]
    assert not report["strategy"].startswith("_") and report["replicas"] == 1 and report["devices"]
    assert report["versions"]["keras_vit"] == keras_vit.__version__ and "numpy" in report["versions"]
    assert report["machine"]["cpu"] and isinstance(report["machine"]["gpus"], list)
    assert (
        report["wall_seconds"] >= report["fit_seconds"] > 0 and report["started_at"] <= report["finished_at"]
    )
    assert set(report["final_training_metrics"]) >= {"loss", "accuracy"}

    # Fine-tuning that checkpoint: the report names the file and its hash, and the recipe's own values.
    tuned = training.finetune(
        "vit_b16", str(folder), pretrained=str(run / "model.keras"), output_dir=tmp_path / "tuned",
        batch_size=4, steps=2, jit_compile=False, verbose=0,
    )  # fmt: skip
    report = tuned.report
    assert report["model"] == "vit_tiny_test" and report["model_config"]["hidden_size"] == 32  # not vit_b16
    assert report["recipe"] == "finetune" and report["recipe_description"].endswith("from a checkpoint")
    digest = hashlib.sha256((run / "model.keras").read_bytes()).hexdigest()
    assert report["checkpoint"]["sha256"] == digest and report["checkpoint"]["file"] == str(
        run / "model.keras"
    )
    assert (report["hyperparameters"]["learning_rate"], report["hyperparameters"]["drop_path_rate"]) == (
        0.01,
        0.0,
    )
    assert report["hyperparameters"]["optimizer"]["class"] == "SGD"

    # `keras-vit export --model RUN/model.keras` finds labels.txt next to it.
    assert (
        cli.main(["export", str(tmp_path / "served"), "--model", str(run / "model.keras"), "--no-warmup"])
        == 0
    )
    assert capsys.readouterr().out.strip().endswith(f"top 2; class names from {run / 'labels.txt'})")
    assert (
        cli.main(
            ["predict", str(folder / "test" / "dog" / "0.png"), "--saved-model", str(tmp_path / "served")]
        )
        == 0
    )
    names = [line.split()[-1] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert sorted(names) == ["cat", "dog"]
    # --labels replaces them, for any model.
    (tmp_path / "mine.txt").write_text("left\nright\n")
    argv = [
        "export",
        str(tmp_path / "served"),
        "--model",
        str(run / "model.keras"),
        "--no-warmup",
        "--version",
        "2",
    ]
    assert cli.main([*argv, "--labels", str(tmp_path / "mine.txt")]) == 0
    assert (
        cli.main(
            ["predict", str(folder / "test" / "dog" / "0.png"), "--saved-model", str(tmp_path / "served")]
        )
        == 0
    )
    names = [line.split()[-1] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert sorted(names) == ["left", "right"]


# ---------------------------------------------------------------- 8. small things


def test_weights_listing_marks_each_default(capsys):
    assert cli.main(["weights", "vit_ti16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    marked = [line.split()[0] for line in lines if line.endswith("(default)")]
    assert marked == [catalog.default_tag("vit_ti16")] and len(lines) == len(
        catalog.list_pretrained("vit_ti16")
    )
    assert cli.main(["pretrained"]) == 0
    marked = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.endswith("(default)")]
    assert sorted(marked) == sorted(catalog.default_tags().values())


def test_models_listing_shows_small_models_and_hybrid_stems(capsys):
    assert cli.main(["models"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == set(VARIANTS)
    assert rows["vit_digits"].split()[5:7] == ["4", "32"]  # px/token and image size
    assert rows["vit_r_ti16"].endswith("root only") and rows["vit_r50_b16"].endswith("(3, 4, 9)")
    assert rows["vit_r_ti16"].split()[5] == "32"  # 4x the ResNet root's stride, 8x8 patches


def test_random_weights_warning_is_printed_once(tmp_path, capsys):
    images = []
    for index in range(2):
        images.append(str(tmp_path / f"{index}.png"))
        Image.fromarray(np.full((8, 8, 3), 60 * index, np.uint8)).save(images[-1])
    assert cli.main(["predict", *images, "--model", "vit_digits", "--weights", "false", "--top", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("random weights") == 1
    assert len([line for line in captured.out.splitlines() if line.startswith("  ")]) == 4


def test_ci_upgrades_pip_only_when_it_is_old():
    script = (ROOT / ".ci" / "run").read_text()
    upgrade = script.index("pip install -q --upgrade pip")
    assert "pip.__version__" in script[:upgrade] and script[:upgrade].rstrip().endswith("then")


@pytest.mark.slow
def test_masked_patch_example_prints_progress(tmp_path, capsys):
    example = runpy.run_path(str(ROOT / "examples" / "masked_patch_digits.py"))  # defines main, runs nothing
    argv = ["--seeds", "0", "--pretrain-steps", "100", "--finetune-steps", "4"]
    assert example["main"]([*argv, "--output", str(tmp_path / "result.json")]) == 0
    out = capsys.readouterr().out
    assert "seed 0: masked-patch pre-training, 100 steps" in out
    assert re.search(r"pre-training: step 100/100, loss \d", out)
    assert (
        "fine-tuning the pre-trained model: step 4/4" in out and "fine-tuning from scratch: step 4/4" in out
    )


# ---------------------------------------------------------------- 9. the logits trap


def test_factories_output_probabilities_and_the_driver_asks_for_logits():
    model = keras_vit.vit_digits(num_classes=10)
    assert model.classifier_activation == "softmax"
    probabilities = keras.ops.convert_to_numpy(model(np.zeros((2, 32, 32, 3), "float32")))
    np.testing.assert_allclose(probabilities, 0.1, atol=1e-6)  # zero head: uniform
    assert keras_vit.build_vit(TINY, num_classes=3).classifier_activation == "softmax"
    assert keras_vit.ViT(TINY, num_classes=3).classifier_activation is None  # the low-level class: logits
    assert model.with_head(4).classifier_activation == "softmax"  # keeps the model's own
    assert model.with_head(4, classifier_activation=None).classifier_activation is None
    config = VARIANTS["vit_digits"]
    assert training._build_model(config, False, 32, 10, 0.0, 0.0).classifier_activation is None
    backbone = keras_vit.build_vit(TINY, include_top=False, pooling=None)
    assert training._build_model(TINY, backbone, None, 3, 0.0, 0.0).classifier_activation is None


def test_decode_predictions_reads_logits_and_probabilities_alike():
    logits = np.random.default_rng(0).normal(size=(2, 1000)).astype("float32")
    shifted = np.exp(logits - logits.max(-1, keepdims=True))
    probabilities = shifted / shifted.sum(-1, keepdims=True)
    soft = keras_vit.build_vit(TINY, image_size=16)
    raw = keras_vit.build_vit(TINY, image_size=16, classifier_activation=None)
    expected = decode_predictions(logits, top=3)
    for preds, model in ((probabilities, soft), (logits, raw), (probabilities, None)):
        decoded = decode_predictions(preds, top=3, tag_or_model=model)
        assert [row[:2] for row in decoded[0]] == [row[:2] for row in expected[0]]
        np.testing.assert_allclose([row[2] for row in decoded[0]], [row[2] for row in expected[0]], rtol=1e-5)


@pytest.mark.slow
def test_the_keras_applications_habit_trains():
    """The snippet of issue 18, on the CPU-sized variant: the loss falls well below ln 10."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.repeat(np.repeat(digits.images, 4, axis=1), 4, axis=2)  # 8x8 -> 32x32
    x = np.repeat(images[..., None], 3, axis=-1).astype("float32") / 8.0 - 1.0  # 0..16 -> [-1, 1]
    y = digits.target
    m = keras_vit.vit_digits(num_classes=10)
    m.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    history = m.fit(x, y, epochs=6, batch_size=32, verbose=0)
    losses = history.history["loss"]
    assert losses[0] == pytest.approx(math.log(10), abs=0.1)
    assert min(losses) < 0.8 * math.log(10), losses  # measured: 1.52 after 6 epochs (seed 0)
