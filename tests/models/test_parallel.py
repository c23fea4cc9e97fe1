"""keras.distribution on JAX (`keras_vit.models.parallel`): data parallel and Megatron-style model parallel.

The layout map's choice of weights is checked here on any backend (it is plain Python); the
training runs happen on JAX in subprocesses (`tests/helpers/parallel_worker.py`) with 8 host CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`): one device, data parallel over 8, and
model parallel on 4x2 and 2x4 meshes train the same tiny ViT from the same weights on the same
batches, and must agree to 1e-5 in every step's loss and every final weight; every shard must
sit where the layout map says; two processes joined by `keras.distribution.initialize` (JAX's
gloo CPU collectives) must follow the one-device run too.
"""

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from helpers import HELPERS, subprocess_env

import keras_vit
from keras_vit import ViTConfig
from keras_vit.models.parallel import get_layout_map, make_distribution

WORKER = HELPERS / "parallel_worker.py"
TOLERANCE = 1e-5
MODEL_PARALLEL_RUNS = ["model_parallel_2", "model_parallel_4"]  # meshes 4x2 and 2x4
CONFIGS = {
    "token": ViTConfig("tiny_token", 4, 32, 2, 4, 64, image_size=16),
    "map": ViTConfig("tiny_map", 4, 32, 1, 2, 48, image_size=16, pooling="map", class_token=False),
    "hybrid": ViTConfig("tiny_hybrid", 1, 32, 1, 2, 64, resnet_stages=(1,), image_size=32),
}
jax_subprocess = pytest.mark.skipif(
    importlib.util.find_spec("jax") is None or keras.backend.backend() != "tensorflow",
    reason="drives JAX subprocesses from the TensorFlow suite",
)


def megatron_axes(config: ViTConfig, model_axis: str = "model") -> dict[str, tuple]:
    """{path: axes} of every weight Megatron-LM splits, written out: q/k/v by heads, the attention
    output by heads (rows), fc1 by columns with its bias, fc2 by rows; in every block and the MAP head."""
    blocks = [f"block_{index}" for index in range(config.depth)] + (
        ["pool"] if config.pooling == "map" else []
    )
    expected = {}
    for block in blocks:
        attention = "pool" if block == "pool" else f"{block}/attention"
        for projection in ("query", "key", "value"):
            expected[f"{attention}/{projection}/kernel"] = (None, model_axis, None)
            expected[f"{attention}/{projection}/bias"] = (model_axis, None)
        expected[f"{attention}/attention_output/kernel"] = (model_axis, None, None)
        expected[f"{block}/fc1/kernel"] = (None, model_axis)
        expected[f"{block}/fc1/bias"] = (model_axis,)
        expected[f"{block}/fc2/kernel"] = (model_axis, None)
    return expected


def _mesh(axis_names=("batch", "model")) -> keras.distribution.DeviceMesh:
    return keras.distribution.DeviceMesh((2, 2), axis_names, [f"cpu:{index}" for index in range(4)])


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_layout_map_shards_exactly_the_megatron_weights(case):
    config = CONFIGS[case]
    model = keras_vit.build_vit(config, num_classes=5, representation_size=8)
    layout_map = get_layout_map(_mesh(("data", "tensor")), "tensor", "data")
    sharded = {}
    for weight in model.weights:
        layout = layout_map[weight.path]
        if layout is not None:
            sharded[weight.path] = tuple(layout.axes)
            assert len(layout.axes) == len(weight.shape), weight.path
    assert sharded == megatron_axes(config, "tensor")  # stem, norms, embeddings, head: replicated


@pytest.mark.parametrize(
    ("axes", "model_axis", "data_axis", "fragment"),
    [
        (("batch", "model"), "tensor", "batch", "not the model-parallel axis 'tensor'"),
        (("batch", "model"), "model", "data", "not the data-parallel axis 'data'"),
        (("batch", "model"), "model", "model", "must differ"),
    ],
)
def test_layout_map_refuses_axes_the_mesh_lacks(axes, model_axis, data_axis, fragment):
    with pytest.raises(ValueError, match=fragment):
        get_layout_map(_mesh(axes), model_axis, data_axis)


@pytest.mark.skipif(keras.backend.backend() == "jax", reason="the backend check refuses other backends")
def test_make_distribution_refuses_backends_other_than_jax():
    with pytest.raises(ValueError, match="JAX backend only.*KERAS_BACKEND=jax"):
        make_distribution()


def test_get_layout_map_is_public():
    assert keras_vit.get_layout_map is get_layout_map


def _run_worker(mode: str, out: Path, *args: str, device_count: int = 8, wait: bool = True):
    command = [sys.executable, str(WORKER), mode, str(out), *args]
    env = subprocess_env(
        KERAS_BACKEND="jax", XLA_FLAGS=f"--xla_force_host_platform_device_count={device_count}"
    )
    if not wait:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The worker's `single` mode: one device, data parallel, model parallel 4x2 and 2x4."""
    out = _run_worker("single", tmp_path_factory.mktemp("parallel"))
    return np.load(out / "steps.npz"), json.loads((out / "layouts.json").read_text())


def _max_weight_difference(steps, run: str, reference_run: str = "one_device") -> float:
    paths = [key.split("/", 1)[1] for key in steps.files if key.startswith(f"{reference_run}/")]
    return max(
        float(np.abs(steps[f"{run}/{path}"] - steps[f"{reference_run}/{path}"]).max()) for path in paths
    )


@jax_subprocess
@pytest.mark.slow
@pytest.mark.parametrize("run", ["data_parallel", *MODEL_PARALLEL_RUNS])
def test_distributed_training_equals_one_device(runs, run):
    """Every step's loss and the final weights after 4 AdamW steps (at a fixed global batch of 8)."""
    steps, _ = runs
    np.testing.assert_allclose(steps[f"{run}/losses"], steps["one_device/losses"], rtol=0, atol=TOLERANCE)
    assert _max_weight_difference(steps, run) <= TOLERANCE


@jax_subprocess
@pytest.mark.slow
@pytest.mark.parametrize("run", MODEL_PARALLEL_RUNS)
def test_every_shard_sits_where_the_layout_map_says(runs, run):
    _, layouts = runs
    layout = layouts["meshes"][run]
    device_grid = np.array(layout["device_ids"])
    position = {  # device id -> its index along each mesh axis
        int(device): dict(zip(layout["axis_names"], index, strict=True))
        for index, device in np.ndenumerate(device_grid)
    }
    weights = [v for v in layout["variables"] if v["role"] == "weight"]
    sharded = {v["path"]: tuple(v["axes"]) for v in weights if any(v["axes"])}
    assert sharded == megatron_axes(ViTConfig.from_dict(layouts["config"]))
    # AdamW's moments (`<optimizer>/<weight path with _>_momentum|velocity`) are laid out as their weights.
    weight_axes = {v["path"].replace("/", "_"): tuple(v["axes"]) for v in weights}
    moments = [v for v in layout["variables"] if v["path"].endswith(("_momentum", "_velocity"))]
    assert len(moments) == 2 * len(weights)
    for moment in moments:
        assert tuple(moment["axes"]) == weight_axes[moment["path"].split("/", 1)[1].rsplit("_", 1)[0]]
    for variable in layout["variables"]:
        assert sorted(shard["device"] for shard in variable["shards"]) == sorted(position)
        for shard in variable["shards"]:
            for axis, size, (start, stop) in zip(
                variable["axes"], variable["shape"], shard["index"], strict=True
            ):
                parts = 1 if axis is None else device_grid.shape[layout["axis_names"].index(axis)]
                part = 0 if axis is None else position[shard["device"]][axis]
                assert (start, stop) == (part * size // parts, (part + 1) * size // parts), variable["path"]


@jax_subprocess
@pytest.mark.parametrize(
    ("case", "fragments"),
    [
        ("heads", ["model_parallel=2", "vit_ti16's 3 attention heads", "one of [1, 3]"]),
        ("mlp", ["model_parallel=4", "66 MLP width", "one of [1, 2]"]),
        ("mesh_larger", ["needs at least 16 devices", "only 8", "model_parallel <= 8"]),
        ("mesh_uneven", ["does not divide the 8 devices", "one of [1, 2, 4, 8]"]),
        ("no_model", ["pass model="]),
        ("not_positive", ["positive int", "got 0"]),
        ("unknown_variant", ["Unknown ViT variant 'vit_x99'"]),
        ("model_heads", ["odd_heads's 3 attention heads", "one of [1]"]),
        ("not_a_vit", ["not a keras_vit.ViT"]),
        ("no_devices", ["devices is empty"]),
        ("repeated_devices", ["more than once", "give each device once"]),
        ("uneven_batch", ["A batch of 10 rows cannot be split between the distribution's 8 replicas"]),
        ("uneven_last_batch", ["With 10 rows in batches of 8, the last batch of 2 rows cannot be split"]),
        ("uneven_last_predict", ["With 12 rows in batches of 8, the last batch of 4 rows cannot be split"]),
    ],
)
def test_bad_input_gets_one_clear_error(bad_input_messages, case, fragments):
    for fragment in fragments:
        assert fragment in bad_input_messages[case]


@pytest.fixture(scope="module")
def bad_input_messages(tmp_path_factory):
    out = _run_worker("errors", tmp_path_factory.mktemp("parallel_errors"))
    return json.loads((out / "errors.json").read_text())


@jax_subprocess
@pytest.mark.slow
def test_two_processes_follow_the_one_device_run(runs, tmp_path):
    """Two processes of 4 CPU devices each, joined by keras.distribution.initialize (gloo collectives)."""
    steps, _ = runs
    with socket.socket() as probe:  # a free port for the coordinator
        probe.bind(("localhost", 0))
        address = f"localhost:{probe.getsockname()[1]}"
    workers = [
        _run_worker("process", tmp_path, str(index), address, device_count=4, wait=False) for index in (0, 1)
    ]
    try:
        for worker in workers:
            _, stderr = worker.communicate(timeout=900)
            assert worker.returncode == 0, stderr[-4000:]
    finally:
        for worker in workers:
            worker.kill()
    result = np.load(tmp_path / "process.npz")
    assert (int(result["devices"]), int(result["processes"])) == (8, 2)
    np.testing.assert_allclose(result["losses"], steps["one_device/losses"], rtol=0, atol=TOLERANCE)
    for key in result.files:
        if key.startswith("weights/"):
            path = key.split("/", 1)[1]
            np.testing.assert_allclose(result[key], steps[f"one_device/{path}"], rtol=0, atol=TOLERANCE)
