"""Many devices on JAX with `keras.distribution`: data parallelism and Megatron-style model parallelism.

`make_distribution()` replicates the model on every local device and splits each batch between
them (`keras.distribution.DataParallel`); `make_distribution(model_parallel=N, model=...)` lays
the devices out as a `(devices / N, N)` mesh whose `"model"` axis splits every Transformer block's
attention heads and MLP columns between N devices (`keras.distribution.ModelParallel` with
`get_layout_map`), the `"batch"` axis splitting the batch. Build, compile and train the model
inside `distribution.scope()` (or after `keras.distribution.set_distribution(distribution)`).

The attention's communication is more than Megatron's: `MultiHeadSelfAttention` computes query,
key and value with one `(D, 3D)` product of the three kernels side by side, and with the heads
split XLA all-gathers that product's output over the model axis before the attention (correct:
the step equals the one-device step to 1e-5, tested). A ViT of depth 2 on 8 CPU devices, model
axis 2 or 4, compiles to 5 all-reduces and 8 all-gathers forward (8 all-reduces, 10 all-gathers
and 8 or 28 collective-permutes forward and backward); with the attention's per-projection path
or the kernels stacked heads-major, `(D, heads, 3, head_dim)`, only all-reduces (5 forward).

`keras.distribution` is implemented on JAX only (Keras 3.15: the PyTorch backend has no
`distribution_lib`; TensorFlow's is a prototype whose `distribute_value` does nothing), so
`make_distribution` refuses other backends; on TensorFlow, `tf.distribute` is
`keras_vit.training.runs.distribute`'s business.
"""

from __future__ import annotations

import importlib.util
import numbers
from collections.abc import Sequence

import keras

from keras_vit.registry.variants import ViTConfig, config_of, get_config

__all__ = ["check_array_batches", "get_layout_map", "make_distribution"]

# The weights Megatron-LM splits (Shoeybi et al. 2019, §3), by `variable.path` (a full match; any
# prefix, for a ViT nested in another model). Blocks (`block_<i>`) and the attention-pooling head
# (`pool`, models with pooling="map") have the same sublayers. `_MODEL` stands for the model axis.
_ATTENTION = r"(?:.*/)?(?:block_\d+/attention|pool)"
_MLP = r"(?:.*/)?(?:block_\d+|pool)"
_MODEL = "model"
_SHARDED_WEIGHTS = {
    # Column-parallel: each device projects the tokens to its own heads' query, key and value.
    # Kernels (D, heads, head_dim), biases (heads, head_dim): split along the heads.
    rf"{_ATTENTION}/(?:query|key|value)/kernel": (None, _MODEL, None),
    rf"{_ATTENTION}/(?:query|key|value)/bias": (_MODEL, None),
    # Row-parallel: each device maps its heads' context back to D; the partial sums are added
    # across the model axis (one all-reduce per attention). Kernel (heads, head_dim, D).
    rf"{_ATTENTION}/attention_output/kernel": (_MODEL, None, None),
    # MLP: fc1 (D, mlp) column-parallel with its bias, GELU on each device's columns, then fc2
    # (mlp, D) row-parallel (one all-reduce per MLP).
    rf"{_MLP}/fc1/kernel": (None, _MODEL),
    rf"{_MLP}/fc1/bias": (_MODEL,),
    rf"{_MLP}/fc2/kernel": (_MODEL, None),
}
# Everything else stays replicated, each for its reason:
# - attention_output and fc2 biases (D,): added once, after the all-reduce of the row-parallel product;
# - layer norms (D,): their statistics need all of D, and the residual stream they read is replicated;
# - patch projection (P, P, C, D), position embedding (1, tokens, D), class token (1, 1, D) and
#   the MAP probe (1, 1, D): they write the replicated residual stream (0.86% of a ViT-B/16's weights);
# - head and pre-logits (D, classes): class counts (10, 1000, 21843) rarely divide the model axis,
#   and the 1000-class head is 0.89% of a ViT-B/16's weights;
# - the hybrids' ResNet stem: convolutions, outside the Transformer blocks that Megatron's scheme
#   splits; their activations are split along the batch axis like every other layer's.


def get_layout_map(
    device_mesh: keras.distribution.DeviceMesh,
    model_parallel_dim_name: str = "model",
    data_parallel_dim_name: str = "batch",
) -> keras.distribution.LayoutMap:
    """A `keras.distribution.LayoutMap` that shards a keras_vit model Megatron-style along the model axis.

    The query, key and value kernels `(D, heads, head_dim)` and biases are split along the heads,
    the attention output kernel `(heads, head_dim, D)` along the heads, the MLP's `fc1` `(D, mlp)`
    along its columns (with its bias) and `fc2` `(mlp, D)` along its rows, in every block and in
    the attention-pooling head; everything else is replicated (layer norms, embeddings, head,
    hybrid stem: see the module's comments for why). Weights are replicated along
    `data_parallel_dim_name`, the mesh axis that splits the batch.

    The model axis's size must divide the number of heads and the MLP width (`make_distribution`
    checks it against the model). Example for 8 devices, 2-way model parallel:

        mesh = keras.distribution.DeviceMesh((4, 2), ("batch", "model"), keras.distribution.list_devices())
        distribution = keras.distribution.ModelParallel(
            layout_map=keras_vit.get_layout_map(mesh), batch_dim_name="batch"
        )
        with distribution.scope():
            model = keras_vit.vit_b16()
    """
    for role, name in (("model", model_parallel_dim_name), ("data", data_parallel_dim_name)):
        if name not in device_mesh.axis_names:
            raise ValueError(
                f"The device mesh has axes {list(device_mesh.axis_names)}, not the {role}-parallel "
                f"axis {name!r}: pass {role}_parallel_dim_name= one of its axes."
            )
    if model_parallel_dim_name == data_parallel_dim_name:
        raise ValueError(f"The model and data axes must differ, both are {model_parallel_dim_name!r}.")
    layout_map = keras.distribution.LayoutMap(device_mesh)
    for pattern, axes in _SHARDED_WEIGHTS.items():
        layout_map[pattern] = tuple(model_parallel_dim_name if axis == _MODEL else axis for axis in axes)
    return layout_map


def make_distribution(
    model_parallel: int = 1,
    *,
    model: keras.Model | ViTConfig | str | None = None,
    devices: Sequence[str] | None = None,
) -> keras.distribution.Distribution:
    """Data parallelism over `devices` (all of them by default), or with `model_parallel=N` model parallelism.

    `model_parallel=1`: `keras.distribution.DataParallel`, the model replicated on every device,
    each batch split between them (what `tf.distribute.MirroredStrategy` is on TensorFlow).
    `model_parallel=N`: `keras.distribution.ModelParallel` on a `(devices / N, N)` mesh with axes
    `("batch", "model")` and `get_layout_map`'s sharding; `model` (a keras_vit model, its
    `ViTConfig` or a variant name such as `"vit_b16"`) is then required, to check that N divides
    its heads and MLP width. N consecutive devices of `devices` (JAX lists them process by
    process) hold one replica, so the model axis stays within a host when N divides its device
    count. The global batch must be divisible by the number of replicas (`devices / N`).

    Use it before building the model: `with make_distribution(...).scope(): model = ...; model.fit(...)`.

    Several processes (hosts, or one process per GPU): first call, in every process,
    `keras.distribution.initialize(job_addresses="10.0.0.1:1234", num_processes=2, process_id=i)`
    (or set `KERAS_DISTRIBUTION_JOB_ADDRESSES`, `KERAS_DISTRIBUTION_NUM_PROCESSES`,
    `KERAS_DISTRIBUTION_PROCESS_ID` and call it without arguments; the address is process 0's,
    the coordinator), before anything else touches JAX; `devices=None` then spans every process's
    devices, and each process feeds its own share of the global batch (`fit` assembles the
    global batch; a `tf.data` dataset is sharded between processes automatically).

    Raises ValueError (before anything is built) when the backend is not JAX, `model_parallel`
    is not a positive int, exceeds or does not divide the number of devices, or does not divide
    the model's heads or MLP width, and when `devices` is empty or names a device twice. The
    distribution refuses a batch its replicas cannot split (`ValueError` from `fit`, `predict`, ...,
    at that batch) instead of compiling a slow uneven step; a keras_vit model given in-memory arrays
    refuses an uneven last batch before the first step (`check_array_batches`).
    """
    _check_backend()
    if (
        isinstance(model_parallel, bool)
        or not isinstance(model_parallel, numbers.Integral)
        or model_parallel < 1
    ):
        raise ValueError(
            f"model_parallel must be a positive int (1: data parallel only), got {model_parallel!r}."
        )
    devices = list(keras.distribution.list_devices() if devices is None else devices)
    if not devices:
        raise ValueError(
            "devices is empty: give at least one (keras.distribution.list_devices() lists them)."
        )
    repeated = sorted({str(device) for device in devices if devices.count(device) > 1})
    if repeated:
        raise ValueError(
            f"devices lists {', '.join(repeated)} more than once: give each device once "
            "(keras.distribution.list_devices() lists them)."
        )
    if model_parallel > len(devices):
        raise ValueError(
            f"model_parallel={model_parallel} needs at least {model_parallel} devices, but only "
            f"{len(devices)} are available ({', '.join(map(str, devices))}): "
            f"use model_parallel <= {len(devices)}."
        )
    if len(devices) % model_parallel:
        divisors = [size for size in range(1, len(devices) + 1) if len(devices) % size == 0]
        raise ValueError(
            f"model_parallel={model_parallel} does not divide the {len(devices)} devices into a "
            f"(replicas, {model_parallel}) mesh: use one of {divisors}, or pass devices= a multiple of it."
        )
    if model_parallel == 1:
        return DataParallel(devices=devices)
    _check_model_splits(model, model_parallel)
    mesh = keras.distribution.DeviceMesh(
        (len(devices) // model_parallel, model_parallel), ("batch", "model"), devices
    )
    return ModelParallel(layout_map=get_layout_map(mesh), batch_dim_name="batch")


class _EvenBatches:
    """A distribution that refuses, at once, a batch its replicas cannot split (Keras would compile a
    slow uneven step, and a multi-process run would hang on it)."""

    def check_rows(self, rows: int, what: str = "A batch") -> None:
        """`ValueError` unless a batch of `rows` rows (this process's) splits between the replicas."""
        mesh = self.device_mesh
        replicas = int(mesh.shape[mesh.axis_names.index(self.batch_dim_name)])
        import jax

        rows = int(rows) * jax.process_count()  # each process gives its own rows
        if rows % replicas:
            raise ValueError(
                f"{what} of {rows} rows cannot be split between the distribution's {replicas} replicas: "
                f"use a batch size divisible by {replicas}, and a dataset whose last batch is full too "
                "(drop or pad the remainder, e.g. tf.data's batch(..., drop_remainder=True))."
            )

    def get_data_layout(self, data_shape):
        if len(data_shape):
            self.check_rows(data_shape[0])
        return super().get_data_layout(data_shape)


def check_array_batches(x, batch_size: int | None, validation_split: float = 0.0) -> None:
    """`ValueError` before anything runs when in-memory arrays `x` (an array, or a list or dict of them)
    end in a batch the active `make_distribution` distribution cannot split.

    Keras checks the layout of the first batch only (`get_data_layout`, which refuses an uneven first
    batch): a shorter last batch would reach JAX as an opaque sharding error after the full ones, or
    hang a multi-process run. Datasets and generators are left to `get_data_layout`.
    """
    distribution = keras.distribution.distribution() if keras.backend.backend() == "jax" else None
    if not isinstance(distribution, _EvenBatches):
        return
    first = keras.tree.flatten(x)[0] if isinstance(x, (list, tuple, dict)) and x else x
    shape = getattr(first, "shape", None)
    if shape is None or not len(shape) or not isinstance(shape[0], numbers.Integral):
        return
    rows = int(shape[0])
    if validation_split:
        rows = int(rows * (1.0 - validation_split))  # what Keras keeps for training
    batch = 32 if batch_size is None else int(batch_size)
    if rows and rows % batch:
        distribution.check_rows(rows % batch, f"With {rows} rows in batches of {batch}, the last batch")


class DataParallel(_EvenBatches, keras.distribution.DataParallel):
    """`keras.distribution.DataParallel` that refuses a batch its replicas cannot split."""


class ModelParallel(_EvenBatches, keras.distribution.ModelParallel):
    """`keras.distribution.ModelParallel` that refuses a batch its replicas cannot split."""


def _check_backend() -> None:
    """A clear error unless Keras runs on JAX, the one backend `keras.distribution` is implemented on."""
    backend = keras.backend.backend()
    if backend == "jax":
        return
    install = " (pip install jax)" if importlib.util.find_spec("jax") is None else ""
    raise ValueError(
        f"keras.distribution data and model parallelism runs on the JAX backend only, and Keras is "
        f"running on {backend!r}: install JAX{install} and set KERAS_BACKEND=jax before Python "
        "starts. On TensorFlow, use tf.distribute (keras_vit.training.runs.distribute)."
    )


def _check_model_splits(model, model_parallel: int) -> None:
    """A clear error unless `model_parallel` divides the model's heads and MLP width."""
    if model is None:
        raise ValueError(
            f"model_parallel={model_parallel} splits the attention heads and MLP columns: pass "
            "model= the keras_vit model, its ViTConfig or its variant name (e.g. 'vit_b16') to check "
            "that they divide."
        )
    if isinstance(model, ViTConfig):
        config = model
    else:
        config = get_config(model) if isinstance(model, str) else config_of(model)
    for what, size in (("attention heads", config.num_heads), ("MLP width", config.mlp_dim)):
        if size % model_parallel:
            divisors = [
                n for n in range(1, size + 1) if config.num_heads % n == 0 and config.mlp_dim % n == 0
            ]
            raise ValueError(
                f"model_parallel={model_parallel} does not divide {config.name}'s {size} {what}: "
                f"use a model-parallel size that divides both its {config.num_heads} heads and its "
                f"{config.mlp_dim} MLP width: one of {divisors}."
            )
