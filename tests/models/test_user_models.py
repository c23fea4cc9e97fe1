"""keras_vit inside a user's own Keras code, each in a fresh process: its public layers in a user's
functional model round-trip through `.keras`; Keras's own `model.export(format="onnx" / "litert")`
of a keras_vit model gives a graph that runs, with Keras's logits, whether or not
`keras_vit.export_onnx` ran first."""

import json
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from helpers import subprocess_env

import keras_vit

TIMEOUT = 600
# Every public layer, as `keras_vit` exports it, and a user model that uses it on its own:
# (input shape without the batch axis, constructor arguments).
PUBLIC_LAYERS = {
    "PatchEncoder": ((8, 8, 3), dict(patch_size=4, hidden_size=8)),
    "ClassToken": ((4, 8), {}),
    "PositionEmbedding": ((5, 8), dict(grid_size=(2, 2), num_prefix_tokens=1)),
    "DropPath": ((4, 8), dict(rate=0.1)),
    "MultiHeadSelfAttention": ((4, 8), dict(num_heads=2)),
    "TransformerBlock": ((4, 8), dict(num_heads=2, mlp_dim=16)),
    "TokenPooling": ((5, 8), dict(mode="token", num_prefix_tokens=1)),
    "MultiheadAttentionPooling": ((4, 8), dict(num_heads=2, mlp_dim=16)),
    "StdConv2D": ((8, 8, 3), dict(filters=4, kernel_size=3)),
    "BottleneckUnit": ((8, 8, 4), dict(filters=4, strides=1, groups=2)),
}
EXPORTED_LAYERS = sorted(
    name
    for name in keras_vit.__all__
    if isinstance(getattr(keras_vit, name), type)
    and issubclass(getattr(keras_vit, name), keras.layers.Layer)
    and not issubclass(getattr(keras_vit, name), keras.Model)
)


def run_fresh(code: str) -> str:
    """Run `code` in a new Python process (keras_vit and Keras not yet imported); its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_cases_cover_every_public_layer():
    assert sorted(PUBLIC_LAYERS) == EXPORTED_LAYERS


@pytest.mark.parametrize("name", sorted(PUBLIC_LAYERS))
def test_public_layer_round_trips_in_a_user_model(name, tmp_path):
    shape, arguments = PUBLIC_LAYERS[name]
    inputs = keras.Input(shape)
    outputs = getattr(keras_vit, name)(**arguments, name="mine")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, name="user_head")(keras.layers.Flatten()(outputs)))
    rng = np.random.default_rng(0)
    for variable in model.weights:
        variable.assign(rng.normal(0, 0.5, variable.shape).astype("float32"))
    images = rng.normal(0, 1, (2, *shape)).astype("float32")
    path = tmp_path / "user.keras"
    model.save(path)
    np.save(tmp_path / "images.npy", images)
    np.save(tmp_path / "expected.npy", keras.ops.convert_to_numpy(model(images)))
    output = run_fresh(
        f"""
        import json
        import keras
        import numpy as np
        import keras_vit

        model = keras.saving.load_model({str(path)!r})
        layer = model.get_layer("mine")
        folder = {str(tmp_path)!r}
        images, expected = np.load(folder + "/images.npy"), np.load(folder + "/expected.npy")
        difference = np.abs(keras.ops.convert_to_numpy(model(images)) - expected)
        print(json.dumps([type(layer).__module__, type(layer).__name__, float(difference.max())]))
        """
    )
    module, cls, difference = json.loads(output.strip().splitlines()[-1])
    assert (module, cls) == (getattr(keras_vit, name).__module__, name)  # the class itself, not a stand-in
    assert difference == 0.0


EXPORT_SCRIPT = """
import json
import os

import numpy as np
import keras
import keras_vit

model = keras_vit.build_vit(
    keras_vit.ViTConfig("user_vit", 4, 32, 2, 2, 64, image_size=16, numerics={numerics!r}),
    num_classes=5,
    classifier_activation=None,
)
rng = np.random.default_rng(0)
for variable in model.weights:
    noise = rng.normal(0, 0.3, variable.shape) + (1.0 if variable.path.endswith("gamma") else 0.0)
    variable.assign(noise.astype("float32"))
images = rng.uniform(-1, 1, (3, 16, 16, 3)).astype("float32")
expected = keras.ops.convert_to_numpy(model(images))
folder = {folder!r}
if {after_export_onnx!r}:
    keras_vit.export_onnx(model, os.path.join(folder, "first.onnx"))
differences = {{}}
if "onnx" in {formats!r}:
    import onnxruntime

    model.export(os.path.join(folder, "keras.onnx"), format="onnx", verbose=False)
    session = onnxruntime.InferenceSession(os.path.join(folder, "keras.onnx"))
    logits = session.run(None, {{session.get_inputs()[0].name: images}})[0]
    differences["onnx"] = float(np.abs(logits - expected).max())
if "litert" in {formats!r}:
    from ai_edge_litert.interpreter import Interpreter

    model.export(os.path.join(folder, "keras.tflite"), format="litert", verbose=False)
    interpreter = Interpreter(model_path=os.path.join(folder, "keras.tflite"))
    feed = interpreter.get_input_details()[0]
    interpreter.resize_tensor_input(feed["index"], images.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(feed["index"], images)
    interpreter.invoke()
    logits = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
    differences["litert"] = float(np.abs(logits - expected).max())
print(json.dumps(differences))
"""


@pytest.mark.parametrize(
    "numerics, after_export_onnx, formats",
    [
        ("timm", False, ("onnx", "litert")),  # exact GELU: TensorFlow's Erfc, which tf2onnx lacks
        ("timm", True, ("onnx",)),
        ("jax", False, ("onnx",)),  # tanh GELU
    ],
)
def test_keras_export_runs_with_keras_logits(numerics, after_export_onnx, formats, tmp_path):
    script = EXPORT_SCRIPT.format(
        numerics=numerics, folder=str(tmp_path), after_export_onnx=after_export_onnx, formats=formats
    )
    differences = json.loads(run_fresh(script).strip().splitlines()[-1])
    assert sorted(differences) == sorted(formats)
    for format, difference in differences.items():
        assert difference <= 1e-5, (format, difference)
