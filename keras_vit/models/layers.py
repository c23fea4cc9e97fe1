"""The Vision Transformer's building blocks as serialisable Keras 3 layers.

Every layer computes with `keras.ops`, creates its sublayers with its own dtype policy (so
`mixed_float16` / `mixed_bfloat16` work) and lists every constructor argument in `get_config`.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
from keras import ops

from keras_vit.checkpoints.pos_embed import resize_pos_embed
from keras_vit.models import eager_torch
from keras_vit.models.attention import checked_implementation, choose_attention, fused_attention
from keras_vit.models.torch_step import host_seed_generator, keras_constant, uniform
from keras_vit.registry.catalog import normalize

__all__ = [
    "PixelNormalization",
    "normalize_pixels",
    "PatchEncoder",
    "ClassToken",
    "PositionEmbedding",
    "DropPath",
    "MultiHeadSelfAttention",
    "TransformerBlock",
    "TokenPooling",
    "MultiheadAttentionPooling",
]

_PACKAGE = "keras_vit"
LAYER_NORM_EPSILON = 1e-6


def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


def normalize_pixels(images, mean, std):
    """uint8 pixels `(..., C)` -> float32 `(x / 255 - mean) / std` with `keras.ops`: a lookup in a
    `(256, C)` table computed by `keras_vit.registry.catalog.normalize`, so equal to the host's
    normalisation bit for bit (`PixelNormalization`'s computation, for models that normalise in a step)."""
    channels = images.shape[-1]
    mean, std = tuple(float(value) for value in mean), tuple(float(value) for value in std)
    # Made once per statistics (on PyTorch: once on the device, no host-to-device copy per call).
    table = keras_constant(_pixel_table(mean, std, channels))
    return ops.take(table, ops.cast(images, "int32") * channels + ops.arange(channels, dtype="int32"))


@functools.cache
def _pixel_table(mean: tuple[float, ...], std: tuple[float, ...], channels: int) -> np.ndarray:
    """`normalize` of every uint8 level in each channel, flattened: entry `level * channels + channel`."""
    levels = np.repeat(np.arange(256, dtype="uint8")[:, None], channels, axis=1)
    return normalize(levels, mean, std).reshape(-1)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PixelNormalization(keras.layers.Layer):
    """Maps uint8 pixels `(batch, H, W, C)` to float32 `(x / 255 - mean) / std` inside the model.

    The first layer of a model built with `image_dtype="uint8"`: a batch then travels to the
    device as uint8, 4x fewer bytes than float32. A lookup in a `(256, C)` table computed by
    `keras_vit.registry.catalog.normalize`, the host path's own function, so the result equals
    normalising on the host bit for bit, on every backend and device. Float32 output under any
    dtype policy, as a float32 batch fed to the model would be.
    """

    def __init__(self, mean, std, **kwargs):
        kwargs["dtype"] = "float32"
        super().__init__(**kwargs)
        self.mean = tuple(float(value) for value in mean)
        self.std = tuple(float(value) for value in std)

    def call(self, images):
        return normalize_pixels(images, self.mean, self.std)

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(self, images):
        return keras.KerasTensor(images.shape, dtype="float32")

    def get_config(self):
        config = super().get_config()
        config.update(mean=self.mean, std=self.std)
        return config


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PatchEncoder(keras.layers.Layer):
    """Cuts an image into `patch_size` x `patch_size` patches and projects each to `hidden_size`.

    The weights are those of the equivalent stride-`patch_size` convolution (sublayer
    `projection`, kernel HWIO, as in the original checkpoints); the call cuts the patches with
    a reshape and a transpose and projects them with one matrix product, whose gradient stays
    fast in bfloat16 (TensorFlow's convolution filter gradient does not). Input
    `(batch, H, W, C)` with H and W divisible by `patch_size`; output
    `(batch, (H/P)*(W/P), hidden_size)` in row-major patch order.
    """

    def __init__(
        self,
        patch_size: int,
        hidden_size: int,
        kernel_initializer="lecun_normal",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.patch_size = int(patch_size)
        self.hidden_size = int(hidden_size)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.projection = keras.layers.Conv2D(
            self.hidden_size,
            kernel_size=self.patch_size,
            strides=self.patch_size,
            padding="valid",
            kernel_initializer=self.kernel_initializer,
            bias_initializer=self.bias_initializer,
            dtype=self.dtype_policy,
            name="projection",
        )

    def _check_image_shape(self, input_shape, channels: int | None = None) -> None:
        if len(input_shape) != 4:
            raise ValueError(
                f"{self.name} expects images of shape (batch, height, width, channels), "
                f"got shape {tuple(input_shape)}."
            )
        for axis, size in zip(("height", "width"), input_shape[1:3], strict=True):
            if size is not None and size % self.patch_size:
                fit = max(self.patch_size, size // self.patch_size * self.patch_size)
                raise ValueError(
                    f"Image {axis} {size} is not divisible by the patch size {self.patch_size}: "
                    f"resize or crop the images to a multiple of {self.patch_size} "
                    f"(e.g. {fit} or {fit + self.patch_size})."
                )
        if channels is not None and input_shape[-1] is not None and input_shape[-1] != channels:
            raise ValueError(
                f"{self.name} was built for images with {channels} channels but received "
                f"{input_shape[-1]}: convert the images (e.g. grayscale to RGB with "
                f"`np.repeat(images, 3, axis=-1)`) or build the model with channels={input_shape[-1]} "
                "(pretrained patch kernels are adapted to it)."
            )

    def build(self, input_shape):
        self._check_image_shape(input_shape)
        self.projection.build(input_shape)

    def call(self, images):
        kernel = self.projection.kernel  # (P, P, C, D)
        self._check_image_shape(images.shape, channels=kernel.shape[2])
        size, channels = self.patch_size, kernel.shape[2]
        height, width = images.shape[1], images.shape[2]
        if height is None or width is None:
            shape = ops.shape(images)
            height, width = shape[1], shape[2]
        rows, columns = height // size, width // size
        patches = ops.reshape(images, (-1, rows, size, columns, size, channels))
        patches = ops.reshape(ops.transpose(patches, (0, 1, 3, 2, 4, 5)), (-1, size * size * channels))
        tokens = ops.matmul(patches, ops.reshape(kernel, (-1, self.hidden_size))) + self.projection.bias
        return ops.reshape(tokens, (-1, rows * columns, self.hidden_size))

    def compute_output_shape(self, input_shape):
        height, width = input_shape[1], input_shape[2]
        tokens = (
            None
            if height is None or width is None
            else (height // self.patch_size) * (width // self.patch_size)
        )
        return (input_shape[0], tokens, self.hidden_size)

    def get_config(self):
        config = super().get_config()
        config.update(
            patch_size=self.patch_size,
            hidden_size=self.hidden_size,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=keras.initializers.serialize(self.bias_initializer),
        )
        return config


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ClassToken(keras.layers.Layer):
    """Prepends the learnable [class] token to a token sequence `(batch, N, D)` -> `(batch, N+1, D)`."""

    def __init__(self, initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        self.initializer = keras.initializers.get(initializer)

    def build(self, input_shape):
        self.token = self.add_weight(
            name="token", shape=(1, 1, input_shape[-1]), initializer=self.initializer
        )

    def call(self, tokens):
        batch = ops.shape(tokens)[0]
        cls = ops.broadcast_to(ops.cast(self.token, tokens.dtype), (batch, 1, tokens.shape[-1]))
        return ops.concatenate([cls, tokens], axis=1)

    def compute_output_shape(self, input_shape):
        length = None if input_shape[1] is None else input_shape[1] + 1
        return (input_shape[0], length, input_shape[2])

    def get_config(self):
        config = super().get_config()
        config.update(initializer=keras.initializers.serialize(self.initializer))
        return config


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned 1-D position embedding for `num_prefix_tokens` + `grid_size` tokens.

    `grid_size` is the patch grid `(height, width)`; the embedding has shape
    `(1, num_prefix_tokens + height*width, D)`. `assign_resized` loads an embedding trained
    on another grid, interpolated in 2-D with `resize_pos_embed`.
    """

    def __init__(
        self,
        grid_size: int | tuple[int, int],
        num_prefix_tokens: int = 1,
        initializer=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.grid_size = _pair(grid_size)
        self.num_prefix_tokens = int(num_prefix_tokens)
        self.initializer = keras.initializers.get(initializer or keras.initializers.RandomNormal(stddev=0.02))

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]

    def build(self, input_shape):
        if input_shape[1] is not None and input_shape[1] != self.num_tokens:
            raise ValueError(
                f"{self.name} was made for {self.num_tokens} tokens (grid {self.grid_size}, "
                f"{self.num_prefix_tokens} prefix) but received {input_shape[1]}: build the model "
                "for the image size you feed it."
            )
        self.embedding = self.add_weight(
            name="embedding",
            shape=(1, self.num_tokens, input_shape[-1]),
            initializer=self.initializer,
        )

    def call(self, tokens):
        return tokens + ops.cast(self.embedding, tokens.dtype)

    def assign_resized(
        self, pos_embed, old_grid=None, method: str = "bicubic", antialias: bool = True
    ) -> None:
        """Set the embedding from one trained on any grid, resampled to this layer's grid."""
        resized = resize_pos_embed(
            np.asarray(pos_embed, dtype="float32"),
            self.grid_size,
            num_prefix_tokens=self.num_prefix_tokens,
            old_grid=old_grid,
            method=method,
            antialias=antialias,
        )
        self.embedding.assign(resized.reshape(self.embedding.shape))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            grid_size=self.grid_size,
            num_prefix_tokens=self.num_prefix_tokens,
            initializer=keras.initializers.serialize(self.initializer),
        )
        return config


def _dropped(layer: keras.layers.Layer, rate: float, inputs, training):
    """`layer(inputs)` for a dropout-like layer, skipped where it would return `inputs` (rate 0, or
    not training): Keras's work per layer call is ~0.1 ms in eager PyTorch, a third of a
    ViT's layer calls are these, and they dominate a GPU step there (benchmarks/torch_overhead.py)."""
    return layer(inputs, training=training) if training and rate else inputs


@keras.saving.register_keras_serializable(package=_PACKAGE)
class DropPath(keras.layers.Layer):
    """Stochastic depth: drops a whole residual branch per sample with probability `rate`."""

    def __init__(self, rate: float = 0.0, seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"DropPath rate must be in [0, 1), got {rate}.")
        self.rate = float(rate)
        self.seed = seed
        # On PyTorch its state is on the host: a draw never waits for the GPU (`torch_step.uniform`).
        self.seed_generator = host_seed_generator(seed) if rate > 0 else None

    def call(self, inputs, training=None):
        if not training or self.rate == 0.0:
            return inputs
        keep = 1.0 - self.rate
        shape = (ops.shape(inputs)[0],) + (1,) * (len(inputs.shape) - 1)
        mask = uniform(shape, self.seed_generator) < keep
        return ops.where(mask, inputs / ops.cast(keep, inputs.dtype), ops.zeros_like(inputs))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(rate=self.rate, seed=self.seed)
        return config


def _attention_projections(owner: str, hidden_size: int, num_heads: int, policy) -> tuple[int, tuple]:
    """`(head_dim, (query, key, value, output))`: multi-head attention's unbuilt projections in Flax's
    layouts (`(D, heads, head_dim)` kernels), shared by self-attention and attention pooling."""
    if hidden_size % num_heads:
        raise ValueError(f"{owner}: hidden size {hidden_size} is not divisible by {num_heads} heads.")
    head_dim = hidden_size // num_heads
    query, key, value = (
        keras.layers.EinsumDense(
            "abc,cde->abde",
            output_shape=(None, num_heads, head_dim),
            bias_axes="de",
            kernel_initializer="glorot_uniform",
            dtype=policy,
            name=name,
        )
        for name in ("query", "key", "value")
    )
    output = keras.layers.EinsumDense(
        "abcd,cde->abe",
        output_shape=(None, hidden_size),
        bias_axes="e",
        kernel_initializer="glorot_uniform",
        dtype=policy,
        name="attention_output",
    )
    return head_dim, (query, key, value, output)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MultiHeadSelfAttention(keras.layers.Layer):
    """Multi-head self-attention with the original checkpoints' kernel layout, computed as plain GEMMs.

    The weights are those of the original Flax code and of `keras.layers.MultiHeadAttention`
    (same sublayers and variable paths): `query`, `key`, `value` kernels `(D, heads, D/heads)`
    with biases `(heads, D/heads)`, and `attention_output` `(heads, D/heads, D)` with bias
    `(D,)`. The call does not run those sublayers: it views the kernels as matrices (free
    reshapes), projects all tokens `(batch * tokens, D)` to query|key|value with one
    `(D, 3D)` matrix product (the 1/sqrt(D/heads) scale folded into the query columns), then
    attends per head by the `attention_implementation` (see `choose_attention`):

    * `"plain"`: softmax(q k^T) v with batched products, the logits in at least float32: what
      `keras.ops.dot_product_attention` computes on TensorFlow (which has no fused kernel),
      minus a scaling pass over the logits and `EinsumDense`'s broadcast products;
    * `"fused"`: the backend's attention op: PyTorch's `scaled_dot_product_attention`; on JAX
      `jax.nn.dot_product_attention` with the kernel named explicitly (cuDNN flash attention
      for half precision on a GPU, XLA's otherwise), so no try-and-fall-back logs an error;
    * `"fused_padded"`: the tokens padded to a multiple of `ATTENTION_PADDING_MULTIPLE`, the
      padding masked out by sequence lengths, the fused op, the padding sliced off: cuDNN's
      flash attention refuses ViT token counts (50, 197, 577) when training, not 256 or 640.
      Off a GPU the same padding and masks run through XLA's kernel (JAX) or a key mask
      (other backends): equal to `"plain"`, which is how it is tested on a CPU;
    * `"auto"` (default): per backend, device, compute dtype and mode, `ATTENTION_POLICY`. On
      JAX on a GPU in half precision an inference call runs cuDNN unpadded: gradients through it
      (e.g. saliency maps of a model called with `training=False`) need cuDNN's training kernel,
      which refuses ViT token counts; use `"fused_padded"` for those.

    Returning the scores (inspection) and attention dropout while training always take
    `"plain"`. `dropout` is attention dropout (on the probabilities).

    Quantized projections (`model.quantize("int8")`, `"int4"`, `"float8"`) are computed by the
    sublayers' own calls instead, the only place their integer kernels and scales are used
    correctly; the attention itself is the same. LoRA (`keras_vit.enable_lora`) keeps the fused
    path: a float `EinsumDense.kernel` already includes the LoRA product.
    """

    def __init__(
        self, num_heads: int, dropout: float = 0.0, attention_implementation: str = "auto", **kwargs
    ):
        super().__init__(**kwargs)
        self.num_heads = int(num_heads)
        self.dropout = float(dropout)
        self.attention_implementation = checked_implementation(attention_implementation)

    def build(self, input_shape):
        hidden_size = input_shape[-1]
        self.hidden_size = hidden_size
        self.head_dim, projections = _attention_projections(
            self.name, hidden_size, self.num_heads, self.dtype_policy
        )
        self.query_dense, self.key_dense, self.value_dense, self.output_dense = projections
        self.dropout_layer = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy, name="dropout")
        for projection in (self.query_dense, self.key_dense, self.value_dense):
            projection.build(input_shape)
        self.output_dense.build((None, None, self.num_heads, self.head_dim))
        self.dropout_layer.build((None, self.num_heads, None, None))

    def _runs_sublayers(self) -> bool:
        """True when a projection is quantized: the call then runs the `EinsumDense` sublayers.

        Quantized kernels (int8, int4: integers with a scale; float8: fake-quantized inputs and
        kernel) only compute correctly in the sublayers' own `call`. LoRA needs no such path:
        `EinsumDense.kernel` of a float layer already returns the kernel plus the scaled LoRA
        product, so the fused product trains the LoRA factors. (A method, not a property: `.keras`
        saving walks every attribute, and a property listing the sublayers would save them twice.)
        """
        projections = (self.query_dense, self.key_dense, self.value_dense, self.output_dense)
        return any(dense.quantization_mode is not None for dense in projections)

    def call(self, tokens, training=None, return_attention_scores: bool = False):
        if self._runs_sublayers():
            return self._call_sublayers(tokens, training, return_attention_scores)
        batch, length = ops.shape(tokens)[0], ops.shape(tokens)[1]
        width, heads = self.hidden_size, self.num_heads
        scale = ops.cast(1.0 / np.sqrt(self.head_dim), self.compute_dtype)
        pairs = ((self.query_dense, scale), (self.key_dense, 1), (self.value_dense, 1))
        kernel = ops.concatenate([ops.reshape(d.kernel, (width, width)) * s for d, s in pairs], axis=1)
        bias = ops.concatenate([ops.reshape(d.bias, (width,)) * s for d, s in pairs], axis=0)
        qkv = ops.matmul(ops.reshape(tokens, (-1, width)), kernel) + bias
        qkv = ops.reshape(qkv, (batch, length, 3, heads, self.head_dim))
        implementation = "plain"
        if not return_attention_scores and not (training and self.dropout):
            implementation = choose_attention(
                self.attention_implementation, self.compute_dtype, bool(training), self.head_dim
            )
        if implementation == "plain":
            # Unstacked, not indexed: the gradient of three slices is three zero-filled full-size
            # tensors and their sum (~10% of a ViT-S/16 training step on TensorFlow), of unstack one stack.
            query, key, value = ops.unstack(ops.transpose(qkv, (2, 0, 3, 1, 4)), 3, axis=0)
            context, scores = self._attend(query, key, value, training)
            context = ops.reshape(ops.transpose(context, (0, 2, 1, 3)), (-1, width))
        else:
            # (batch, tokens, heads, head_dim), the layout of the fused ops; q is scaled.
            query, key, value = ops.unstack(qkv, 3, axis=2)
            context = fused_attention(
                query, key, value, padded=implementation == "fused_padded", training=bool(training)
            )
            context, scores = ops.reshape(context, (-1, width)), None
        output = ops.matmul(context, ops.reshape(self.output_dense.kernel, (width, width)))
        output = ops.reshape(output + self.output_dense.bias, (batch, length, width))
        return (output, scores) if return_attention_scores else output

    def _call_sublayers(self, tokens, training, return_attention_scores):
        """The same attention through the `EinsumDense` sublayers' calls (quantized kernels)."""
        scale = ops.cast(1.0 / np.sqrt(self.head_dim), self.compute_dtype)
        query, key, value = (
            ops.transpose(dense(tokens), (0, 2, 1, 3))  # (batch, heads, tokens, head_dim)
            for dense in (self.query_dense, self.key_dense, self.value_dense)
        )
        context, scores = self._attend(query * scale, key, value, training)
        output = self.output_dense(ops.transpose(context, (0, 2, 1, 3)))  # (batch, tokens, heads, head_dim)
        return (output, scores) if return_attention_scores else output

    def _attend(self, query, key, value, training):
        """softmax(q k^T) v per head for `(batch, heads, tokens, head_dim)` inputs (q already scaled)."""
        logits = ops.matmul(query, ops.transpose(key, (0, 1, 3, 2)))  # einsum is slow in bfloat16
        scores = ops.softmax(ops.cast(logits, _statistics_dtype(logits.dtype)), axis=-1)
        scores = ops.cast(scores, self.compute_dtype)
        return ops.matmul(_dropped(self.dropout_layer, self.dropout, scores, training), value), scores

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            num_heads=self.num_heads,
            dropout=self.dropout,
            attention_implementation=self.attention_implementation,
        )
        return config


@ops.custom_gradient
def _erf_gelu_lean_gradient(x):
    """Exact GELU x·Φ(x) whose derivative Φ(x) + x·φ(x) is written out (Φ kept from the forward).

    TensorFlow differentiates `ops.gelu`'s erf form op by op (erf's derivative, then the products
    and sums around it): ~8% of a ViT-S/16 training step on a CPU. Values and gradients are
    `ops.gelu`'s to rounding. Used on TensorFlow only (`_gelu`), whose gradient call is `(upstream)`.
    """
    cdf = 0.5 * (1.0 + ops.erf(x / np.sqrt(2.0)))

    def gradient(upstream):
        return upstream * (cdf + x * (ops.exp(-0.5 * ops.square(x)) / np.sqrt(2.0 * np.pi)))

    return x * cdf, gradient


def _erf_gelu(x):
    """Exact GELU x·(1 + erf(x/√2))/2 in float32, cast back to `x`'s dtype.

    JAX's `gelu(approximate=False)` is x·erfc(−x/√2)/2, and erfc costs an exp and branches per
    element: one elementwise kernel took 6.0 of 23.8 ms of a ViT-B/16 bf16 inference call on an
    H200; this form takes 3.0 (11.7% more images/s; training 2.9%; not slower on a CPU).
    Values are `ops.gelu`'s to float32 rounding (in bfloat16 computed wider, then rounded once).
    """
    wide = ops.cast(x, "float32")
    return ops.cast(0.5 * wide * (1.0 + ops.erf(wide * np.float32(1.0 / np.sqrt(2.0)))), x.dtype)


def _gelu(x, approximate: bool, training) -> object:
    """GELU of an MLP: `ops.gelu` (whose forward oneDNN fuses into the preceding matmul at inference;
    torch has fused GELU kernels), except the exact form on TensorFlow while training (lean
    gradient) and on JAX (erf instead of erfc)."""
    backend = keras.backend.backend()
    if not approximate and backend == "jax":
        return _erf_gelu(x)
    if not approximate and training and backend == "tensorflow":
        return _erf_gelu_lean_gradient(x)
    return ops.gelu(x, approximate=approximate)


def _statistics_dtype(dtype) -> str:
    """float32 for half-precision tensors (softmax statistics), else the dtype itself."""
    dtype = keras.backend.standardize_dtype(dtype)
    return "float32" if dtype in ("float16", "bfloat16") else dtype


@keras.saving.register_keras_serializable(package=_PACKAGE)
class TransformerBlock(keras.layers.Layer):
    """Pre-LayerNorm encoder block: x + MSA(LN(x)), then x + MLP(LN(x)) (paper eq. 2-3).

    Attention is `MultiHeadSelfAttention`, whose kernels have the original checkpoints'
    layout. The MLP is D -> `mlp_dim` -> D with exact (erf) GELU, as timm and transformers, or
    with `approximate_gelu` the tanh form of the original code's Flax `nn.gelu`; it is applied
    to the tokens as one `(batch * tokens, D)` matrix (one GEMM per layer). `dropout` follows every dense
    layer but the query/key/value projections, as in the paper; `drop_path` is stochastic
    depth; `attention_implementation` is the attention's (`MultiHeadSelfAttention`).
    """

    def __init__(
        self,
        num_heads: int,
        mlp_dim: int,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        drop_path: float = 0.0,
        layer_norm_epsilon: float = LAYER_NORM_EPSILON,
        approximate_gelu: bool = False,
        attention_implementation: str = "auto",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_heads = int(num_heads)
        self.mlp_dim = int(mlp_dim)
        self.dropout = float(dropout)
        self.attention_dropout = float(attention_dropout)
        self.drop_path = float(drop_path)
        self.layer_norm_epsilon = float(layer_norm_epsilon)
        self.approximate_gelu = bool(approximate_gelu)
        self.attention_implementation = checked_implementation(attention_implementation)

    def build(self, input_shape):
        hidden_size = input_shape[-1]
        policy = self.dtype_policy
        dense_init = dict(
            kernel_initializer="glorot_uniform",
            bias_initializer=keras.initializers.RandomNormal(stddev=1e-6),
            dtype=policy,
        )
        self.norm1 = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=policy, name="norm1"
        )
        self.attention = MultiHeadSelfAttention(
            self.num_heads,
            dropout=self.attention_dropout,
            attention_implementation=self.attention_implementation,
            dtype=policy,
            name="attention",
        )
        self.norm2 = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=policy, name="norm2"
        )
        self.fc1 = keras.layers.Dense(self.mlp_dim, name="fc1", **dense_init)
        self.fc2 = keras.layers.Dense(hidden_size, name="fc2", **dense_init)
        self.dropout_layer = keras.layers.Dropout(self.dropout, dtype=policy, name="dropout")
        self.drop_path_layer = DropPath(self.drop_path, dtype=policy, name="drop_path")

        self.norm1.build(input_shape)
        self.attention.build(input_shape)
        self.norm2.build(input_shape)
        self.fc1.build((None, hidden_size))
        self.fc2.build((None, self.mlp_dim))
        # Weightless sublayers are built too: `Model.quantize` refuses unbuilt layers, and a
        # model whose call never ran (built from its config, e.g. loaded) has not built them.
        self.dropout_layer.build(input_shape)
        self.drop_path_layer.build(input_shape)

    def call(self, tokens, training=None, return_attention_scores: bool = False):
        implementation = eager_torch.applies(self, training, return_attention_scores)
        if implementation:
            return eager_torch.block_call(self, tokens, implementation)
        attended = self.attention(
            self.norm1(tokens), training=training, return_attention_scores=return_attention_scores
        )
        if return_attention_scores:
            attended, scores = attended
        attended = _dropped(self.dropout_layer, self.dropout, attended, training)
        tokens = tokens + _dropped(self.drop_path_layer, self.drop_path, attended, training)

        hidden = ops.reshape(self.norm2(tokens), (-1, tokens.shape[-1]))
        hidden = _gelu(self.fc1(hidden), self.approximate_gelu, training)
        hidden = _dropped(self.dropout_layer, self.dropout, hidden, training)
        hidden = _dropped(self.dropout_layer, self.dropout, self.fc2(hidden), training)
        hidden = ops.reshape(hidden, ops.shape(tokens))
        tokens = tokens + _dropped(self.drop_path_layer, self.drop_path, hidden, training)
        return (tokens, scores) if return_attention_scores else tokens

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            num_heads=self.num_heads,
            mlp_dim=self.mlp_dim,
            dropout=self.dropout,
            attention_dropout=self.attention_dropout,
            drop_path=self.drop_path,
            layer_norm_epsilon=self.layer_norm_epsilon,
            approximate_gelu=self.approximate_gelu,
            attention_implementation=self.attention_implementation,
        )
        return config


@keras.saving.register_keras_serializable(package=_PACKAGE)
class TokenPooling(keras.layers.Layer):
    """Reduces `(batch, tokens, D)` to `(batch, D)`: the [class] token, or the mean of patch tokens."""

    MODES = ("token", "gap")

    def __init__(self, mode: str = "token", num_prefix_tokens: int = 1, **kwargs):
        super().__init__(**kwargs)
        if mode not in self.MODES:
            raise ValueError(f"Unknown pooling {mode!r}: use one of {self.MODES}.")
        self.mode = mode
        self.num_prefix_tokens = int(num_prefix_tokens)

    def call(self, tokens):
        if self.mode == "token":
            return tokens[:, 0]
        return ops.mean(tokens[:, self.num_prefix_tokens :], axis=1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])

    def get_config(self):
        config = super().get_config()
        config.update(mode=self.mode, num_prefix_tokens=self.num_prefix_tokens)
        return config


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MultiheadAttentionPooling(keras.layers.Layer):
    """Multihead attention pooling (MAP): a learned probe token attends over the tokens, then a
    residual MLP reads it out; `(batch, tokens, D)` -> `(batch, D)`.

    The head of big_vision's `pool_type="map"` models (`MAPHead`) and timm's `global_pool="map"`
    (`AttentionPoolLatent`): `x = attention(query=probe, key=value=tokens)`, then
    `x + MLP(LayerNorm(x))`, token 0. Weights in the Flax layout, as `MultiHeadSelfAttention`:
    `probe` `(1, 1, D)`; `query`, `key`, `value` kernels `(D, heads, D/heads)` with biases
    `(heads, D/heads)`; `attention_output` `(heads, D/heads, D)`; `norm`; the MLP `fc1`
    (D -> `mlp_dim`) and `fc2`, with exact GELU or, with `approximate_gelu`, the tanh form of
    Flax's `nn.gelu`. The first `num_prefix_tokens` tokens (a [class] token) are left out, as
    timm does. The softmax in at least float32; the output in the compute dtype.
    """

    def __init__(
        self,
        num_heads: int,
        mlp_dim: int,
        num_prefix_tokens: int = 0,
        layer_norm_epsilon: float = LAYER_NORM_EPSILON,
        approximate_gelu: bool = False,
        probe_initializer="glorot_uniform",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_heads = int(num_heads)
        self.mlp_dim = int(mlp_dim)
        self.num_prefix_tokens = int(num_prefix_tokens)
        self.layer_norm_epsilon = float(layer_norm_epsilon)
        self.approximate_gelu = bool(approximate_gelu)
        self.probe_initializer = keras.initializers.get(probe_initializer)

    def build(self, input_shape):
        hidden_size = input_shape[-1]
        policy = self.dtype_policy
        self.hidden_size = hidden_size
        self.head_dim, projections = _attention_projections(self.name, hidden_size, self.num_heads, policy)
        self.query_dense, self.key_dense, self.value_dense, self.output_dense = projections
        self.probe = self.add_weight(
            name="probe", shape=(1, 1, hidden_size), initializer=self.probe_initializer
        )
        self.norm = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=policy, name="norm"
        )
        dense_init = dict(
            kernel_initializer="glorot_uniform",
            bias_initializer=keras.initializers.RandomNormal(stddev=1e-6),
            dtype=policy,
        )
        self.fc1 = keras.layers.Dense(self.mlp_dim, name="fc1", **dense_init)
        self.fc2 = keras.layers.Dense(hidden_size, name="fc2", **dense_init)
        token_shape = (None, None, hidden_size)
        for projection in (self.query_dense, self.key_dense, self.value_dense):
            projection.build(token_shape)
        self.output_dense.build((None, 1, self.num_heads, self.head_dim))
        self.norm.build((None, 1, hidden_size))
        self.fc1.build((None, 1, hidden_size))
        self.fc2.build((None, 1, self.mlp_dim))

    def call(self, tokens):
        tokens = tokens[:, self.num_prefix_tokens :] if self.num_prefix_tokens else tokens
        probe = ops.cast(self.probe, tokens.dtype)
        probe = ops.broadcast_to(probe, (ops.shape(tokens)[0], 1, self.hidden_size))
        query = ops.transpose(self.query_dense(probe), (0, 2, 1, 3))  # (batch, heads, 1, head_dim)
        key = ops.transpose(self.key_dense(tokens), (0, 2, 3, 1))  # (batch, heads, head_dim, tokens)
        value = ops.transpose(self.value_dense(tokens), (0, 2, 1, 3))  # (batch, heads, tokens, head_dim)
        logits = ops.matmul(query * ops.cast(1.0 / np.sqrt(self.head_dim), query.dtype), key)
        scores = ops.softmax(ops.cast(logits, _statistics_dtype(logits.dtype)), axis=-1)
        context = ops.matmul(ops.cast(scores, value.dtype), value)  # (batch, heads, 1, head_dim)
        pooled = self.output_dense(ops.transpose(context, (0, 2, 1, 3)))  # (batch, 1, D)
        hidden = ops.gelu(self.fc1(self.norm(pooled)), approximate=self.approximate_gelu)
        return (pooled + self.fc2(hidden))[:, 0]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])

    def get_config(self):
        config = super().get_config()
        config.update(
            num_heads=self.num_heads,
            mlp_dim=self.mlp_dim,
            num_prefix_tokens=self.num_prefix_tokens,
            layer_norm_epsilon=self.layer_norm_epsilon,
            approximate_gelu=self.approximate_gelu,
            probe_initializer=keras.initializers.serialize(self.probe_initializer),
        )
        return config
