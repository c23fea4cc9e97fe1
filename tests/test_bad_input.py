"""Bad input never passes silently: each case asserts the error (type and message) and that
nothing changed, in the model or on disk.

Prefixes: `test_edge_...` validation at the edges; `test_atomic_...` checkpoint loads that
change all weights or none; `test_bounded_...` checkpoint readers that refuse sizes a file
cannot hold before allocating; `test_resume_...` checksummed training backups;
`test_keras_file_...` damaged `.keras` files.
"""

import io
import json
import os
import struct
import tracemalloc
import warnings
import zipfile
import zlib

import keras
import numpy as np
import pytest
import tensorflow as tf
import torch
from helpers.checkpoint_writers import state_dict_numpy
from PIL import Image
from timm.models.vision_transformer import VisionTransformer

import keras_vit
from keras_vit import cli
from keras_vit.checkpoints import CheckpointError, load_checkpoint, read_checkpoint
from keras_vit.checkpoints.common import stem_name_map, stem_weights
from keras_vit.checkpoints.formats import FORMATS
from keras_vit.data import pyinput
from keras_vit.data import tfdata as data
from keras_vit.data.preprocessing import ImageTooLargeError, load_image, preprocess_input
from keras_vit.data.tf_preprocessing import decode_image
from keras_vit.models.build import build_vit
from keras_vit.registry.variants import ViTConfig
from keras_vit.training import classification as training
from keras_vit.training import pretrain, runs
from keras_vit.training.masked_patch import to_classifier
from keras_vit.utils import validation

NPZ_STEM = FORMATS["google_npz"].stem  # how each format names a hybrid's ResNet stem
TINY = ViTConfig(
    "tiny_bad_input", patch_size=8, hidden_size=32, depth=2, num_heads=2, mlp_dim=64, image_size=32
)
LAST_BLOCK_KERNEL = "blocks.1.mlp.fc2.weight"  # read last: earlier tensors would be assigned first


@pytest.fixture(scope="module")
def tiny_state() -> dict[str, np.ndarray]:
    """A timm state dict of TINY's architecture (random weights)."""
    torch.manual_seed(0)
    reference = VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=10
    )
    return state_dict_numpy(reference)


def _weights(model: keras.Model) -> list[np.ndarray]:
    return [np.array(keras.ops.convert_to_numpy(weight)) for weight in model.weights]


def _assert_unchanged(model: keras.Model, before: list[np.ndarray]) -> None:
    for value, old in zip(_weights(model), before, strict=True):
        np.testing.assert_array_equal(value, old)


def _nan_at_end(value: np.ndarray) -> np.ndarray:
    value = value.copy()
    value.flat[-3:] = np.nan
    return value


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda value: np.full(value.shape, "x"),
            r"blocks\.1\.mlp\.fc2\.weight holds string values \(<U1\), not floating point",
        ),
        (
            lambda value: (value * 100).astype(np.int32),
            r"blocks\.1\.mlp\.fc2\.weight holds integer values \(int32\)",
        ),
        (_nan_at_end, r"blocks\.1\.mlp\.fc2\.weight holds 3 NaN/Inf value\(s\) of 2048"),
        (
            lambda value: value.astype(np.float64) * 1e300,
            r"fc2\.weight holds \d+ NaN/Inf value\(s\).*float32",
        ),
        (lambda value: value[:, :-1], r"(?s)shapes differ.*blocks\.1\.mlp\.fc2\.weight \(32, 63\)"),
    ],
    ids=["string", "int32", "nan", "overflow", "shape"],
)
def test_atomic_load_refuses_a_bad_tensor_and_changes_nothing(tiny_state, damage, message):
    model = build_vit(TINY, num_classes=10)
    before = _weights(model)
    state = dict(tiny_state, **{LAST_BLOCK_KERNEL: damage(tiny_state[LAST_BLOCK_KERNEL])})
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(model, state)
    _assert_unchanged(model, before)
    load_checkpoint(model, tiny_state)  # the intact checkpoint loads: the failures were the damage
    kernel = model.get_layer("block_1").fc2.kernel.numpy()
    np.testing.assert_array_equal(kernel, tiny_state[LAST_BLOCK_KERNEL].T)


def test_atomic_load_reports_every_bad_tensor_and_resizes_nothing(tiny_state):
    """A model of another resolution (its position embedding resampled) stays unchanged too."""
    model = build_vit(TINY, num_classes=10, image_size=48)
    before = _weights(model)
    state = dict(tiny_state, **{"cls_token": tiny_state["cls_token"].astype(bool)})
    state[LAST_BLOCK_KERNEL] = _nan_at_end(tiny_state[LAST_BLOCK_KERNEL])
    with pytest.raises(
        CheckpointError, match=r"2 tensor\(s\) that cannot be loaded \(no weight .* changed\)"
    ):
        load_checkpoint(model, state)
    _assert_unchanged(model, before)


def test_atomic_stem_weights_refuse_an_integer_tensor():
    model = build_vit(ViTConfig("small_hybrid", 1, 64, 1, 2, 128, resnet_stages=(2, 1)), image_size=64)
    state = {
        key: np.ones(variable.shape, "float32") for key, variable in stem_name_map(model, NPZ_STEM).items()
    }
    state["block1/unit1/conv2/kernel"] = state["block1/unit1/conv2/kernel"].astype(np.int64)
    with pytest.raises(CheckpointError, match=r"block1/unit1/conv2/kernel holds integer values \(int64\)"):
        stem_weights(state, NPZ_STEM, model)


def _peak_bytes(function) -> int:
    """The peak of Python-tracked memory (numpy arrays included) while `function` runs."""
    tracemalloc.start()
    try:
        function()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_bounded_torch_broadcast_tensor_is_refused_before_allocating(tmp_path):
    path = tmp_path / "broadcast.bin"
    torch.save({"pos_embed": torch.zeros(1).expand(10**9)}, path)  # one float stored, 4 GB declared
    assert path.stat().st_size < 2000

    def read():
        with pytest.raises(
            CheckpointError, match=r"broadcast.bin: tensor 'pos_embed' declares 1000000000 elements"
        ):
            read_checkpoint(path)

    assert _peak_bytes(read) < 5 * 2**20
    torch.save({"w": torch.arange(6.0).reshape(2, 3).expand(4, 2, 3)}, path)  # within the bound? no: 24 > 6
    with pytest.raises(CheckpointError, match="stride 0"):
        read_checkpoint(path)


def test_bounded_torch_views_within_their_storage_still_read(tmp_path):
    """Tensors sharing a storage (views, transposes, slices) are not broadcasts: read as torch does."""
    base = torch.arange(12.0).reshape(3, 4)
    tensors = {"t": base.t(), "row": base[1], "col": base[:, 2]}
    torch.save(tensors, tmp_path / "views.pt")
    read = read_checkpoint(tmp_path / "views.pt")
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(read[name], tensor.numpy())


def test_bounded_torch_one_storage_under_many_names_is_refused(tmp_path):
    """Each name is copied out: many names for one storage would multiply a small file's memory."""
    shared = torch.zeros(1000)
    torch.save({"tied": shared, "tied_again": shared}, tmp_path / "tied.bin")  # tied weights: read
    assert read_checkpoint(tmp_path / "tied.bin").keys() == {"tied", "tied_again"}
    torch.save({f"copy_{index}": shared for index in range(5)}, tmp_path / "many.bin")
    with pytest.raises(CheckpointError, match=r"more than 4x its stored bytes \(at tensor 'copy_4'\)"):
        read_checkpoint(tmp_path / "many.bin")


def _npy(shape, data: bytes) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buffer.getvalue() + data


def test_bounded_npz_header_larger_than_its_record_is_refused(tmp_path):
    path = tmp_path / "lying.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("embedding/kernel.npy", _npy((10**9,), b"\0" * 16))
    assert path.stat().st_size < 1000

    def read():
        with pytest.raises(
            CheckpointError, match=r"lying.npz: array 'embedding/kernel' declares shape \(1000000000,\)"
        ):
            read_checkpoint(path)

    assert _peak_bytes(read) < 5 * 2**20


def test_bounded_zip_record_larger_than_its_bytes_can_hold_is_refused(tmp_path):
    """A record whose declared (uncompressed) size no deflate stream of its length can reach."""
    path = tmp_path / "forged.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("w.npy", _npy((4,), b"\0" * 16))
    data = bytearray(path.read_bytes())
    info = zipfile.ZipFile(path).getinfo("w.npy")
    forged = struct.pack("<I", 2**31)
    central = data.rindex(b"PK\x01\x02")  # uncompressed size at offset 24 of the central record
    data[central + 24 : central + 28] = forged
    data[info.header_offset + 22 : info.header_offset + 26] = forged  # and at 22 of the local header
    path.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"record w\.npy declares 2147483648 bytes, more than its \d+ stored"
    ):
        read_checkpoint(path)


def test_bounded_safetensors_header_naming_a_tensor_larger_than_the_file(tmp_path):
    header = json.dumps(
        {"blocks.0.attn.qkv.weight": {"dtype": "F32", "shape": [10**9], "data_offsets": [0, 4]}}
    )
    path = tmp_path / "lying.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0" * 4)
    with pytest.raises(
        CheckpointError, match=r"tensor 'blocks\.0\.attn\.qkv\.weight' declares shape \[1000000000\]"
    ):
        read_checkpoint(path)


class _Run:
    """A tiny compiled model and its backup folder, with epochs backed up by `EpochBackup`."""

    def __init__(self, backup_dir, run=None):
        self.backup_dir, self.run = str(backup_dir), run or {"steps": 2}
        self.model = self.make_model()

    @staticmethod
    def make_model() -> keras.Model:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss="mse")
        model.optimizer.build(model.trainable_variables)
        return model

    def backup_epochs(self, epochs: int) -> list[list[np.ndarray]]:
        """Back up `epochs` epochs (the weights change between them); each epoch's weights."""
        backup = runs.EpochBackup(self.backup_dir, self.run)
        backup.set_model(self.model)
        saved = []
        for epoch in range(epochs):
            self.model.layers[0].kernel.assign(np.full((3, 2), epoch + 1.0, "float32"))
            backup.on_epoch_end(epoch, {"loss": 1.0 / (epoch + 1)})
            saved.append(self.model.get_weights())
        return saved

    def restore(self) -> tuple[runs.EpochBackup, keras.Model]:
        backup, model = runs.EpochBackup(self.backup_dir, self.run), self.make_model()
        backup.set_model(model)
        backup.on_train_begin()
        return backup, model


def _files(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_resume_backups_carry_checksums_and_keep_the_previous_one(tmp_path):
    saved = _Run(tmp_path).backup_epochs(3)
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["sha256"] == {
        "epoch-000003.weights.h5": runs.file_sha256(tmp_path / "epoch-000003.weights.h5")
    }
    previous = json.loads((tmp_path / "state-previous.json").read_text())
    assert (previous["epoch"], previous["history"]) == (2, {"loss": [1.0, 0.5]})
    assert sorted(os.listdir(tmp_path)) == [
        "epoch-000002.weights.h5", "epoch-000003.weights.h5", "state-previous.json", "state.json",
    ]  # fmt: skip
    backup, model = _Run(tmp_path).restore()
    assert backup.epoch == 3
    for restored, value in zip(model.get_weights(), saved[2], strict=True):
        np.testing.assert_array_equal(restored, value)


@pytest.mark.parametrize("damage", ["weights", "state"])
def test_resume_damaged_backup_falls_back_to_the_previous_one(tmp_path, damage):
    run = _Run(tmp_path)
    saved = run.backup_epochs(3)
    if damage == "weights":  # one weight overwritten in the file: the run would resume corrupted
        path = tmp_path / "epoch-000003.weights.h5"
        data = bytearray(path.read_bytes())
        data[-200] ^= 0xFF
        path.write_bytes(bytes(data))
        problem = r"names epoch-000003\.weights\.h5, which does not match its SHA-256 checksum"
    else:
        (tmp_path / "state.json").write_text('{"epoch": 3, "weig')
        problem = r"cannot be read \(JSONDecodeError"
    files = _files(tmp_path)
    with pytest.warns(UserWarning, match=rf"Damaged backup ignored: .*state\.json {problem}.*epoch 2"):
        backup, model = run.restore()
    assert backup.epoch == 2 and backup.history == {"loss": [1.0, 0.5]}
    for restored, value in zip(model.get_weights(), saved[1], strict=True):
        np.testing.assert_array_equal(restored, value)
    assert _files(tmp_path) == files  # nothing deleted or rewritten before training goes on


def test_resume_stops_when_no_backup_is_intact(tmp_path):
    run = _Run(tmp_path)
    run.backup_epochs(2)
    os.remove(tmp_path / "epoch-000001.weights.h5")
    (tmp_path / "state.json").write_bytes(b"\x00" * 10)
    files = _files(tmp_path)
    expected = (
        r"backup in .* is damaged and cannot be resumed: .*state\.json cannot be read.*state-previous\.json "
        r"names epoch-000001\.weights\.h5, which is missing\. Delete .* to start the run over"
    )
    with pytest.raises(ValueError, match=expected):
        runs.EpochBackup(tmp_path, run.run)
    assert _files(tmp_path) == files


def test_resume_backup_without_checksums_is_not_trusted(tmp_path):
    (tmp_path / "epoch-000002.weights.h5").write_bytes(b"weights")
    (tmp_path / "state.json").write_text(json.dumps({"epoch": 2, "weights": "epoch-000002.weights.h5"}))
    with pytest.raises(ValueError, match=r"state\.json has no checksums"):
        runs.EpochBackup(tmp_path, {})


def test_resume_compares_paths_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "images").mkdir()
    spellings = [
        {"output_dir": "runs/x", "dataset": "images", "pretrained": "vit_ti16.augreg_in21k"},
        {"output_dir": "./runs/x/", "dataset": "./images", "pretrained": "vit_ti16.augreg_in21k"},
        {"output_dir": str(tmp_path / "runs" / "x"), "dataset": str(tmp_path / "images"),
         "pretrained": "vit_ti16.augreg_in21k"},
    ]  # fmt: skip
    resolved = [runs.resolve_paths(spelling) for spelling in spellings]
    assert resolved[0] == resolved[1] == resolved[2]
    assert resolved[0]["output_dir"] == os.path.realpath(tmp_path / "runs" / "x")
    assert resolved[0]["pretrained"] == "vit_ti16.augreg_in21k"  # a tag, not a path: as typed
    _Run(tmp_path / "backup", resolved[0]).backup_epochs(1)
    assert runs.EpochBackup(tmp_path / "backup", runs.resolve_paths(spellings[1])).epoch == 1
    with pytest.raises(ValueError, match=r"other arguments \(output_dir\)"):
        runs.EpochBackup(tmp_path / "backup", runs.resolve_paths(dict(spellings[1], output_dir="runs/y")))


@pytest.fixture(scope="module")
def keras_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keras") / "model.keras"
    build_vit(TINY, num_classes=10).save(path)
    return path


def _rewrite(source, target, change):
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(target, "w") as out:
        for name in archive.namelist():
            data = change(name, archive.read(name))
            if data is not None:
                out.writestr(name, data)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncated", "it is not a zip archive"),
        ("not_zip", "it is not a zip archive"),
        ("no_config", "the archive has no config.json"),
        ("bad_json", "JSONDecodeError"),
        ("bad_weights", "OSError: Unable to synchronously open file"),
    ],
)
def test_keras_file_damaged_gives_one_clear_error(keras_file, tmp_path, damage, message):
    path = tmp_path / "damaged.keras"
    data = keras_file.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "not_zip":
        path.write_text("not a model")
    else:
        _rewrite(
            keras_file,
            path,
            lambda name, content: {
                "no_config": None if name == "config.json" else content,
                "bad_json": b"{not json" if name == "config.json" else content,
                "bad_weights": content[: len(content) // 2] if name.endswith(".h5") else content,
            }[damage],
        )
    before = path.read_bytes()
    with pytest.raises(
        ValueError, match=rf"Cannot load the model file .*damaged\.keras: .*{message}.*download it again"
    ):
        keras_vit.load_model(path)
    assert path.read_bytes() == before


def test_keras_file_missing_or_damaged_in_the_cli(keras_file, tmp_path, capsys):
    assert isinstance(keras_vit.load_model(keras_file), keras.Model)  # the intact file loads
    with pytest.raises(FileNotFoundError, match=r"No model file at .*missing\.keras: check the path"):
        keras_vit.load_model(tmp_path / "missing.keras")
    (tmp_path / "broken.keras").write_bytes(b"PK\x03\x04 truncated")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        code = cli.main(["export", str(tmp_path / "export"), "--model", str(tmp_path / "broken.keras")])
    assert code == 1
    error = capsys.readouterr().err
    assert "keras-vit: error: Cannot load the model file" in error and "broken.keras" in error
    assert "Traceback" not in error and not (tmp_path / "export").exists()
    with pytest.raises(ValueError, match=r"Cannot load the model file .*broken\.keras: it is not a zip"):
        to_classifier(tmp_path / "broken.keras", 10)  # keras-vit train --pretrained x.keras


# --- test_edge_: validation at the edges (numbers, flags, images, training data) ----------------

EDGE_TINY = ViTConfig(
    "edge_tiny", patch_size=8, hidden_size=16, depth=1, num_heads=2, mlp_dim=32, image_size=16
)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--lr", "0"], "argument --learning-rate/--lr: must be > 0, got 0"),
        (["train", "--lr", "nan"], "argument --learning-rate/--lr: must be a finite number > 0, got nan"),
        (["train", "--lr", "inf"], "argument --learning-rate/--lr: must be a finite number > 0, got inf"),
        (["train", "--image-size", "0"], "argument --image-size: must be an integer >= 1, got 0"),
        (["train", "--image-size", "3.5"], "argument --image-size: expected an integer, got '3.5'"),
        (["train", "--weight-decay", "-1"], "argument --weight-decay: must be >= 0, got -1"),
        (["train", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got 0"),
        (["train", "--epochs", "nan"], "argument --epochs: must be a finite number > 0, got nan"),
        (["train", "--dropout", "1"], "argument --dropout: must be in [0, 1), got 1"),
        (["train", "--ema", "1"], "argument --ema: must be in (0, 1), got 1"),
        (["train", "--mixup", "-0.2"], "argument --mixup: must be >= 0, got -0.2"),
        (["train", "--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
        (["train", "--on-bad-image", "ignore"], "argument --on-bad-image: invalid choice: 'ignore'"),
        (["pretrain", "--corrupt-rate", "nan"], "argument --corrupt-rate: must be a finite number in (0, 1]"),
        (["predict", "x.png", "--top", "0"], "argument --top: must be an integer >= 1, got 0"),
        (["predict", "x.png", "--max-pixels", "0"], "argument --max-pixels: must be an integer >= 1, got 0"),
        (["export", "out", "--top-k", "-2"], "argument --top-k: must be an integer >= 1, got -2"),
        (["inspect", "x.png", "--discard-ratio", "1"], "argument --discard-ratio: must be in [0, 1), got 1"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else "",
)
def test_edge_cli_flag_is_refused_while_parsing(argv, message, tmp_path, monkeypatch, capsys):
    """Zero, NaN, infinity and out-of-range values fail at parse time with argparse's usage line."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: keras-vit") and message in error
    assert os.listdir(tmp_path) == []  # no run folder, nothing written


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(learning_rate=0.0), r"learning_rate must be > 0, got 0"),
        (dict(learning_rate=float("nan")), r"learning_rate must be a finite number > 0, got nan"),
        (dict(image_size=0), r"image_size must be an integer >= 1, got 0"),
        (dict(weight_decay=-1.0), r"weight_decay must be >= 0, got -1"),
        (dict(label_smoothing=float("inf")), r"label_smoothing must be a finite number in \[0, 1\)"),
        (dict(ema_momentum=1.0), r"ema_momentum must be in \(0, 1\), got 1"),
        (dict(mixup_alpha=float("inf")), r"mixup_alpha must be a finite number >= 0, got inf"),
        (dict(dropout=True), r"dropout must be a number, got True"),
        (dict(crop_scale=()), r"crop_scale must be a pair \(low, high\)"),
        (dict(crop_scale=(0.5, 0.2)), r"crop_scale high must be in \[0.5, 1\], got 0.2"),
        (dict(on_bad_image="ignore"), r"on_bad_image must be one of 'stop', 'skip'; got 'ignore'"),
        (dict(batch_size=0), r"batch_size must be an integer >= 1, got 0"),
        (dict(steps=0), r"steps must be an integer >= 1, got 0"),
        (dict(epochs=float("nan")), r"epochs must be a finite number > 0, got nan"),
        (dict(steps_per_epoch=2.5), r"steps_per_epoch must be an integer, got 2.5"),
        (dict(seed=-1), r"seed must be an integer >= 0, got -1"),
    ],
    ids=lambda value: ",".join(value) if isinstance(value, dict) else "",
)
def test_edge_train_argument_is_refused_before_anything_runs(arguments, message, tmp_path):
    output_dir = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        training.train(EDGE_TINY, output_dir=output_dir, **arguments)
    assert not output_dir.exists()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(learning_rate=0.0), r"learning_rate must be > 0, got 0"),
        (dict(mask_rate=float("nan")), r"mask_rate must be a finite number in \[0, 1\], got nan"),
        (dict(corrupt_rate=0.0), r"corrupt_rate must be in \(0, 1\], got 0"),
        (dict(bits=9), r"bits must be an integer in \[1, 8\], got 9"),
    ],
    ids=lambda value: ",".join(value) if isinstance(value, dict) else "",
)
def test_edge_pretrain_argument_is_refused_before_anything_runs(arguments, message, tmp_path):
    output_dir = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        pretrain.pretrain(EDGE_TINY, output_dir=output_dir, **arguments)
    assert not output_dir.exists()


def test_edge_validators_refuse_booleans_floats_and_non_finite_numbers():
    with pytest.raises(ValueError, match=r"steps must be an integer, got True \(bool\)"):
        validation.positive_int("steps", True)
    with pytest.raises(ValueError, match=r"steps must be an integer, got 3.0 \(float\)"):
        validation.positive_int("steps", 3.0)
    with pytest.raises(ValueError, match=r"rate must be a finite number in \[0, 1\), got -inf"):
        validation.fraction("rate", float("-inf"))
    with pytest.raises(ValueError, match=r"lr must be a number, got '1e-3' \(str\)"):
        validation.positive_number("lr", "1e-3")
    assert validation.positive_int("steps", np.int64(3)) == 3 and validation.non_negative_int("n", 0) == 0
    assert validation.number("decay", 0, minimum=0) == 0.0  # zero where zero means zero
    assert validation.image_size("image_size", (32, 48)) == (32, 48)
    with pytest.raises(FileNotFoundError, match=r"checkpoint '/no/such/file' does not exist"):
        validation.existing_file("checkpoint", "/no/such/file")


@pytest.fixture(scope="module")
def edge_model():
    return build_vit(TINY, num_classes=3)


@pytest.mark.parametrize(
    "shape, advice",
    [
        ((2, 32, 32, 1), r"got shape \(2, 32, 32, 1\): convert the images \(grayscale to RGB"),
        ((2, 32, 32, 4), r"got shape \(2, 32, 32, 4\): convert .* channels=4"),
        ((2, 40, 40, 3), r"got shape \(2, 40, 40, 3\): resize them to 32x32"),
        ((32, 32, 3), r"got shape \(32, 32, 3\): a single image needs a batch axis"),
    ],
    ids=["1-channel", "4-channel", "size", "no-batch"],
)
@pytest.mark.parametrize("how", ["call", "predict", "dataset"])
def test_edge_model_refuses_wrong_image_shapes_in_call_and_predict(edge_model, shape, advice, how):
    before = _weights(edge_model)
    images = np.zeros(shape, "float32")
    expected = rf"tiny_bad_input takes images of shape \(batch, 32, 32, 3\), {advice}"
    if how == "dataset":
        images = tf.data.Dataset.from_tensors(images)  # one element: the whole array
    with pytest.raises(ValueError, match=expected):
        edge_model(images) if how == "call" else edge_model.predict(images, verbose=0)
    _assert_unchanged(edge_model, before)
    if how == "predict":  # the refused predict left the model usable
        assert edge_model.predict(np.zeros((1, 32, 32, 3), "float32"), verbose=0).shape == (1, 3)


@pytest.mark.parametrize(
    "array, message",
    [
        (np.full((8, 8, 3), 0.5), r"float array within \[0.5, 0.5\], which looks like \[0, 1\] scaling"),
        (np.full((8, 8, 3), 300), r"pixel values in \[0, 255\], got \[300, 300\]\. For 16-bit pixels"),
        (np.full((8, 8, 3), -1.0), r"got \[-1, -1\]\. Images already normalised"),
        (np.full((8, 8, 3), np.nan), r"NaN or infinite values"),
        (np.zeros((8, 8, 3), bool), r"real pixel values, got dtype bool"),
        (np.zeros((8, 8, 5), "uint8"), r"\(H, W\) or \(H, W, C\) with C = 1, 3 or 4, got shape \(8, 8, 5\)"),
    ],
    ids=["float-0-1", "int-above-255", "negative", "nan", "bool", "5-channels"],
)
def test_edge_load_image_refuses_ambiguous_arrays(array, message):
    with pytest.raises(ValueError, match=message):
        load_image(array, 8, crop_pct=None)


def test_edge_load_image_reads_16_bit_and_grayscale_arrays_by_the_stated_rule():
    values = np.arange(64, dtype="uint16").reshape(8, 8) * 1000  # 16-bit grey up to 63000
    expected = np.repeat((values >> 8).astype("uint8")[..., None], 3, axis=-1)
    np.testing.assert_array_equal(load_image(values, 8, crop_pct=None), expected)  # 2-D: grey -> RGB
    floats = (values >> 8).astype("float64")
    np.testing.assert_array_equal(load_image(floats, 8, crop_pct=None), expected)  # floats in [0, 255]


def test_edge_load_image_16_bit_png_matches_tensorflow(tmp_path):
    """Pillow opens 16-bit grey PNGs as mode I;16 and used to clip them to white."""
    values = np.random.default_rng(0).integers(0, 65536, (16, 16, 1)).astype("uint16")
    path = tmp_path / "grey16.png"
    path.write_bytes(tf.io.encode_png(values).numpy())
    pixels = load_image(path, 16, crop_pct=None)
    np.testing.assert_array_equal(pixels, decode_image(tf.constant(path.read_bytes())).numpy())
    assert pixels.mean() < 200  # not almost white


def _png_header(width: int, height: int) -> bytes:
    """A 70-byte PNG that declares `width` x `height` 1-bit pixels (and holds none): a bomb's header."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> str:
    """A PNG header declaring 12000 x 12000 pixels (0.43 GB as RGB): above the default limit."""
    path = tmp_path_factory.mktemp("bomb") / "bomb.png"
    path.write_bytes(_png_header(12000, 12000))
    return str(path)


def test_edge_load_image_refuses_a_decompression_bomb_unread(bomb, tmp_path):
    with pytest.raises(
        ImageTooLargeError, match=r"bomb\.png' is 12000x12000 = 144,000,000 pixels, more than"
    ):
        load_image(bomb, 32)  # refused from the header: decoding would fail (it holds no pixels)
    huge = tmp_path / "huge.png"
    huge.write_bytes(_png_header(20000, 20000))  # above twice Pillow's limit: Pillow's error, ours
    with pytest.raises(ImageTooLargeError, match=r"huge\.png': Image size \(400000000 pixels\) exceeds"):
        load_image(huge, 32, max_pixels=None)
    small = tmp_path / "small.png"
    Image.new("RGB", (40, 30)).save(small)
    with pytest.raises(
        ImageTooLargeError, match=r"small\.png' is 40x30 = 1,200 pixels, more than the limit of 1,000"
    ):
        load_image(small, 32, max_pixels=1000)
    assert load_image(small, 32, max_pixels=1200).shape == (32, 32, 3)


def test_edge_cli_predict_on_a_decompression_bomb_is_one_error_line(bomb, capsys):
    code = cli.main(["predict", bomb, "--model", "vit_digits", "--weights", "false"])
    assert code == 1
    error = capsys.readouterr().err
    assert "keras-vit: error: " in error and "bomb.png" in error and "Traceback" not in error


def test_edge_preprocess_input_grayscale_and_channel_axis():
    grey = np.arange(20, dtype="uint8").reshape(4, 5)
    out = preprocess_input(grey)
    assert out.shape == (4, 5, 3)
    np.testing.assert_allclose(out[..., 1], grey / 127.5 - 1, atol=1e-6)
    with pytest.raises(
        ValueError, match=r"channels last \(1 or 3\), got shape \(2, 4, 5\).*images\[\.\.\., None\]"
    ):
        preprocess_input(np.zeros((2, 4, 5), "uint8"))
    with pytest.raises(ValueError, match=r"NaN or infinite"):
        preprocess_input(np.full((1, 4, 4, 3), np.inf))
    with pytest.raises(ValueError, match=r"got \[0, 1000\]: 16-bit images need reducing"):
        preprocess_input(np.array([[[[0, 0, 1000]]]]))


def test_edge_preprocess_input_memory_is_its_output():
    images = np.zeros((16, 64, 64, 3), "uint8")
    preprocess_input(images)  # warm-up (lazy imports, label tables)
    tracemalloc.start()
    out = preprocess_input(images)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert out.dtype == np.float32 and peak < 1.2 * out.nbytes  # no float temporaries


@pytest.mark.slow
def test_edge_saved_model_bytes_signature_refuses_too_many_pixels(tmp_path):
    """The export's pixel limit is checked from the header (JPEG, PNG) and on the decoded image."""
    from keras_vit.deploy.export import BYTES_SIGNATURE, export_serving

    model = build_vit(EDGE_TINY, num_classes=3)
    path = export_serving(model, tmp_path / "export", top_k=3, warmup=False, max_pixels=1000)
    serve = tf.saved_model.load(path).signatures[BYTES_SIGNATURE]

    def encoded(size, fmt):
        buffer = io.BytesIO()
        Image.new("RGB", size).save(buffer, format=fmt)
        return buffer.getvalue()

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"more than 1000 pixels"):
        serve(image_bytes=tf.constant([_png_header(12000, 12000)]))  # from the header: no pixels to decode
    for fmt in ("PNG", "JPEG", "WEBP"):  # WebP: checked on the decoded image, before resizing
        assert serve(image_bytes=tf.constant([encoded((40, 25), fmt)]))["probabilities"].shape == (1, 3)
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"more than 1000 pixels"):
            serve(image_bytes=tf.constant([encoded((40, 26), fmt)]))


def _image_folder(root, classes=("a", "b"), per_class=4, size=8):
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for name in classes:
            (root / split / name).mkdir(parents=True)
            for index in range(per_class):
                pixels = rng.integers(0, 256, (size, size, 3)).astype("uint8")
                Image.fromarray(pixels).save(root / split / name / f"{index}.png")
    return root


def _truncated_jpeg(path):
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (16, 16, 3)).astype("uint8")).save(
        buffer, format="JPEG"
    )
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda path: path.write_bytes(b"not an image"), "UnidentifiedImageError"),
        (lambda path: path.write_bytes(path.read_bytes()[:60]), "OSError"),
        (
            lambda path: _truncated_jpeg(path.with_suffix(".jpg")) or path.unlink(),
            "OSError: Truncated File Read",
        ),
        (lambda path: path.write_bytes(_png_header(12000, 12000)), "ImageTooLargeError: it is 12000x12000"),
    ],
    ids=["garbage", "truncated-png", "truncated-jpeg", "bomb"],
)
def test_edge_image_folder_names_a_bad_file_or_skips_it(tmp_path, damage, reason):
    root = _image_folder(tmp_path / "images")
    bad = root / "train" / "b" / "2.png"
    damage(bad)
    bad = bad if bad.exists() else bad.with_suffix(".jpg")
    files = sorted(str(path) for path in root.rglob("*"))
    with pytest.raises(data.BadImageError, match=rf"1 of the 8 image files .*{bad.name} \(({reason})"):
        data.from_directory(root / "train")
    with pytest.warns(
        UserWarning, match=rf"Skipped: 1 of the 8 image files in .*train cannot be read: .*{bad.name}"
    ) as caught:
        source = data.from_directory(root / "train", on_bad_image="skip")
    assert len(caught) == 1 and source.num_examples == 7 and str(bad) not in source.files
    assert source.class_counts == (4, 3)
    assert sorted(str(path) for path in root.rglob("*")) == files  # nothing deleted or moved


def test_edge_cli_train_stops_on_a_bad_image_naming_it(tmp_path, capsys):
    root = _image_folder(tmp_path / "images")
    (root / "test" / "a" / "1.png").write_bytes(b"\x89PNG broken")
    code = cli.main(
        ["train", "--dataset", str(root), "--output-dir", str(tmp_path / "run"), "--verbose", "0"]
    )
    assert code == 1
    error = capsys.readouterr().err
    assert "keras-vit: error: 1 of the 8 image files in" in error and "1.png" in error
    assert "--on-bad-image skip" in error and not (tmp_path / "run").exists()


@pytest.mark.parametrize("layout", ["one-folder", "empty-class-folder", "arrays"])
def test_edge_one_class_dataset_is_refused(tmp_path, layout):
    if layout == "arrays":
        images = np.zeros((8, 16, 16, 3), "uint8")
        source = data.from_arrays(images, np.zeros(8, "int32"), class_names=["cat", "dog"])
        dataset, expected = (source, source), r"1 class with examples \(dog without examples\)"
    else:
        root = _image_folder(tmp_path / "images", classes=("cat",))
        if layout == "empty-class-folder":
            (root / "train" / "dog").mkdir()
            (root / "test" / "dog").mkdir()
        dataset = root
        expected = r"The training data has 1 class with examples: a classifier needs at least two"
        if layout == "empty-class-folder":  # refused when the folder is listed, naming the class
            expected = r"Class folders of .*train that cannot be a class: 'dog' holds no image file"
    if layout == "arrays":
        expected = rf"The training data has {expected}: a classifier needs at least two"
    with pytest.raises(ValueError, match=expected):
        training.train(EDGE_TINY, dataset, output_dir=tmp_path / "run", steps=1, batch_size=2, verbose=0)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_edge_non_finite_loss_stops_the_cli_with_no_model(tmp_path, capsys):
    root = _image_folder(tmp_path / "images", size=16)
    run = tmp_path / "run"
    code = cli.main(
        [
            "train", "--dataset", str(root), "--output-dir", str(run), "--patch-size", "8",
            "--hidden-size", "16", "--depth", "1", "--heads", "2", "--mlp-dim", "32", "--image-size", "16",
            "--batch-size", "4", "--steps", "4", "--steps-per-epoch", "2", "--lr", "1e30",
            "--warmup-steps", "0", "--jit-compile", "off", "--verbose", "0",
        ]
    )  # fmt: skip
    assert code == 1
    error = capsys.readouterr().err
    assert (
        "keras-vit: error: The training loss became nan in epoch 1" in error and "no model was saved" in error
    )
    assert not (run / "model.keras").exists() and not (run / "backup" / "state.json").exists()
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "failed" and "training diverged" in report["error"]


@pytest.mark.slow
def test_edge_file_tensorflow_cannot_decode_is_named_after_the_fit_fails(tmp_path, monkeypatch):
    """A file that passes the cheap header check but fails TensorFlow's decoder mid-run is named."""
    root = _image_folder(tmp_path / "images", size=16)
    bad = root / "train" / "a" / "3.png"
    bad.write_bytes(bad.read_bytes()[:-30])  # the end cut off: caught by decoding only
    monkeypatch.setattr(pyinput, "image_problem", lambda path, max_pixels: None)  # as if the check passed
    with pytest.raises(data.BadImageError, match=rf"TensorFlow cannot decode 1 image file\(s\): {bad}"):
        training.train(
            EDGE_TINY, root, output_dir=tmp_path / "run", steps=2, batch_size=4, verbose=0, jit_compile=False
        )
    assert not (tmp_path / "run" / "model.keras").exists()
