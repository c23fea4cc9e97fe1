"""Masked patch prediction: corruption statistics, targets, masked loss, training, transfer, CLI."""

import json
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import subprocess_env
from keras import ops

import keras_vit
from keras_vit.cli import main as cli_main
from keras_vit.training import pretrain

TIMEOUT = 240
TINY = keras_vit.ViTConfig(
    "vit_tiny_test", patch_size=4, hidden_size=32, depth=2, num_heads=2, mlp_dim=64, image_size=16
)


def _normalised(pixels: np.ndarray) -> np.ndarray:
    """[0, 1] pixels -> the model's [-1, 1] input (Google normalisation)."""
    return ((pixels - 0.5) / 0.5).astype("float32")


def _hand_classes(pixels: np.ndarray, patch: int, cells: int, bits: int = 3) -> np.ndarray:
    """The quantised mean colour of each patch (or each cell of its grid), computed in plain numpy."""
    batch, height, width, channels = pixels.shape
    levels, cell = 2**bits, patch // cells
    out = np.zeros((batch, (height // patch) * (width // patch), cells * cells), dtype="int64")
    for b in range(batch):
        for row in range(height // patch):
            for col in range(width // patch):
                for cy in range(cells):
                    for cx in range(cells):
                        top, left = row * patch + cy * cell, col * patch + cx * cell
                        colour = (
                            pixels[b, top : top + cell, left : left + cell].astype("float64").mean((0, 1))
                        )
                        # Documented rule: a mean within 1e-4 bin below an edge is in the upper bin.
                        q = np.minimum(np.floor(colour * levels + 1e-4), levels - 1).astype(int)
                        value = sum(int(q[c]) * levels ** (channels - 1 - c) for c in range(channels))
                        out[b, row * (width // patch) + col, cy * cells + cx] = value
    return out


def test_corruption_statistics():
    batch, patches, width = 256, 16, 8
    layer = pretrain.PatchCorruption(0.5, 0.8, 0.1, seed=1)
    embeddings = np.random.default_rng(0).normal(size=(batch, patches, width)).astype("float32")
    out, corrupted = (ops.convert_to_numpy(t) for t in layer(embeddings))
    mask = ops.convert_to_numpy(layer.mask_token)[0, 0]

    # Exactly half of each image's patches are corrupted, each position equally often.
    np.testing.assert_array_equal(corrupted.sum(axis=1), np.full(batch, patches // 2))
    per_position = corrupted.sum(axis=0)  # Binomial(256, 0.5) each: sd 8, bounds at 5 sd
    assert np.all(np.abs(per_position - batch / 2) < 40), per_position

    unchanged = np.all(out == embeddings, axis=-1)
    masked = np.all(out == mask, axis=-1)
    assert np.all(unchanged[corrupted == 0]), "an uncorrupted patch was changed"
    flat = embeddings.reshape(-1, width)
    replaced = corrupted.astype(bool) & ~unchanged & ~masked
    for b, p in zip(*np.nonzero(replaced), strict=True):
        matches = np.flatnonzero(np.all(flat == out[b, p], axis=-1))
        assert len(matches) == 1 and matches[0] != b * patches + p  # another patch of the batch
    # Of the 2048 corrupted patches: Binomial(2048, 0.8 / 0.1 / 0.1); bounds at 5 sd (0.044, 0.033).
    total = corrupted.sum()
    assert total == batch * patches // 2
    assert abs(masked.sum() / total - 0.8) < 0.044
    assert abs(replaced.sum() / total - 0.1) < 0.033
    assert abs((corrupted.astype(bool) & unchanged).sum() / total - 0.1) < 0.033

    # Reproducible from the seed; the generator moves on between calls.
    again = pretrain.PatchCorruption(0.5, 0.8, 0.1, seed=1)
    np.testing.assert_array_equal(ops.convert_to_numpy(again(embeddings)[1]), corrupted)
    assert not np.array_equal(ops.convert_to_numpy(layer(embeddings)[1]), corrupted)


def test_mean_color_and_grid_targets_match_a_hand_computation():
    rng = np.random.default_rng(0)
    pixels = rng.random((3, 16, 8, 3))
    images = _normalised(pixels)
    for target, cells in (("mean_color", 1), ("grid_4x4", 4)):
        classes = ops.convert_to_numpy(pretrain.patch_targets(images, 8, target=target))
        np.testing.assert_array_equal(classes, _hand_classes(pixels, 8, cells))
    gray = pixels[..., :1]
    classes = ops.convert_to_numpy(pretrain.patch_targets(_normalised(gray), 4, bits=3))
    np.testing.assert_array_equal(classes, _hand_classes(gray, 4, 1))
    assert classes.max() < 8  # 8 classes for one channel (512 for RGB)

    # A mean exactly on a bin edge (510 / 16 / 255 = 0.125, from uint8 pixels) is in the upper bin.
    edge = np.zeros((1, 4, 4, 3))
    edge[0, 0, :2] = 255.0 / 255.0  # 2 of 16 pixels at 255: mean 0.125 in every channel
    edge_class = ops.convert_to_numpy(pretrain.patch_targets(_normalised(edge), 4))
    assert edge_class[0, 0, 0] == 1 * 64 + 1 * 8 + 1

    # Regression targets: each patch's normalised pixels, row-major patches, (row, column, channel).
    pixels_target = ops.convert_to_numpy(pretrain.patch_targets(images, 4, target="regression"))
    assert pixels_target.shape == (3, 8, 48)
    np.testing.assert_array_equal(pixels_target[1, 3], images[1, 4:8, 4:8].reshape(-1))


def test_uncorrupted_patches_carry_no_loss():
    model = pretrain.masked_patch_model(TINY, seed=0)
    images = _normalised(np.random.default_rng(1).random((4, 16, 16, 3)))
    outputs = model(images)
    corrupted = ops.convert_to_numpy(outputs["corrupted"])
    logits = ops.convert_to_numpy(outputs["predictions"])
    assert logits.shape == (4, 16, 1, 512) and corrupted.sum() == 4 * 8
    noisy = logits + np.random.default_rng(2).normal(scale=5.0, size=logits.shape).astype("float32")
    changed_clean = np.where(corrupted[..., None, None] == 0, noisy, logits)
    changed_corrupted = np.where(corrupted[..., None, None] == 1, noisy, logits)

    def loss(predictions):
        y_pred = {"predictions": predictions, "corrupted": outputs["corrupted"]}
        return float(model.compute_loss(x=images, y_pred=y_pred))

    assert loss(changed_clean) == loss(logits)
    assert abs(loss(changed_corrupted) - loss(logits)) > 0.1
    # The zero-initialised head predicts uniformly: the loss is log(512) at the start.
    assert loss(logits) == pytest.approx(np.log(512), rel=1e-5)
    targets = pretrain.patch_targets(images, 4)
    for kind, predictions, target in (
        ("mean_color", logits, targets),
        (
            "regression",
            np.zeros((4, 16, 48), "float32"),
            pretrain.patch_targets(images, 4, target="regression"),
        ),
    ):
        predictions = keras.Variable(predictions)
        with tf.GradientTape() as tape:
            value = pretrain.masked_patch_loss(target, predictions, corrupted, kind)
        gradient = tape.gradient(value, predictions).numpy()
        assert np.all(gradient[corrupted == 0] == 0) and np.any(gradient[corrupted == 1] != 0), kind


@pytest.mark.slow
def test_pretrain_cli_loss_falls_on_digits_and_backbone_transfers(tmp_path):
    out = tmp_path / "mpp"
    code = cli_main(
        [
            "pretrain", "--patch-size", "4", "--hidden-size", "32", "--depth", "2", "--heads", "2",
            "--mlp-dim", "64", "--image-size", "16", "--batch-size", "32", "--steps", "60",
            "--steps-per-epoch", "20", "--learning-rate", "2e-3", "--warmup-steps", "5",
            "--output-dir", str(out), "--verbose", "0",
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    losses = report["history"]["loss"]
    assert report["steps"] == 60 and len(losses) == 3 and report["chance_loss"] == pytest.approx(np.log(512))
    assert losses[-1] < 0.6 * losses[0], losses  # from ~log(512) = 6.2 on real (digit) images
    assert report["history"]["patch_accuracy"][-1] > 0.2
    train, test = keras_vit.data.tfdata.load_digits()
    assert report["pretraining_examples"] == train.num_examples  # the train split only, never test

    backbone = keras.saving.load_model(out / "backbone.keras")
    assert backbone.output_shape == (None, 17, 32)
    classifier = pretrain.to_classifier(
        out / "backbone.keras", 10, pooling="gap", dropout=0.1, drop_path_rate=0.2
    )
    for layer in backbone.layers:
        for mine, theirs in zip(classifier.get_layer(layer.name).weights, layer.weights, strict=True):
            np.testing.assert_array_equal(ops.convert_to_numpy(mine), ops.convert_to_numpy(theirs))
    assert classifier.get_layer("block_1").drop_path == pytest.approx(0.2)
    assert classifier.get_layer("block_0").dropout == 0.1 and classifier.get_layer("pos_dropout").rate == 0.1
    assert classifier.output_shape == (None, 10) and classifier.get_layer("pool").mode == "gap"
    # An independent copy: changing the classifier leaves the backbone alone.
    source = backbone.get_layer("patch_embed").projection.kernel
    before = ops.convert_to_numpy(source).copy()
    kernel = classifier.get_layer("patch_embed").projection.kernel
    kernel.assign(kernel + 1.0)
    np.testing.assert_array_equal(ops.convert_to_numpy(source), before)

    # `keras-vit finetune` starts from the backbone file; a size other than its own is refused.
    finetune = ["finetune", "--pretrained", str(out / "backbone.keras"), "--batch-size", "32", "--verbose=0"]
    assert cli_main([*finetune, "--image-size", "32", "--output-dir", str(tmp_path / "bad")]) == 1
    assert cli_main([*finetune, "--steps", "4", "--output-dir", str(tmp_path / "ft")]) == 0
    tuned = json.loads((tmp_path / "ft" / "report.json").read_text())
    assert tuned["steps"] == 4 and tuned["image_size"] == [16, 16]
    assert tuned["parameters"] == classifier.count_params()


@pytest.mark.slow
def test_model_round_trips_and_trains_its_backbone(tmp_path):
    model = pretrain.masked_patch_model(TINY, target="grid_4x4", seed=3)
    assert model.classes == 512 and model.cells == 16
    images = _normalised(np.random.default_rng(0).random((16, 16, 16, 3)))
    path = tmp_path / "mpp.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, pretrain.MaskedPatchPredictor)
    assert json.loads(json.dumps(loaded.get_config())) == json.loads(json.dumps(model.get_config()))
    for mine, theirs in zip(loaded.weights, model.weights, strict=True):
        assert mine.path == theirs.path
        np.testing.assert_array_equal(ops.convert_to_numpy(mine), ops.convert_to_numpy(theirs))
    np.testing.assert_allclose(loaded.backbone(images[:2]), model.backbone(images[:2]), atol=1e-6)

    # Fitting the loaded model trains its own backbone (labels in the data are ignored).
    fc1 = loaded.backbone.get_layer("block_0").fc1.kernel
    assert any(fc1 is variable for variable in loaded.trainable_variables)
    stream = tf.data.Dataset.from_tensor_slices((images, np.zeros(16, "int32"))).batch(8)
    loaded.compile(optimizer=keras.optimizers.Adam(1e-3))
    history = loaded.fit(stream, epochs=1, shuffle=False, verbose=0).history
    assert np.isfinite(history["loss"][0]) and 0.0 <= history["patch_accuracy"][0] <= 1.0
    original = model.backbone.get_layer("block_0").fc1.kernel
    assert not np.array_equal(ops.convert_to_numpy(fc1), ops.convert_to_numpy(original))


def test_hybrid_and_classifier_backbones():
    hybrid = keras_vit.ViTConfig(
        "vit_hybrid_test", patch_size=1, hidden_size=32, depth=1, num_heads=2, mlp_dim=64, resnet_stages=()
    )
    model = pretrain.masked_patch_model(hybrid, image_size=32)
    assert model.pixel_patch == 4  # the stem's stride 4, patch 1 on its 8x8 feature map
    outputs = model(_normalised(np.random.default_rng(0).random((2, 32, 32, 3))))
    assert outputs["predictions"].shape == (2, 64, 1, 512) and outputs["corrupted"].shape == (2, 64)
    # A classifier serves too: its weights are copied into a token-output backbone (no pooling, no head).
    classifier = keras_vit.build_vit(TINY, image_size=16, num_classes=5)
    predictor = pretrain.masked_patch_model(classifier)
    assert predictor.backbone.config.pooling is None and predictor.backbone.head is None
    for ours, theirs in zip(predictor.backbone.blocks, classifier.blocks, strict=True):
        assert ours is not theirs
        for a, b in zip(ours.get_weights(), theirs.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
    regression = pretrain.masked_patch_model(classifier, target="regression")
    assert regression(np.zeros((1, 16, 16, 3), "float32"))["predictions"].shape == (1, 16, 48)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="corrupt_rate must be in"):
        pretrain.PatchCorruption(corrupt_rate=1.5)
    with pytest.raises(ValueError, match="sum <= 1"):
        pretrain.PatchCorruption(mask_rate=0.8, random_rate=0.3)
    with pytest.raises(ValueError, match="rounds to no patch"):
        pretrain.PatchCorruption(corrupt_rate=0.1).build((None, 4, 8))
    with pytest.raises(ValueError, match="Unknown target 'pixels'"):
        pretrain.masked_patch_model(TINY, target="pixels")
    with pytest.raises(ValueError, match=r"bits must be an int in \[1, 8\]"):
        pretrain.patch_targets(np.zeros((1, 8, 8, 3)), 4, bits=0)
    with pytest.raises(ValueError, match="not divisible by the patch size 4"):
        pretrain.patch_targets(np.zeros((1, 10, 8, 3)), 4)
    with pytest.raises(ValueError, match="must be a multiple of 4"):
        pretrain.masked_patch_model(
            keras_vit.ViTConfig("odd", 6, 32, 1, 2, 64), image_size=12, target="grid_4x4"
        )
    with pytest.raises(ValueError, match="image height 18 is not divisible"):
        pretrain.masked_patch_model(TINY, image_size=18)
    with pytest.raises(ValueError, match="not a keras_vit.ViT"):
        pretrain.to_classifier(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), 3)
    with pytest.raises(ValueError, match=r"num_classes .*must be an integer >= 1"):
        pretrain.to_classifier(keras_vit.build_vit(TINY, image_size=16, include_top=False, pooling=None), 0)


MIRRORED = textwrap.dedent(
    """
    import json, sys
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import numpy as np
    import keras_vit
    from keras_vit.training import pretrain
    tiny = keras_vit.ViTConfig("vit_tiny_test", 4, 32, 1, 2, 64, image_size=16)
    images = np.random.default_rng(0).integers(0, 256, (64, 16, 16, 3)).astype("uint8")
    runs = {}
    for name, strategy in (
        ("one", tf.distribute.OneDeviceStrategy("/cpu:0")),
        ("mirrored", tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])),
    ):
        result = pretrain.pretrain(
            tiny, images, output_dir=sys.argv[1] + "/" + name, batch_size=32, steps=2, steps_per_epoch=2,
            learning_rate=1e-3, warmup_steps=1, random_rate=0.0, strategy=strategy, verbose=0,
        )
        runs[name] = (result.report["history"]["loss"], result.model.backbone.get_weights())
    gap = max(float(np.abs(a - b).max()) for a, b in zip(runs["one"][1], runs["mirrored"][1]))
    print(json.dumps({"one": runs["one"][0], "mirrored": runs["mirrored"][0], "gap": gap}))
    """
)


@pytest.mark.slow
def test_mirrored_two_cpus_matches_one_device(tmp_path):
    """Per-replica corruption draws and loss scaling: 2 replicas train exactly as one device.

    With `random_rate=0` nothing depends on how the batch is split (random replacements come
    from the replica's share), so the runs agree to float rounding.
    """
    done = subprocess.run(
        [sys.executable, "-c", MIRRORED, str(tmp_path)],
        capture_output=True, text=True, timeout=TIMEOUT, env=subprocess_env(), check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(result["mirrored"], result["one"], rtol=1e-5)
    assert result["gap"] < 1e-5
