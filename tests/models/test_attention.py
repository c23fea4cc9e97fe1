"""The attention implementations (`MultiHeadSelfAttention(attention_implementation=...)`) agree.

"fused" (the backend's attention op) and "fused_padded" (tokens padded to a multiple of
`ATTENTION_PADDING_MULTIPLE`, masked by sequence lengths, the padding sliced off) must give the
"plain" products' values and gradients within 1e-5 in float32, for ViT token counts (50, 197, 577)
and an odd one. Each backend runs `tests/helpers/attention_worker.py` in a subprocess (JAX at matmul
precision "highest", through `jax.nn.dot_product_attention(implementation="xla")`: on a GPU the
same padding and masks go to cuDNN). The "auto" policy table is checked for every row,
including the GPU rows, as a pure function.
"""

import importlib.util
import json
import math
import subprocess
import sys

import keras
import numpy as np
import pytest
from helpers import HELPERS, random_images, subprocess_env

import keras_vit
from keras_vit import ViTConfig
from keras_vit.models import layers
from keras_vit.models.attention import ATTENTION_PADDING_MULTIPLE, choose_attention, refuse_unsupported_kernel
from keras_vit.models.layers import MultiHeadSelfAttention, TransformerBlock

WORKER = HELPERS / "attention_worker.py"
# Max |fused - plain| allowed (values, gradients), float32 on a CPU: about twice the largest measured.
TOLERANCES = {"tensorflow": (2e-7, 2e-7), "jax": (2e-7, 6e-7), "torch": (3e-7, 9e-7)}
MODEL_TOLERANCE = 2.5e-7  # a whole model's logits on this process's backend (measured: 1.2e-7 at most)
LENGTHS = (50, 197, 577, 23)  # ViT-B/32 and B/16 at 224 px, B/16 at 384 px, and an odd count
BACKENDS = [
    pytest.param(
        name, marks=pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"no {module}")
    )
    for name, module in (("jax", "jax"), ("torch", "torch"), ("tensorflow", "tensorflow"))
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_attention_values_and_gradients_equal_plain(backend, tmp_path, parity):
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, str(WORKER), str(out), *map(str, LENGTHS)],
        env=subprocess_env(KERAS_BACKEND=backend),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["backend"] == backend
    cases = result["results"]
    assert len(cases) == len(LENGTHS) * 2 * 2  # lengths x (fused, fused_padded) x (inference, training)
    for case in cases:
        what = f"{case['implementation']}, {case['length']} tokens, training={case['training']}"
        assert case["output_scale"] > 0.1 and case["gradient_scale"] > 0.1, what  # not vacuous
        # The fused op ran once per call, on the padded tokens where asked.
        padded = math.ceil(case["length"] / ATTENTION_PADDING_MULTIPLE) * ATTENTION_PADDING_MULTIPLE
        tokens = padded if case["implementation"] == "fused_padded" else case["length"]
        kernel = {"jax": "xla", "torch": "sdpa"}.get(backend, "keras")
        assert case["calls"] == [{"kernel": kernel, "tokens": tokens}], what
    # max |fused - plain| over every case (the worker measures them): values, then every gradient
    values, gradients = TOLERANCES[backend]
    parity(max(case["output_diff"] for case in cases), 0.0, values, "values")
    parity(max(max(case["gradient_diffs"]) for case in cases), 0.0, gradients, "gradients")


@pytest.mark.parametrize(
    ("backend", "device", "dtype", "training", "head_dim", "expected"),
    [
        ("tensorflow", "cpu", "float32", True, 64, "plain"),
        ("tensorflow", "gpu", "bfloat16", True, 64, "plain"),
        ("torch", "cpu", "float32", False, 64, "fused"),
        ("torch", "gpu", "bfloat16", True, 64, "fused"),
        ("jax", "cpu", "float32", True, 64, "plain"),
        ("jax", "cpu", "bfloat16", False, 64, "plain"),
        ("jax", "gpu", "bfloat16", False, 64, "fused"),
        ("jax", "gpu", "float16", False, 64, "fused"),
        ("jax", "gpu", "bfloat16", True, 64, "fused_padded"),
        ("jax", "gpu", "bfloat16", True, 80, "fused_padded"),  # ViT-H/14's heads: cuDNN takes 80
        ("jax", "gpu", "bfloat16", True, 12, "fused"),  # not a multiple of 8: no cuDNN, so no padding
        ("jax", "gpu", "float32", True, 64, "fused"),
        ("jax", "gpu", "float32", False, 64, "fused"),
        ("jax", "tpu", "bfloat16", True, 64, "plain"),
    ],
)
def test_auto_follows_the_policy_table(backend, device, dtype, training, head_dim, expected):
    chosen = choose_attention("auto", dtype, training, head_dim, backend=backend, device=device)
    assert chosen == expected


@pytest.mark.parametrize("implementation", ["plain", "fused", "fused_padded"])
def test_an_explicit_implementation_is_kept(implementation):
    assert choose_attention(implementation, "bfloat16", True, backend="jax", device="gpu") == implementation


def test_unknown_implementation_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"Unknown attention_implementation 'flash'.*'fused_padded'"):
        MultiHeadSelfAttention(2, attention_implementation="flash")
    with pytest.raises(ValueError, match=r"Unknown attention_implementation"):
        keras_vit.build_vit(ViTConfig("t", 4, 16, 1, 2, 32, image_size=8), attention_implementation="cudnn")


@pytest.mark.parametrize(
    ("kernel", "tokens", "training"), [("xla", 197, True), ("cudnn", 197, False), ("cudnn", 256, True)]
)
def test_a_kernel_runs_what_it_takes(kernel, tokens, training):
    refuse_unsupported_kernel(kernel, tokens, training)  # no error


def test_forced_fused_training_on_an_odd_token_count_is_refused_naming_what_works(monkeypatch):
    """cuDNN's flash attention does not train on 197 tokens: one clear error before the kernel is
    called (on a GPU it failed deep inside the step's compilation), naming "fused_padded" and "auto".
    The layer hands its mode to the check: a training call reaches it as `training=True`."""
    with pytest.raises(ValueError, match=r'cannot train on 197 tokens.*"fused_padded".*"auto"'):
        refuse_unsupported_kernel("cudnn", 197, training=True)
    seen = []
    fused = layers.fused_attention

    def recording(query, key, value, padded, training=False):
        seen.append((padded, training))
        return fused(query, key, value, padded, training)

    monkeypatch.setattr(layers, "fused_attention", recording)
    layer = MultiHeadSelfAttention(2, attention_implementation="fused")
    tokens = np.zeros((1, 5, 8), "float32")
    layer(tokens, training=True)
    layer(tokens)
    assert seen == [(False, True), (False, False)]


def test_scores_and_attention_dropout_take_the_plain_products(rng):
    """Returning the scores, or attention dropout while training, needs the probabilities."""
    tokens = rng.normal(size=(2, 5, 8)).astype("float32")
    layer = MultiHeadSelfAttention(2, dropout=0.5, attention_implementation="fused_padded")
    output, scores = layer(tokens, return_attention_scores=True)
    assert tuple(scores.shape) == (2, 2, 5, 5)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(scores).sum(-1), 1.0, rtol=1e-6)
    trained = keras.ops.convert_to_numpy(layer(tokens, training=True))
    assert np.abs(trained - keras.ops.convert_to_numpy(output)).max() > 1e-3  # dropout acted


def test_the_choice_round_trips_through_configs_and_keras_files(tmp_path):
    block = TransformerBlock(2, 16, attention_implementation="fused_padded")
    block.build((None, 5, 8))
    assert block.attention.attention_implementation == "fused_padded"
    assert TransformerBlock.from_config(block.get_config()).attention_implementation == "fused_padded"
    config = ViTConfig("tiny", 4, 16, 2, 2, 32, image_size=(12, 8))
    model = keras_vit.build_vit(config, num_classes=3, attention_implementation="fused")
    assert {b.attention.attention_implementation for b in model.blocks} == {"fused"}
    model.save(tmp_path / "model.keras")
    loaded = keras_vit.load_model(tmp_path / "model.keras")
    assert loaded.get_config()["attention_implementation"] == "fused"
    assert {b.attention.attention_implementation for b in loaded.blocks} == {"fused"}


@pytest.mark.parametrize("implementation", ["fused", "fused_padded"])
def test_a_model_gives_the_plain_logits_with_every_implementation(implementation, parity):
    """On this process's backend, a whole model (class token: 7 tokens) with its weights copied."""
    config = ViTConfig("tiny", 4, 32, 2, 4, 64, image_size=(12, 8))
    plain = keras_vit.build_vit(
        config, num_classes=5, classifier_activation=None, attention_implementation="plain"
    )
    rng = np.random.default_rng(1)
    for weight in plain.weights:
        weight.assign(rng.normal(0, 0.2, weight.shape).astype("float32"))
    other = plain.rebuild(attention_implementation=implementation)
    images = random_images(3, config.image_hw)
    expected = keras.ops.convert_to_numpy(plain(images, training=False))
    parity(keras.ops.convert_to_numpy(other(images, training=False)), expected, MODEL_TOLERANCE)
