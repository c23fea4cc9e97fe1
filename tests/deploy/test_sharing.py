"""Writing the published formats (timm, transformers, Google .npz), the Hub upload and loading it back.

Tiny random-weight models are written with `keras_vit.save_pretrained`, then loaded by timm
(`timm.create_model("local-dir:...")`, its own hub-config loader), by transformers
(`from_pretrained`) and by keras_vit: logits within TOLERANCE of Keras (the `parity` fixture), the
keras_vit round trip exact.
"""

import json
import shutil
from pathlib import Path

import huggingface_hub
import keras
import numpy as np
import pytest
import timm
import torch
import transformers
from helpers import REPO, random_images
from helpers import checkpoint_writers as writers
from helpers.hub_cache import COMMIT

import keras_vit
from keras_vit.checkpoints.formats import FORMATS
from keras_vit.checkpoints.write_common import NotExpressibleError
from keras_vit.registry.variants import ViTConfig

TINY = ViTConfig("tiny_vit", 4, 32, 2, 2, 64, image_size=32)
# A stem-only R+ViT hybrid (timm's vit_tiny_r_s16_p8 family): 32 px per token, a 2x2 grid at 64 px.
TINY_HYBRID = ViTConfig("tiny_r_vit", 8, 32, 1, 2, 64, resnet_stages=(), image_size=64)
# Two ResNet stages (the second with a projection and an identity unit): a 4x4 grid at 32 px.
TINY_STAGED = ViTConfig("tiny_r2_vit", 1, 32, 1, 2, 64, resnet_stages=(1, 2), image_size=32)
LABELS = [f"class_{index}" for index in range(5)]
TOLERANCE = 7e-7  # max |logit difference| vs timm and transformers: about twice the largest gap (3.6e-7)
POOLED_TOLERANCE = 4e-7  # class-token-free (GAP, MAP) models vs timm: largest gap 1.9e-7
TOKENS_TOLERANCE = 1.7e-6  # the whole token sequence vs timm: largest gap 8.3e-7


def random_model(config: ViTConfig = TINY, seed: int = 0, **kwargs) -> keras.Model:
    """A logits model with every weight random (LayerNorm scales around 1), so no tensor is trivial."""
    kwargs.setdefault("num_classes", 5)
    model = keras_vit.build_vit(config, classifier_activation=None, **kwargs)
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        noise = rng.normal(0, 0.1, variable.shape) + (1.0 if variable.path.endswith("gamma") else 0.0)
        variable.assign(noise.astype("float32"))
    return model


def images_for(model: keras.Model) -> np.ndarray:
    return random_images(2, model.config.image_hw, model.channels)


def keras_logits(model: keras.Model, images: np.ndarray) -> np.ndarray:
    return keras.ops.convert_to_numpy(model(images))


def timm_logits(directory: Path, images: np.ndarray) -> np.ndarray:
    reference = timm.create_model(f"local-dir:{directory}", pretrained=True).eval()
    with torch.no_grad():
        return reference(writers.to_torch(images)).numpy()


def hf_outputs(directory: Path, images: np.ndarray, head: bool = True):
    cls = transformers.ViTForImageClassification if head else transformers.ViTModel
    reference = cls.from_pretrained(directory).eval()
    with torch.no_grad():
        return reference(writers.to_torch(images))


def assert_round_trip(model: keras.Model, directory: Path, images: np.ndarray) -> keras.Model:
    """keras_vit -> format -> keras_vit is exact: same config, same weights, same outputs."""
    back = keras_vit.load_pretrained(directory)
    assert back.get_config() == model.get_config()
    for original, loaded in zip(model.weights, back.weights, strict=True):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(loaded), keras.ops.convert_to_numpy(original)
        )
    np.testing.assert_array_equal(keras_logits(back, images), keras_logits(model, images))
    return back


@pytest.fixture(scope="module")
def tiny():
    return random_model()


def test_plain_model_in_every_format(tiny, tmp_path, parity):
    """timm and transformers rebuild the written model from their own config and give Keras's logits."""
    images = images_for(tiny)
    expected = keras_logits(tiny, images)
    written = {}
    for format in FORMATS:
        written[format] = keras_vit.save_pretrained(tiny, tmp_path / format, format, labels=LABELS)
        assert_round_trip(tiny, written[format], images)
    parity(timm_logits(written["timm"], images), expected, TOLERANCE, "timm")
    outputs = hf_outputs(written["hf"], images)
    parity(outputs.logits.numpy(), expected, TOLERANCE, "transformers")

    timm_config = json.loads((written["timm"] / "config.json").read_text())
    assert timm_config["num_classes"] == 5 and timm_config["label_names"] == LABELS
    assert timm_config["pretrained_cfg"]["mean"] == [0.5, 0.5, 0.5]
    assert timm_config["pretrained_cfg"]["crop_pct"] == 0.9
    hf_config = json.loads((written["hf"] / "config.json").read_text())
    assert hf_config["id2label"]["3"] == "class_3" and hf_config["architectures"] == [
        "ViTForImageClassification"
    ]
    assert hf_config["layer_norm_eps"] == 1e-6 and hf_config["hidden_act"] == "gelu"
    assert sorted(np.load(written["google_npz"] / "model.npz")) == sorted(
        writers.timm_to_google_npz(
            writers.state_dict_numpy(timm.create_model(f"local-dir:{written['timm']}", pretrained=True)),
            TINY.num_heads,
        )
    )
    assert keras_vit.deploy.sharing.read_metadata(written["hf"])["labels"] == LABELS


def test_google_npz_is_what_timm_loads(tiny, tmp_path, parity):
    """timm's own loader of the original Google files reads the written .npz into the same model."""
    from timm.models.vision_transformer import _load_weights

    directory = keras_vit.save_pretrained(tiny, tmp_path / "npz", "google_npz")
    reference = timm.create_model(f"local-dir:{keras_vit.save_pretrained(tiny, tmp_path / 'timm')}").eval()
    _load_weights(reference, str(directory / "model.npz"))
    images = images_for(tiny)
    with torch.no_grad():
        logits = reference(writers.to_torch(images)).numpy()
    parity(logits, keras_logits(tiny, images), TOLERANCE, "timm's .npz loader")


def test_hybrid_in_timm_and_google_npz(tmp_path, parity):
    model = random_model(TINY_HYBRID, num_classes=3)
    images = images_for(model)
    directory = keras_vit.save_pretrained(model, tmp_path / "timm", "timm")
    assert json.loads((directory / "config.json").read_text())["architecture"] == "vit_tiny_r_s16_p8_224"
    parity(timm_logits(directory, images), keras_logits(model, images), TOLERANCE, "timm")
    assert_round_trip(model, directory, images)
    assert_round_trip(model, keras_vit.save_pretrained(model, tmp_path / "npz", "google_npz"), images)
    with pytest.raises(NotExpressibleError, match="hybrid ResNet stem"):
        keras_vit.save_pretrained(model, tmp_path / "hf", "hf")
    assert not (tmp_path / "hf").exists()


def test_hybrid_with_resnet_stages(tmp_path):
    """Stages with projection and identity units go through the Google layout; timm has no such ResNet."""
    model = random_model(TINY_STAGED, num_classes=3)
    images = images_for(model)
    directory = keras_vit.save_pretrained(model, tmp_path / "npz", "google_npz")
    assert "block2/unit1/conv_proj/kernel" in np.load(directory / "model.npz")
    assert_round_trip(model, directory, images)
    with pytest.raises(NotExpressibleError, match=r"stages \(1, 2\): timm's hybrids have"):
        keras_vit.save_pretrained(model, tmp_path / "timm", "timm")
    with pytest.raises(NotExpressibleError, match="numerics 'jax'"):
        keras_vit.save_pretrained(
            random_model(TINY_HYBRID.replace(numerics="jax")), tmp_path / "timm", "timm"
        )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["npz"]


@pytest.mark.parametrize("pooling,fc_norm", [("gap", False), ("gap", True), ("map", False)])
def test_class_token_free_models_in_timm(pooling, fc_norm, tmp_path, parity):
    """Global average pooling (LayerNorm before or after it: timm's fc_norm) and attention pooling."""
    config = TINY.replace(class_token=False, pooling=pooling, fc_norm=fc_norm)
    model = random_model(config)
    images = images_for(model)
    directory = keras_vit.save_pretrained(model, tmp_path / "timm")
    parity(timm_logits(directory, images), keras_logits(model, images), POOLED_TOLERANCE, "timm")
    assert_round_trip(model, directory, images)
    if fc_norm:  # the Google layout normalises before pooling
        with pytest.raises(NotExpressibleError, match="fc_norm=True"):
            keras_vit.save_pretrained(model, tmp_path / "npz", "google_npz")
    else:
        assert_round_trip(model, keras_vit.save_pretrained(model, tmp_path / "npz", "google_npz"), images)
    with pytest.raises(NotExpressibleError, match=rf"no \[class\] token.*pooling='{pooling}'"):
        keras_vit.save_pretrained(model, tmp_path / "hf", "hf")


def test_numerics_travel_with_the_format(tmp_path, parity):
    """JAX numerics (tanh GELU) become timm's act_layer and transformers' hidden_act; hf's eps 1e-12 its
    layer_norm_eps; timm cannot say eps 1e-12, so it refuses that model."""
    images = images_for(random_model())
    jax_model = random_model(TINY.replace(numerics="jax"))
    expected = keras_logits(jax_model, images)
    timm_dir = keras_vit.save_pretrained(jax_model, tmp_path / "jax_timm")
    assert json.loads((timm_dir / "config.json").read_text())["model_args"]["act_layer"] == "gelu_tanh"
    parity(timm_logits(timm_dir, images), expected, TOLERANCE, "jax numerics, timm")
    hf_dir = keras_vit.save_pretrained(jax_model, tmp_path / "jax_hf", "hf")
    assert json.loads((hf_dir / "config.json").read_text())["hidden_act"] == "gelu_pytorch_tanh"
    parity(hf_outputs(hf_dir, images).logits.numpy(), expected, TOLERANCE, "jax numerics, transformers")
    assert assert_round_trip(jax_model, hf_dir, images).config.numerics == "jax"

    hf_model = random_model(TINY.replace(numerics="hf"))
    hf_dir = keras_vit.save_pretrained(hf_model, tmp_path / "hf_hf", "hf")
    assert json.loads((hf_dir / "config.json").read_text())["layer_norm_eps"] == 1e-12
    parity(
        hf_outputs(hf_dir, images).logits.numpy(), keras_logits(hf_model, images), TOLERANCE, "hf numerics"
    )
    with pytest.raises(NotExpressibleError, match="LayerNorm epsilon 1e-12"):
        keras_vit.save_pretrained(hf_model, tmp_path / "hf_timm", "timm")


def test_headless_model_with_pre_logits_is_a_vit_model_with_pooler(tmp_path, parity):
    model = random_model(include_top=False, representation_size=16)
    images = images_for(model)
    directory = keras_vit.save_pretrained(model, tmp_path / "hf", "hf")
    assert json.loads((directory / "config.json").read_text())["architectures"] == ["ViTModel"]
    outputs = hf_outputs(directory, images, head=False)
    parity(outputs.pooler_output.numpy(), keras_logits(model, images), TOLERANCE, "transformers pooler")
    assert_round_trip(model, directory, images)
    with pytest.raises(NotExpressibleError, match="pre-logits"):
        keras_vit.save_pretrained(model, tmp_path / "timm", "timm")
    tokens = random_model(include_top=False, pooling=None)  # the token sequence: timm's global_pool=""
    timm_dir = keras_vit.save_pretrained(tokens, tmp_path / "tokens")
    parity(timm_logits(timm_dir, images), keras_logits(tokens, images), TOKENS_TOLERANCE, "timm tokens")
    classifier = random_model(representation_size=16)
    with pytest.raises(NotExpressibleError, match="pre-logits layer before the head"):
        keras_vit.save_pretrained(classifier, tmp_path / "hf_classifier", "hf")


def test_bad_requests_write_nothing(tiny, tmp_path):
    with pytest.raises(ValueError, match="Unknown checkpoint format 'onnx'"):
        keras_vit.save_pretrained(tiny, tmp_path / "x", "onnx")
    with pytest.raises(ValueError, match="labels has 2 names but the model's head has 5 classes"):
        keras_vit.save_pretrained(tiny, tmp_path / "x", labels=["a", "b"])
    with pytest.raises(ValueError, match="not a keras_vit.ViT"):
        keras_vit.save_pretrained(
            keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), tmp_path / "x"
        )
    assert not (tmp_path / "x").exists()

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    keras_vit.save_pretrained(tiny, occupied)  # beside the user's files, which are kept
    assert sorted(path.name for path in occupied.iterdir()) == [
        "README.md",
        "config.json",
        "keras_vit.json",
        "model.safetensors",
        "notes.txt",
    ]
    with pytest.raises(FileExistsError, match="already holds keras_vit output.*overwrite=True"):
        keras_vit.save_pretrained(tiny, occupied)
    keras_vit.save_pretrained(tiny, occupied, overwrite=True)
    assert (occupied / "notes.txt").read_text() == "mine"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["occupied"]  # no staging folder left
    (tmp_path / "empty").mkdir()
    keras_vit.save_pretrained(tiny, tmp_path / "empty", "google_npz")  # an empty folder is fine


def _fake_hub(monkeypatch, cache: Path) -> dict:
    """create_repo / upload_folder stand-ins: record the calls and lay the folder out as the hub cache."""
    calls = {}

    def create_repo(repo_id, **kwargs):
        calls["create_repo"] = (repo_id, kwargs)
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(*, repo_id, folder_path, **kwargs):
        calls["upload_folder"] = (repo_id, kwargs, sorted(path.name for path in Path(folder_path).iterdir()))
        calls["card"] = (Path(folder_path) / "README.md").read_text()
        root = cache / f"models--{repo_id.replace('/', '--')}"
        shutil.copytree(folder_path, root / "snapshots" / COMMIT)
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text(COMMIT)
        return huggingface_hub.CommitInfo(
            commit_url=f"https://huggingface.co/{repo_id}/commit/{COMMIT}",
            commit_message="",
            commit_description="",
            oid=COMMIT,
        )

    monkeypatch.setattr(huggingface_hub, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub, "upload_folder", upload_folder)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return calls


def test_push_to_hub_and_load_back(tiny, tmp_path, monkeypatch):
    calls = _fake_hub(monkeypatch, tmp_path / "hub")
    report = {
        "accuracy": 0.9805,
        "loss": 0.12,
        "test_examples": 360,
        "data": {"dataset": "digits", "train_examples": 1437},
        "hyperparameters": {"learning_rate": 0.003, "batch_size": 64, "optimizer": {"class": "AdamW"}},
    }
    (tmp_path / "report.json").write_text(json.dumps(report))
    url = keras_vit.push_to_hub(tiny, "someone/tiny-vit", report=tmp_path / "report.json", labels=LABELS)
    assert url == f"https://huggingface.co/someone/tiny-vit/commit/{COMMIT}"
    assert calls["create_repo"] == (
        "someone/tiny-vit",
        {"token": None, "private": None, "repo_type": "model", "exist_ok": True},
    )
    repo_id, arguments, files = calls["upload_folder"]
    assert repo_id == "someone/tiny-vit" and arguments["repo_type"] == "model"
    assert files == ["README.md", "config.json", "keras_vit.json", "model.safetensors"]
    card = calls["card"]
    for text in (
        "library_name: timm",
        f"parameters: {tiny.count_params():,}",
        "| accuracy | 0.9805 |",
        "| dataset | digits |",
        "| learning_rate | 0.003 |",
        "mean [0.5, 0.5, 0.5]",
        "5 classes in head order: class_0",
        'keras_vit.load_pretrained("hf-hub:someone/tiny-vit")',
        'timm.create_model("hf-hub:someone/tiny-vit", pretrained=True)',
    ):
        assert text in card, text

    images = images_for(tiny)
    assert_round_trip(tiny, "hf-hub:someone/tiny-vit", images)
    built = keras_vit.create_model(TINY, pretrained="hf-hub:someone/tiny-vit", classifier_activation=None)
    np.testing.assert_array_equal(keras_logits(built, images), keras_logits(tiny, images))
    with pytest.raises(keras_vit.WeightsUnavailableError, match="someone/missing"):
        keras_vit.load_pretrained("hf-hub:someone/missing")


def test_cli_convert_to_each_format(tiny, tmp_path, capsys, parity):
    """`keras-vit convert SOURCE OUT --to FORMAT [--overwrite]`, from a .keras file and a shared folder."""
    from keras_vit import cli

    saved = tmp_path / "tiny.keras"
    tiny.save(saved)
    (tmp_path / "labels.txt").write_text("\n".join(LABELS) + "\n")
    out = tmp_path / "tiny_hf"
    arguments = ["convert", str(saved), str(out), "--to", "hf", "--labels", str(tmp_path / "labels.txt")]
    assert cli.main(arguments) == 0
    assert "in the hf format" in capsys.readouterr().out
    images = images_for(tiny)
    parity(hf_outputs(out, images).logits.numpy(), keras_logits(tiny, images), TOLERANCE, "transformers")
    assert json.loads((out / "config.json").read_text())["id2label"]["0"] == "class_0"
    assert cli.main(arguments) == 1
    assert "already holds keras_vit output" in capsys.readouterr().err
    assert cli.main([*arguments, "--overwrite"]) == 0

    assert cli.main(["convert", str(out), str(tmp_path / "tiny_npz"), "--to", "google_npz"]) == 0
    assert_round_trip(tiny, tmp_path / "tiny_npz", images)
    assert cli.main(["convert", str(out), str(tmp_path / "again.keras")]) == 0
    np.testing.assert_array_equal(
        keras_logits(keras_vit.load_model(tmp_path / "again.keras"), images), keras_logits(tiny, images)
    )


def test_cli_push_uses_the_run_folder(tiny, tmp_path, monkeypatch, capsys):
    """`keras-vit push RUN/model.keras user/repo` takes the labels.txt and report.json beside the model."""
    from keras_vit import cli

    calls = _fake_hub(monkeypatch, tmp_path / "hub")
    run = tmp_path / "vit_run"
    run.mkdir()
    tiny.save(run / "model.keras")
    (run / "labels.txt").write_text("\n".join(LABELS) + "\n")
    (run / "report.json").write_text(json.dumps({"accuracy": 0.75, "test_examples": 8}))
    before = {path.name: path.read_bytes() for path in run.iterdir()}
    assert cli.main(["push", str(run / "model.keras"), "someone/run", "--format", "hf", "--private"]) == 0
    assert {path.name: path.read_bytes() for path in run.iterdir()} == before  # the run folder is only read
    assert f"commit/{COMMIT}" in capsys.readouterr().out
    assert calls["create_repo"][1]["private"] is True
    assert "library_name: transformers" in calls["card"] and "| accuracy | 0.75 |" in calls["card"]
    assert 'ViTForImageClassification.from_pretrained("someone/run")' in calls["card"]
    back = keras_vit.load_pretrained("hf-hub:someone/run")
    assert keras_vit.deploy.sharing.read_metadata("hf-hub:someone/run")["labels"] == LABELS
    np.testing.assert_array_equal(keras_logits(back, images_for(tiny)), keras_logits(tiny, images_for(tiny)))


@pytest.mark.slow  # ~15 s: three formats, an ONNX and a LiteRT export of vit_digits
def test_readme_share_and_deploy_examples(tmp_path, monkeypatch):
    """Every snippet and command at the top of docs/sharing.md ("Share and deploy") runs as written."""
    import re
    import shlex

    from keras_vit import cli

    page = (REPO / "docs" / "sharing.md").read_text()
    section = page.split("\n## ", 1)[0]  # the page's examples, before its first subsection
    python_blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    commands = [
        line for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S) for line in block.splitlines()
    ]
    assert len(python_blocks) == 3 and len(commands) == 4

    monkeypatch.chdir(tmp_path)
    _fake_hub(monkeypatch, tmp_path / "hub")
    run = Path("vit_run")
    run.mkdir()
    trained = keras_vit.create_model("vit_digits", num_classes=10)
    trained.save(run / "model.keras")
    (run / "labels.txt").write_text("\n".join(str(digit) for digit in range(10)) + "\n")
    (run / "report.json").write_text(json.dumps({"accuracy": 0.98, "data": {"dataset": "digits"}}))

    namespace = {}
    for block in python_blocks:
        exec(block, namespace)  # noqa: S102 - the README's own examples
    assert namespace["same"].get_config() == namespace["model"].get_config()
    assert namespace["hf_model"].config.num_labels == 10
    for command in commands:
        words = shlex.split(command)
        assert words[0] == "keras-vit" and cli.main(words[1:]) == 0, command
    for path in ("my_vit_timm2/model.safetensors", "my_vit_npz2/model.npz", "vit.onnx", "vit_int8.tflite"):
        assert Path(path).is_file(), path
    assert Path("vit_int8.tflite").stat().st_size < Path("vit.onnx").stat().st_size / 2  # int8 weights
