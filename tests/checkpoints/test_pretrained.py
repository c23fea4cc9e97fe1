"""The checkpoint catalog, hub downloads (offline, with a local fake hub), `pretrained=`, and
preprocess_input / decode_predictions. All checkpoints are random ViT-Ti/16s made here."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from importlib import resources
from pathlib import Path

import keras
import numpy as np
import pytest
import safetensors.torch
import timm
import torch
from helpers import random_images
from helpers.hub_cache import cached_files, populate_cache
from timm.models import get_pretrained_cfg
from timm.models.vision_transformer_hybrid import checkpoint_filter_fn

import keras_vit
from keras_vit.checkpoints import FORMATS
from keras_vit.checkpoints import pretrained as kp
from keras_vit.data.preprocessing import LABEL_SETS, decode_predictions, preprocess_input
from keras_vit.registry import catalog
from keras_vit.registry.variants import VARIANTS

DEFAULT_REPO = "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k"  # vit_ti16's default tag
TOLERANCE = 4.5e-6  # max |logit difference| vs timm and transformers: largest gap 2.2e-6
FEATURES_TOLERANCE = 8e-6  # the [class] token's features vs timm: largest gap 4e-6
HYBRID_TOLERANCE = 1.5e-5  # R+ViT-Ti/16 at 384 px vs timm: largest gap 7.3e-6


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def timm_tiny(tmp_path_factory):
    """A random timm ViT-Ti/16 (every parameter perturbed) and its state dict as safetensors."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    safetensors.torch.save_file(model.state_dict(), str(path))
    return model, path


def one_hot(width: int, index: int) -> np.ndarray:
    row = np.zeros((1, width), dtype="float32")
    row[0, index] = 1.0
    return row


def timm_logits(model, images: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(images).permute(0, 3, 1, 2)).numpy()


# ---------------------------------------------------------------- catalog


def test_catalog_rows_are_well_formed():
    data = json.loads(resources.files("keras_vit.weights").joinpath("catalog.json").read_text())
    fields = {field.name for field in dataclasses.fields(catalog.CatalogEntry)}
    tags = [row["tag"] for row in data["checkpoints"]]
    assert len(tags) == len(set(tags))
    for row in data["checkpoints"]:
        assert set(row) == fields, row["tag"]
        assert row["variant"] in VARIANTS and row["tag"].startswith(row["variant"] + ".")
        assert re.fullmatch(r"[a-z0-9_]+", row["tag"].split(".", 1)[1]), row["tag"]
        assert row["format"] in FORMATS
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", row["hub_repo"])
        assert row["filename"].endswith((".safetensors", ".bin", ".npz"))
        assert row["resolution"] % VARIANTS[row["variant"]].stride == 0
        if row["num_classes"] is None:
            assert row["label_set"] is None
        else:
            assert LABEL_SETS[row["label_set"]] == row["num_classes"]
        assert row["representation_size"] in (None, VARIANTS[row["variant"]].hidden_size)
        assert len(row["mean"]) == len(row["std"]) == 3 and min(row["std"]) > 0
        assert row["sha256"] is None or re.fullmatch(r"[0-9a-f]{64}", row["sha256"])
        assert row["training_data"] and row["metadata_source"]
    # every variant with checkpoints (and every plain ViT but those named here) has a default that exists
    without_checkpoint = {
        "vit_digits": "the main job's CPU-sized model",
        "vit_s8": "its only published weights (DINO) are a self-supervised backbone the catalog lacks",
    }
    with_rows = {row["variant"] for row in data["checkpoints"]}
    paper_plain = {name for name, c in VARIANTS.items() if not c.is_hybrid and name not in without_checkpoint}
    assert with_rows | paper_plain <= set(data["defaults"])
    for variant, tag in data["defaults"].items():
        assert f"{variant}.{tag}" in tags
    assert data["defaults"]["vit_b16"] == "augreg2_in21k_ft_in1k"


def test_timm_rows_agree_with_installed_timm():
    rows = [catalog.get_entry(tag) for tag in catalog.list_pretrained()]
    timm_rows = [entry for entry in rows if entry.format == "timm"]
    # complete: every Google-trained timm checkpoint of a plain variant has a row
    plain = re.compile(
        r"vit_(tiny_patch16|small_patch(16|32)|base_patch(8|16|32)|large_patch(16|32)|huge_patch14)_\d+"
    )
    published = {
        name
        for name in timm.list_pretrained("vit_*")
        if plain.fullmatch(name.split(".")[0])
        and name.split(".")[1] not in ("dino", "mae", "bamboo")  # not Google's ViT weights
    }
    assert published <= {entry.hub_repo.removeprefix("timm/") for entry in timm_rows}
    for entry in timm_rows:
        name = entry.hub_repo.removeprefix("timm/")
        cfg = get_pretrained_cfg(name)
        assert cfg is not None, name
        assert cfg.hf_hub_id == entry.hub_repo
        assert entry.filename == (cfg.hf_hub_filename or "model.safetensors")
        assert cfg.input_size == (3, entry.resolution, entry.resolution), name
        assert (cfg.num_classes or None) == entry.num_classes, name
        assert tuple(cfg.mean) == entry.mean and tuple(cfg.std) == entry.std, name
        assert cfg.crop_pct == entry.crop_pct and cfg.interpolation == entry.interpolation, name
        assert name in entry.metadata_source


def test_imagenet1k_labels_match_torchvision():
    from torchvision.models._meta import _IMAGENET_CATEGORIES

    from keras_vit.data.preprocessing import imagenet1k_labels

    labels = imagenet1k_labels()
    assert list(labels) == list(_IMAGENET_CATEGORIES)
    assert len(set(labels)) == 1000 and labels[0] == "tench" and labels[999] == "toilet tissue"


def test_tags_resolve_and_wrong_variant_names_the_factory():
    assert catalog.default_tag("vit_b16") == "vit_b16.augreg2_in21k_ft_in1k"
    assert catalog.default_tag("vit_h14") == "vit_h14.orig_in21k"
    short = catalog.get_entry("augreg_in21k_ft_in1k_384", "vit_b16")
    assert short is catalog.get_entry("vit_b16.augreg_in21k_ft_in1k_384")
    assert (short.resolution, short.num_classes, short.label_set) == (384, 1000, "imagenet1k")
    with pytest.raises(ValueError, match=r"keras_vit\.vit_l16\(pretrained='vit_l16\.augreg_in21k_ft_in1k'\)"):
        keras_vit.vit_b16(pretrained="vit_l16.augreg_in21k_ft_in1k")
    with pytest.raises(ValueError, match=r"augreg2_in21k_ft_in1k.*exists for vit_b16, vit_b8"):
        keras_vit.vit_ti16(pretrained="augreg2_in21k_ft_in1k")
    with pytest.raises(FileNotFoundError, match="No checkpoint file"):
        keras_vit.vit_ti16(pretrained="missing/dir/model.safetensors")
    assert "| `vit_b16.augreg2_in21k_ft_in1k` (default) | 224 | 1000 |" in catalog.catalog_markdown()


# ---------------------------------------------------------------- downloads and the cache


def test_offline_cache_miss_names_repo_file_and_local_alternative(hub_cache):
    with pytest.raises(kp.WeightsUnavailableError) as caught:
        keras_vit.vit_ti16(pretrained=True)
    message = str(caught.value)
    assert DEFAULT_REPO in message and "'model.safetensors'" in message and "HF_HUB_OFFLINE" in message
    assert "keras_vit.vit_ti16(pretrained='/path/to/model.safetensors')" in message
    assert "set HF_HUB_OFFLINE=1" not in message  # it is set: no advice to set it
    assert isinstance(caught.value, OSError)
    assert cached_files(hub_cache) == []


def test_pretrained_true_from_cache_matches_timm_and_remembers_its_tag(
    hub_cache, timm_tiny, tmp_path, parity
):
    reference, path = timm_tiny
    populate_cache(hub_cache, DEFAULT_REPO, "model.safetensors", path.read_bytes())
    model = keras_vit.vit_ti16(pretrained=True, classifier_activation=None)  # logits, as timm
    assert model.name == "vit_ti16.augreg_in21k_ft_in1k" == model.pretrained_tag
    assert model.output_shape == (None, 1000)

    pixels = np.random.default_rng(0).integers(0, 256, size=(1, 224, 224, 3), dtype=np.uint8)
    images = preprocess_input(pixels, model)
    np.testing.assert_allclose(images, pixels / 127.5 - 1.0, atol=1e-6)
    logits = keras.ops.convert_to_numpy(model(images))
    parity(logits, timm_logits(reference, images), TOLERANCE, "timm")

    decoded = decode_predictions(logits, top=3, tag_or_model=model)
    best = int(np.argmax(logits[0]))
    assert decoded[0][0][:2] == (best, keras_vit.data.preprocessing.imagenet1k_labels()[best])
    assert [score for _, _, score in decoded[0]] == sorted((s for _, _, s in decoded[0]), reverse=True)

    # the tag lives in the model's name, which a .keras round trip keeps
    model.save(tmp_path / "m.keras")
    reloaded = keras.saving.load_model(tmp_path / "m.keras")
    assert catalog.model_entry(reloaded).tag == "vit_ti16.augreg_in21k_ft_in1k"
    del model, reloaded
    keras.backend.clear_session()


@pytest.mark.slow
def test_hybrid_pretrained_true_from_cache_matches_timm(hub_cache, parity):
    """The hybrid rows of the catalog load like the plain ones: R+ViT-Ti/16's default tag, at 384 px."""
    entry = catalog.get_entry(catalog.default_tag("vit_r_ti16"))
    torch.manual_seed(0)
    reference = timm.create_model("vit_tiny_r_s16_p8_224", pretrained=False).eval()
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    data = safetensors.torch.save({key: value.contiguous() for key, value in reference.state_dict().items()})
    populate_cache(hub_cache, entry.hub_repo, entry.filename, data)
    model = keras_vit.vit_r_ti16(pretrained=True, image_size=384, classifier_activation=None)
    assert model.pretrained_tag == entry.tag == "vit_r_ti16.augreg_in21k_ft_in1k"
    resized = timm.create_model("vit_tiny_r_s16_p8_224", pretrained=False, img_size=384).eval()
    resized.load_state_dict(checkpoint_filter_fn(reference.state_dict(), resized))
    images = random_images(1, (384, 384))
    logits = keras.ops.convert_to_numpy(model(images))
    parity(logits, timm_logits(resized, images), HYBRID_TOLERANCE, "timm, 384 px")
    del model
    keras.backend.clear_session()


def test_truncated_cached_file_is_removed_not_trusted(hub_cache, timm_tiny):
    data = timm_tiny[1].read_bytes()
    populate_cache(hub_cache, DEFAULT_REPO, "model.safetensors", data[: len(data) // 2])
    with pytest.raises(kp.WeightsIntegrityError, match="deleted from the Hugging Face cache: run again"):
        keras_vit.vit_ti16(pretrained="augreg_in21k_ft_in1k")
    assert cached_files(hub_cache) == []
    # the next (offline) run misses the cache instead of reading the bad file again
    with pytest.raises(kp.WeightsUnavailableError) as caught:
        keras_vit.vit_ti16(pretrained=True)
    assert not isinstance(caught.value, kp.WeightsIntegrityError)


def test_sha256_is_verified_and_a_mismatch_deletes_the_file(hub_cache):
    data = b"not really a checkpoint"
    populate_cache(hub_cache, DEFAULT_REPO, "model.safetensors", data)
    entry = catalog.get_entry("vit_ti16.augreg_in21k_ft_in1k")
    good = dataclasses.replace(entry, sha256=hashlib.sha256(data).hexdigest())
    assert Path(kp.download_checkpoint(good)).read_bytes() == data
    with pytest.raises(kp.WeightsIntegrityError, match="sha256"):
        kp.download_checkpoint(dataclasses.replace(entry, sha256="0" * 64))
    assert cached_files(hub_cache) == []


def test_download_checkpoint_reads_its_argument_as_pretrained_does(hub_cache, tmp_path):
    local = tmp_path / "model.safetensors"
    local.write_bytes(b"weights")
    assert kp.download_checkpoint(str(local)) == str(local)  # a local file is no hub repo id
    with pytest.raises(ValueError, match="neither a local file nor a hub repo id"):
        kp.download_checkpoint("org/name/extra")
    assert cached_files(hub_cache) == []


# ---------------------------------------------------------------- building to fit a checkpoint


def test_local_file_with_new_head_and_resolution(timm_tiny):
    reference, path = timm_tiny
    with pytest.warns(UserWarning, match="head has 1000 classes and the model's 7"):
        model = keras_vit.vit_ti16(pretrained=str(path), num_classes=7, image_size=64)
    assert model.name == "vit_ti16" and model.pretrained_tag is None
    head = model.get_layer("head")
    assert head.kernel.shape == (192, 7) and not np.any(head.kernel.numpy())
    expected = keras_vit.resize_pos_embed(reference.pos_embed.detach().numpy(), (4, 4))
    np.testing.assert_allclose(model.get_layer("pos_embed").embedding.numpy(), expected, atol=1e-6)
    np.testing.assert_array_equal(
        model.get_layer("block_3").fc1.kernel.numpy(), reference.blocks[3].mlp.fc1.weight.detach().numpy().T
    )
    del model
    keras.backend.clear_session()


def test_headless_checkpoint_builds_features_unless_num_classes_given(timm_tiny, tmp_path, parity):
    reference, _ = timm_tiny
    state = {k: v for k, v in reference.state_dict().items() if not k.startswith("head.")}
    path = tmp_path / "headless.safetensors"
    safetensors.torch.save_file(state, str(path))
    features = keras_vit.vit_ti16(pretrained=str(path))
    assert features.output_shape == (None, 192)
    images = random_images(1, seed=1)
    with torch.no_grad():
        tokens = reference.forward_features(torch.from_numpy(images).permute(0, 3, 1, 2))
    pooled = keras.ops.convert_to_numpy(features(images))
    parity(pooled, tokens[:, 0].numpy(), FEATURES_TOLERANCE, "timm features")
    with pytest.raises(ValueError, match="no classification head: pass num_classes"):
        keras_vit.vit_ti16(pretrained=str(path), include_top=True)
    del features
    keras.backend.clear_session()


@pytest.mark.slow
def test_hf_checkpoint_with_pooler_gives_pre_logits_unless_dropped(tmp_path, parity):
    from transformers import ViTConfig as HFConfig
    from transformers import ViTModel

    torch.manual_seed(1)
    config = HFConfig(
        hidden_size=192,
        num_hidden_layers=12,
        num_attention_heads=3,
        intermediate_size=768,
        image_size=224,
        patch_size=16,
        layer_norm_eps=1e-6,
    )
    reference = ViTModel(config, add_pooling_layer=True).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn_like(param))
    reference.save_pretrained(tmp_path / "hf_vit")  # the hub's key layout
    path = tmp_path / "hf_vit" / "model.safetensors"
    images = random_images(1, seed=2)
    with torch.no_grad():
        output = reference(pixel_values=torch.from_numpy(images).permute(0, 3, 1, 2))

    model = keras_vit.vit_ti16(pretrained=str(path))
    assert model.get_layer("pre_logits").units == 192 and model.output_shape == (None, 192)
    pooled = keras.ops.convert_to_numpy(model(images))
    parity(pooled, output.pooler_output.numpy(), TOLERANCE, "transformers pooler")
    with pytest.raises(ValueError, match="a pre-logits layer of width 192, not one of width 64"):
        keras_vit.vit_ti16(pretrained=str(path), representation_size=64)
    del model
    keras.backend.clear_session()

    with pytest.warns(UserWarning, match="pre-logits layer .* is skipped"):
        plain = keras_vit.vit_ti16(pretrained=str(path), representation_size=0)
    assert "pre_logits" not in [layer.name for layer in plain.layers]
    plain_features = keras.ops.convert_to_numpy(plain(images))
    parity(plain_features, output.last_hidden_state[:, 0].numpy(), TOLERANCE, "transformers features")
    del plain
    keras.backend.clear_session()


def test_repo_id_and_load_weights_into_an_existing_model(hub_cache, timm_tiny):
    reference, path = timm_tiny
    populate_cache(hub_cache, "someone/my-vit", "model.safetensors", path.read_bytes())
    model = keras_vit.vit_ti16(image_size=32, num_classes=3)
    with pytest.warns(UserWarning, match="head has 1000 classes and the model's 3"):
        keras_vit.load_weights(model, "someone/my-vit")
    assert not np.any(model.get_layer("head").kernel.numpy())  # 1000-class head skipped
    np.testing.assert_array_equal(
        model.get_layer("class_token").token.numpy(), reference.cls_token.detach().numpy()
    )
    with pytest.raises(ValueError, match=r"vit_s16.*not vit_ti16.*keras_vit\.vit_s16"):
        keras_vit.load_weights(model, "vit_s16.augreg_in21k_ft_in1k")
    shallow = dataclasses.replace(VARIANTS["vit_ti16"], name="tiny2", depth=2)
    small = keras_vit.build_vit(shallow, image_size=32)
    wrong_depth = r"depth 12 vs 2\); it is a vit_ti16 checkpoint: .* keras_vit\.vit_ti16\("
    with pytest.raises(ValueError, match=wrong_depth):
        keras_vit.load_weights(small, str(path))
    del model, small
    keras.backend.clear_session()


# ---------------------------------------------------------------- preprocessing and labels


def test_preprocess_input_refuses_already_scaled_images():
    pixels = np.array([[[[0, 128, 255]]]], dtype=np.uint8)
    np.testing.assert_allclose(preprocess_input(pixels), [[[[-1.0, 128 / 127.5 - 1, 1.0]]]], atol=1e-6)
    np.testing.assert_allclose(
        preprocess_input(pixels.astype("float32"), "vit_b16.augreg_in1k"), preprocess_input(pixels), atol=0
    )
    with pytest.raises(ValueError, match="looks like \\[0, 1\\] scaling"):
        preprocess_input(pixels / 255.0)
    with pytest.raises(ValueError, match="already normalised"):
        preprocess_input(pixels / 127.5 - 1.0)
    with pytest.raises(ValueError, match="\\[0, 255\\]"):
        preprocess_input(pixels.astype("float32") * 2)
    with pytest.raises(ValueError, match="not a full tag"):
        preprocess_input(pixels, "augreg_in1k")


def test_decode_predictions_labels_scores_and_label_sets():
    logits = np.full((2, 1000), -5.0, dtype="float32")
    logits[0, 1], logits[0, 0] = 3.0, 2.0
    logits[1, 999] = 4.0
    decoded = decode_predictions(logits, top=2)
    assert [(i, name) for i, name, _ in decoded[0]] == [(1, "goldfish"), (0, "tench")]
    assert decoded[1][0][:2] == (999, "toilet tissue")
    probabilities = np.exp(logits[0]) / np.exp(logits[0]).sum()
    assert decoded[0][0][2] == pytest.approx(probabilities[1], rel=1e-6)
    # probabilities are kept as they are
    assert decode_predictions(one_hot(1000, 5), top=1) == [[(5, "electric ray", 1.0)]]

    with pytest.warns(UserWarning, match="imagenet21k class names are not shipped"):
        decoded_21k = decode_predictions(one_hot(21843, 42), top=1, tag_or_model="vit_b16.augreg_in21k")
    assert decoded_21k == [[(42, None, 1.0)]]
    with pytest.raises(ValueError, match="10 classes but the checkpoint's label set imagenet1k has 1000"):
        decode_predictions(np.zeros((1, 10)), tag_or_model="vit_b16.augreg_in1k")
    with pytest.raises(ValueError, match="no shipped label set"):
        decode_predictions(np.zeros((1, 10)))
    with pytest.raises(ValueError, match="no classification head"):
        decode_predictions(np.zeros((1, 1000)), tag_or_model="vit_h14.orig_in21k")
