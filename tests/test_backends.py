"""Keras 3 backends: the same `.keras` file and the same logits on JAX, PyTorch and TensorFlow.

The backend-neutral modules (tests/conftest.py's BACKEND_NEUTRAL_MODULES: layers, model contract,
every converter's parity, hybrids, the original code, GAP/MAP layouts, quantization and LoRA) run
on every backend from `.ci/run` (`KERAS_BACKEND=jax|torch python -m pytest`, which collects only
those). This module checks what needs two backends at once, with a subprocess per backend:
models saved here load there with the same logits (to `TOLERANCE`), train there (NumPy arrays, `PyDataset`)
without importing TensorFlow, and what they save loads back here (`tests/helpers/backend_worker.py`);
checkpoints load there with TensorFlow blocked (`tests/helpers/checkpoint_worker.py`).
"""

import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from helpers import checkpoint_writers as writers
from helpers import random_images, subprocess_env

import keras_vit
from keras_vit import ViTConfig

WORKER = Path(__file__).parent / "helpers" / "backend_worker.py"
CHECKPOINT_WORKER = Path(__file__).parent / "helpers" / "checkpoint_worker.py"
# Max |logit difference| between backends, float32: about twice the largest gap measured (the "parity
# gaps" `python -m pytest -n 0 tests/test_backends.py` lists): a `.keras` file's logits, and the logits
# of a checkpoint loaded on each backend.
TOLERANCE = 3e-7
# per checkpoint file, on JAX/PyTorch against TensorFlow: about twice the largest gaps (7.2e-7, 6e-7, 3.6e-7)
CHECKPOINT_TOLERANCE = {"model.npz": 1.5e-6, "model.safetensors": 1.2e-6, "hf": 8e-7}
CASES = {
    "plain": (ViTConfig("tiny_plain", 4, 32, 2, 2, 64, image_size=(16, 24)), {"representation_size": 8}),
    "hybrid": (ViTConfig("tiny_hybrid", 1, 32, 1, 2, 64, resnet_stages=(1,), image_size=32), {}),
    "gap": (ViTConfig("tiny_gap", 4, 32, 1, 2, 64, image_size=16, pooling="gap", class_token=False), {}),
}
BACKENDS = ["jax", "torch"]

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="run from the TensorFlow suite: drives the others",
)


def _randomised(model: keras.Model, seed: int) -> keras.Model:
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        weight.assign(rng.normal(0, 0.2, weight.shape).astype("float32"))
    return model


@pytest.fixture(scope="module")
def saved_here(tmp_path_factory):
    """Each case saved on TensorFlow with its inputs and logits."""
    folder = tmp_path_factory.mktemp("tensorflow")
    logits = {}
    for seed, (case, (config, arguments)) in enumerate(CASES.items()):
        model = _randomised(
            keras_vit.build_vit(config, num_classes=5, classifier_activation=None, **arguments), seed
        )
        images = random_images(2, config.image_hw, seed=seed)
        np.save(folder / f"{case}.npy", images)
        model.save(folder / f"{case}.keras")
        logits[case] = keras.ops.convert_to_numpy(model(images, training=False))
    return folder, logits


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_files_and_logits_agree_across_backends(backend, saved_here, tmp_path, parity):
    folder, expected = saved_here
    done = subprocess.run(
        [sys.executable, str(WORKER), str(folder), str(tmp_path)],
        env=subprocess_env(KERAS_BACKEND=backend),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["backend"] == backend
    assert not result["tensorflow_before_saving"]  # load, predict, inspect, fit: no TensorFlow
    for case, (config, _) in CASES.items():
        there = result["cases"][case]
        assert there["class"] == "ViT" and ViTConfig.from_dict(there["config"]) == config
        parity(np.array(there["logits"]), expected[case], TOLERANCE, f"{case} there")
        assert there["rollout_shape"] == [2, *config.image_hw]  # the rollout map at image resolution
        # ... and what that backend saved loads here with the same logits.
        back = keras_vit.load_model(tmp_path / f"{case}.keras")
        images = np.load(folder / f"{case}.npy")
        logits = keras.ops.convert_to_numpy(back(images, training=False))
        parity(logits, expected[case], TOLERANCE, f"{case} back")


def test_tensorflow_only_features_stop_at_once_on_another_backend(tmp_path):
    """SavedModel export on JAX: one clear error naming the backend to use, and nothing written."""
    code = (
        "import keras_vit, keras\n"
        "try:\n"
        "    model = keras_vit.vit_ti16(image_size=32, num_classes=2)\n"
        f"    keras_vit.export_serving(model, {str(tmp_path / 'sm')!r})\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(KERAS_BACKEND="jax"), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "needs the TensorFlow backend" in done.stdout and "KERAS_BACKEND=tensorflow" in done.stdout
    assert "runs on 'jax'" in done.stdout and not (tmp_path / "sm").exists()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny ViT as a timm safetensors file, a Google `.npz` and a transformers folder, with the
    TensorFlow backend's logits for each (`create_model(config, pretrained=...)`)."""
    folder = tmp_path_factory.mktemp("checkpoints")
    config = ViTConfig("tiny_checkpoint", 4, 64, 2, 2, 128, image_size=32)
    timm_model = writers.random_timm_vit_like(config, num_classes=10)
    state = writers.state_dict_numpy(timm_model)
    hf_model = writers.random_hf_vit(
        "vit_ti16",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        image_size=32,
        patch_size=4,
        num_labels=10,
    )
    paths = [
        writers.save_timm_safetensors(state, folder / "model.safetensors"),
        writers.save_npz(writers.timm_to_google_npz(state, num_heads=2), folder / "model.npz"),
        writers.save_hf(hf_model, folder / "hf", pytorch_bin=False),
    ]
    images = random_images(2, (32, 32))
    np.save(folder / "images.npy", images)
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    expected = {
        str(path): keras.ops.convert_to_numpy(
            keras_vit.create_model(config, pretrained=path, classifier_activation=None)(images)
        )
        for path in paths
    }
    return folder, expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_loading_checkpoints_needs_no_tensorflow(backend, checkpoints, tmp_path, parity):
    """Under JAX or PyTorch, TensorFlow blocked: every format inspected and loaded, TensorFlow's logits."""
    folder, expected = checkpoints
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, str(CHECKPOINT_WORKER), str(folder / "config.json"), str(folder / "images.npy"),
         str(out), *expected],
        env=subprocess_env(KERAS_BACKEND=backend),
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["backend"] == backend and result["tensorflow_imported"] == []
    formats = [result["checkpoints"][path]["format"] for path in expected]
    assert formats == ["timm", "google_npz", "hf"]
    for path, logits in expected.items():
        name = Path(path).name
        parity(result["checkpoints"][path]["logits"], logits, CHECKPOINT_TOLERANCE[name], name)
