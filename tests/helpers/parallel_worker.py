"""Run by tests/models/test_parallel.py on JAX with 8 (or 4) host CPU devices (`XLA_FLAGS=...device_count=8`).

    python tests/helpers/parallel_worker.py single OUT_DIR
    python tests/helpers/parallel_worker.py errors OUT_DIR
    python tests/helpers/parallel_worker.py process OUT_DIR PROCESS_ID COORDINATOR_ADDRESS

`single`: trains the same tiny ViT from the same weights on the same batches (AdamW, 4 steps) on
one device, data parallel over 8, and model parallel on 4x2 and 2x4 meshes
(`keras_vit.models.parallel.make_distribution`); writes `OUT_DIR/steps.npz` (per run: the loss of every
step and the final weights) and `OUT_DIR/layouts.json` (the config; per model-parallel mesh: its device ids
and, for every model and optimizer variable, its role, path, shape, layout axes and every shard's
device and index).

`errors`: writes `OUT_DIR/errors.json`, the message of each bad input to `make_distribution`.

`process`: one of two processes joined by `keras.distribution.initialize` (4 devices each),
training data parallel over all 8 with each process feeding its half of every global batch;
process 0 writes `OUT_DIR/process.npz` (the losses, the final weights, the device and process counts).
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import numpy as np

os.environ["KERAS_BACKEND"] = "jax"
import keras  # noqa: E402

import keras_vit  # noqa: E402
from keras_vit import ViTConfig  # noqa: E402
from keras_vit.models.parallel import make_distribution  # noqa: E402

# Class token, 4 heads, MLP 64, attention pooling ("map": its own sharded attention and MLP).
CONFIG = ViTConfig("tiny_parallel", 4, 32, 2, 4, 64, image_size=16, pooling="map")
NUM_CLASSES, GLOBAL_BATCH, STEPS = 5, 8, 4


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [
        (
            rng.uniform(-1, 1, (GLOBAL_BATCH, 16, 16, 3)).astype("float32"),
            rng.integers(0, NUM_CLASSES, GLOBAL_BATCH),
        )
        for _ in range(STEPS)
    ]


def initial_weights() -> list[np.ndarray]:
    """Every weight drawn once (a random head too: the zero-initialised one would stop all gradients)."""
    rng = np.random.default_rng(0)
    model = keras_vit.build_vit(CONFIG, num_classes=NUM_CLASSES)
    return [rng.normal(0, 0.2, weight.shape).astype("float32") for weight in model.weights]


def train(distribution, steps, weights, process_slice=slice(None)):
    """The loss of every step and the final weights, the model built and trained under `distribution`."""
    with distribution.scope() if distribution is not None else contextlib.nullcontext():
        model = keras_vit.build_vit(CONFIG, num_classes=NUM_CLASSES)
        model.set_weights(weights)
        model.compile(
            optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        losses = [float(model.train_on_batch(x[process_slice], y[process_slice])) for x, y in steps]
    return model, losses


def describe_layouts(model, distribution) -> dict:
    mesh = distribution.device_mesh
    variables = []
    for role, variable in [
        *(("weight", weight) for weight in model.weights),
        *(("optimizer", variable) for variable in model.optimizer.variables),
    ]:
        layout = distribution.get_variable_layout(variable)
        variables.append(
            {
                "role": role,
                "path": variable.path,
                "shape": list(variable.shape),
                "axes": list(layout.axes),
                "shards": [
                    {
                        "device": shard.device.id,
                        "index": [[s.start, s.stop] for s in _slices(shard.index, variable.shape)],
                    }
                    for shard in variable.value.addressable_shards
                ],
            }
        )
    return {
        "axis_names": list(mesh.axis_names),
        "device_ids": [[int(name.split(":")[-1]) for name in row] for row in mesh.devices],
        "variables": variables,
    }


def _slices(index, shape) -> list[slice]:
    return [
        slice(s.start or 0, size if s.stop is None else s.stop) for s, size in zip(index, shape, strict=True)
    ]


def _fit_uneven_batch() -> None:
    """`fit` of 10 rows in one batch over 8 replicas: refused at that batch."""
    with make_distribution().scope():
        model = keras_vit.build_vit(CONFIG, num_classes=4)
        model.compile("sgd", "sparse_categorical_crossentropy")
        images = np.zeros((10, 16, 16, 3), "float32")
        model.fit(images, np.zeros(10, "int32"), batch_size=10, epochs=1, verbose=0)


def _uneven_last_batch(call: str) -> None:
    """`fit` of 10 rows in batches of 8 over 8 replicas (`predict`: 12 rows): refused before any step,
    where Keras checks the first batch only and JAX met the last one with a sharding error."""
    with make_distribution().scope():
        model = keras_vit.build_vit(CONFIG, num_classes=4)
        model.compile("sgd", "sparse_categorical_crossentropy")
        if call == "fit":
            model.fit(np.zeros((10, 16, 16, 3), "float32"), np.zeros(10, "int32"), batch_size=8, verbose=0)
        else:
            model.predict(np.zeros((12, 16, 16, 3), "float32"), batch_size=8, verbose=0)


def bad_input_messages() -> dict:
    cases = {
        "heads": lambda: make_distribution(2, model="vit_ti16"),  # 3 heads
        "mlp": lambda: make_distribution(4, model=ViTConfig("odd_mlp", 4, 32, 1, 4, 66, image_size=16)),
        "mesh_larger": lambda: make_distribution(16, model="vit_b16"),
        "mesh_uneven": lambda: make_distribution(3, model="vit_b16"),
        "no_model": lambda: make_distribution(2),
        "not_positive": lambda: make_distribution(0),
        "unknown_variant": lambda: make_distribution(2, model="vit_x99"),
        "model_heads": lambda: make_distribution(
            2, model=keras_vit.build_vit(ViTConfig("odd_heads", 4, 48, 1, 3, 64, image_size=16))
        ),
        "not_a_vit": lambda: make_distribution(2, model=keras.Sequential(name="other")),
        "no_devices": lambda: make_distribution(devices=[]),
        "repeated_devices": lambda: make_distribution(devices=keras.distribution.list_devices()[:1] * 2),
        "uneven_batch": _fit_uneven_batch,
        "uneven_last_batch": lambda: _uneven_last_batch("fit"),
        "uneven_last_predict": lambda: _uneven_last_batch("predict"),
    }
    messages = {}
    for case, attempt in cases.items():
        try:
            attempt()
        except ValueError as error:
            messages[case] = str(error)
    return messages


def single(out_dir: Path) -> None:
    steps, weights = batches(), initial_weights()
    runs = {
        "one_device": lambda: None,
        "data_parallel": lambda: make_distribution(),
        "model_parallel_2": lambda: make_distribution(2, model=CONFIG),
        "model_parallel_4": lambda: make_distribution(4, model=CONFIG),
    }
    arrays, layouts = {}, {}
    for name, make in runs.items():
        distribution = make()
        model, losses = train(distribution, steps, weights)
        arrays[f"{name}/losses"] = np.array(losses)
        arrays.update({f"{name}/{v.path}": keras.ops.convert_to_numpy(v.value) for v in model.weights})
        if name.startswith("model_parallel"):
            layouts[name] = describe_layouts(model, distribution)
    np.savez(out_dir / "steps.npz", **arrays)
    (out_dir / "layouts.json").write_text(json.dumps({"config": CONFIG.to_dict(), "meshes": layouts}))


def process(out_dir: Path, process_id: int, coordinator: str) -> None:
    keras.distribution.initialize(job_addresses=coordinator, num_processes=2, process_id=process_id)
    distribution = make_distribution()
    half = GLOBAL_BATCH // 2
    share = slice(process_id * half, (process_id + 1) * half)
    model, losses = train(distribution, batches(), initial_weights(), share)
    if process_id == 0:  # data parallel: every weight is replicated, so all of it is addressable here
        arrays = {f"weights/{v.path}": keras.ops.convert_to_numpy(v.value) for v in model.weights}
        np.savez(
            out_dir / "process.npz",
            losses=np.array(losses),
            devices=np.array(distribution.device_mesh.devices.size),
            processes=np.array(distribution.num_processes),
            **arrays,
        )


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "single":
        single(out)
    elif mode == "errors":
        (out / "errors.json").write_text(json.dumps(bad_input_messages()))
    else:
        process(out, int(sys.argv[3]), sys.argv[4])
