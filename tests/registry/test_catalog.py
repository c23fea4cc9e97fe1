"""The catalog below everything (`keras_vit.registry.catalog`: rows, preprocessing, labels) and the one
build-with-checkpoint step (`Checkpoint.model_kwargs`, `build_with_checkpoint`)."""

import subprocess
import sys

import keras
import numpy as np
import pytest
from helpers import REPO, random_images, subprocess_env

import keras_vit
from keras_vit.checkpoints.pretrained import resolve_pretrained
from keras_vit.registry import catalog
from keras_vit.registry.catalog import Preprocessing, class_names, preprocessing_for
from keras_vit.registry.variants import ViTConfig

TINY = ViTConfig("tiny_catalog", 4, 32, 2, 2, 64, image_size=32)
TAG = "vit_ti16.augreg_in21k_ft_in1k"
HF_TAG = "vit_b16.hf_orig_in21k_ft_in1k"


def random_model(config: ViTConfig = TINY, **kwargs) -> keras.Model:
    """A logits model with every weight random (LayerNorm scales around 1)."""
    model = keras_vit.build_vit(config, classifier_activation=None, **kwargs)
    rng = np.random.default_rng(0)
    for variable in model.weights:
        noise = rng.normal(0, 0.1, variable.shape) + (1.0 if variable.path.endswith("gamma") else 0.0)
        variable.assign(noise.astype("float32"))
    return model


def logits(model: keras.Model, images: np.ndarray) -> np.ndarray:
    return keras.ops.convert_to_numpy(model(images))


def test_catalog_answers_without_tensorflow_keras_or_the_hub():
    code = (
        "import sys\n"
        "from keras_vit.registry import catalog\n"
        "from keras_vit.data import preprocessing\n"
        f"assert catalog.list_pretrained('vit_ti16') and catalog.get_entry({TAG!r}).variant == 'vit_ti16'\n"
        f"assert catalog.preprocessing_for({TAG!r}).image_size == (224, 224)\n"
        f"assert len(catalog.class_names({TAG!r}, 1000)) == 1000\n"
        "assert preprocessing.preprocess_input(preprocessing.np.zeros((1, 4, 4, 3))).min() == -1.0\n"
        "print(sorted(m for m in ('tensorflow', 'keras', 'huggingface_hub', 'torch') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=subprocess_env()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_catalog_reads_the_checkout_when_not_installed():
    """A source checkout on PYTHONPATH without `pip install` (a GPU machine) has no
    `keras_vit.weights` package: the catalog and labels come from the checkout's `weights/`."""
    root = str(REPO)
    code = (
        "import sys\n"
        "sys.meta_path = [finder for finder in sys.meta_path if 'editable' not in repr(finder).lower()]\n"
        f"sys.path.insert(0, {root!r})\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('keras_vit.weights') is None\n"
        "from keras_vit.registry import catalog\n"
        f"print(len(catalog.imagenet1k_labels()), catalog.get_entry({TAG!r}).variant)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=subprocess_env()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1000", "vit_ti16"]


def test_preprocessing_for_is_the_one_answer():
    tagged = keras_vit.build_vit(TINY, name=HF_TAG)
    spec = preprocessing_for(tagged)
    entry = catalog.get_entry(HF_TAG)
    assert spec == Preprocessing.from_entry(entry, image_size=32)
    assert (spec.crop_pct, spec.interpolation) == (None, "bilinear")  # ViTImageProcessor
    assert preprocessing_for(HF_TAG) == Preprocessing.from_entry(entry)
    plain = keras_vit.build_vit(TINY)
    assert preprocessing_for(plain) == Preprocessing((32, 32)) == Preprocessing.for_model(plain)
    with pytest.raises(ValueError, match="needs an image_size"):
        preprocessing_for(None)
    # Every place that normalises reads that answer.
    for model in (tagged, keras_vit.build_vit(TINY, name=TAG), plain):
        spec = preprocessing_for(model)
        pixels = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3)).astype("uint8")
        np.testing.assert_array_equal(
            keras_vit.preprocess_input(pixels, model), catalog.normalize(pixels, spec.mean, spec.std)
        )
        from keras_vit.deploy.export import ImagePreprocessing, image_preprocessing

        assert image_preprocessing(model) == ImagePreprocessing.from_spec(spec)


def test_class_names_are_looked_up_once():
    model = keras_vit.build_vit(TINY, name=TAG)
    assert class_names(model, 1000) == list(catalog.imagenet1k_labels())
    assert class_names(model, 10) is None  # a new head: the ImageNet names do not apply
    assert class_names(keras_vit.build_vit(TINY), 1000) is None
    assert class_names(model, 2, labels=("cat", 7)) == ["cat", "7"]
    with pytest.raises(ValueError, match="labels has 2 names but the model's head has 3 classes"):
        class_names(model, 3, labels=("cat", "dog"))
    with pytest.raises(ValueError, match="head has no classes"):
        class_names(model, None, labels=("cat",))


def test_names_retired_in_0_2_are_gone():
    """0.2.0 removed the 0.1 deprecation shims (CHANGELOG.md): each old name is an AttributeError now."""
    from keras_vit.training import recipes
    from keras_vit.utils import defaults

    for owner, name in [
        (keras_vit, "inspect"),
        (keras_vit.checkpoints.pretrained, "get_entry"),
        (defaults, "BATCH_SIZE"),
        (recipes, "WarmupDecay"),
    ]:
        with pytest.raises(AttributeError, match=name):
            getattr(owner, name)


def test_a_checkpoint_answers_the_model_arguments_once(tmp_path):
    """A saved model's layout, numerics, size and head come back from its folder, asked once."""
    config = TINY.replace(class_token=False, pooling="gap", fc_norm=True, numerics="jax")
    model = random_model(config, num_classes=5)
    folder = keras_vit.save_pretrained(model, tmp_path / "timm")
    checkpoint = resolve_pretrained(folder)
    assert checkpoint.metadata is not None and checkpoint.info.numerics == "jax"
    answer = checkpoint.model_kwargs(TINY)
    expected = dict(class_token=False, pooling="gap", fc_norm=True, numerics="jax", image_size=(32, 32))
    assert answer == {**expected, "include_top": True, "num_classes": 5, "representation_size": None}
    # What the caller gives stays; `None` is unset; `representation_size=0` drops pre-logits.
    given = checkpoint.model_kwargs(
        TINY, dict(image_size=48, num_classes=3, include_top=None, representation_size=0)
    )
    assert (given["image_size"], given["num_classes"], given["include_top"]) == (48, 3, True)
    with pytest.raises(ValueError, match="has no pre-logits layer, not one of width 8"):
        checkpoint.model_kwargs(TINY, dict(representation_size=8))
    with pytest.warns(DeprecationWarning, match="model_kwargs"):
        assert checkpoint.model_arguments(TINY, None, None, None, None) == ((32, 32), 5, True, None)

    # create_model and load_pretrained build through that answer: the same model, exactly.
    images = random_images(2, (32, 32))
    rebuilt = keras_vit.create_model(TINY, pretrained=folder, classifier_activation=None)
    assert rebuilt.config == config.replace(name=TINY.name)
    np.testing.assert_array_equal(logits(rebuilt, images), logits(model, images))
    loaded = keras_vit.load_pretrained(folder)
    assert loaded.get_config() == model.get_config()
    np.testing.assert_array_equal(logits(loaded, images), logits(model, images))


def test_a_headless_checkpoint_builds_features_unless_given_classes(tmp_path):
    model = random_model(TINY, include_top=False)
    folder = keras_vit.save_pretrained(model, tmp_path / "timm")
    checkpoint = resolve_pretrained(folder)
    assert checkpoint.model_kwargs(TINY)["include_top"] is False
    with_head = checkpoint.model_kwargs(TINY, dict(num_classes=4))
    assert (with_head["include_top"], with_head["num_classes"]) == (True, 4)
    with pytest.raises(ValueError, match="has no classification head: pass num_classes"):
        keras_vit.create_model(TINY, pretrained=folder, include_top=True)
