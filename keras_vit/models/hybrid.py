"""The BiT ResNet stem of the hybrid ViTs (paper §3.1): R50+ViT-B/16, R26+ViT-S/32, R+ViT-Ti/16, ...

The stem follows `vit_jax/models_resnet.py` and timm's `ResNetV2(preact=False, stem_type="same")`:
a weight-standardised 7x7/2 `conv_root`, GroupNorm, ReLU and a 3x3/2 max-pool, then stages of
bottleneck units that are NOT pre-activation (conv1 1x1 -> GN -> ReLU -> conv2 3x3, strided ->
GN -> ReLU -> conv3 1x1 (4x width) -> GN -> + shortcut -> ReLU), with a strided 1x1 projection
shortcut (`conv_proj` + `gn_proj`) in the first unit of each stage. Stage `i` (from 1) has width
`64 * 2**(i-1)`; the first stage has stride 1, the others 2. Convolutions and the max-pool use
TensorFlow SAME padding (extra pad at the bottom/right), which is what both references use, so
any image size works; `feature_map_size` gives the map that the patch embedding sees.

Numerics (`ViTConfig.numerics`, see `keras_vit.registry.variants.NUMERICS`) -- the references differ slightly:

- `"timm"` (default) and `"hf"`: weights standardised as (w - mean) / sqrt(var + 1e-8), GroupNorm
  eps 1e-5 (timm's `StdConv2dSame(eps=1e-8)` and `GroupNormAct`; transformers' BiT has the same).
  Logits match timm to ~1e-5.
- `"jax"`: (w - mean) / (std + 1e-5), GroupNorm eps 1e-6 (`models_resnet.StdConv` and Flax's
  `nn.GroupNorm` defaults), i.e. the numerics the Google checkpoints were trained with: what the
  loaders pick for a Google `.npz`.

Layers are named after the original parameters with a `resnet_` prefix (Keras names cannot
contain "/"): `resnet_conv_root`, `resnet_gn_root`, and one `BottleneckUnit` per unit named
`resnet_block{s}_unit{u}` with sublayers `conv1..3`, `gn1..3`, `conv_proj`, `gn_proj`, so the
Google checkpoint key `block1/unit1/conv1/kernel` is the weight `resnet_block1_unit1/conv1/kernel`.
"""

from __future__ import annotations

from typing import NamedTuple

import keras
from keras import ops

from keras_vit.registry.variants import NUMERICS, ViTConfig

__all__ = [
    "STEM_NUMERICS",
    "StemNumerics",
    "StdConv2D",
    "BottleneckUnit",
    "feature_map_size",
    "resnet_stem",
    "stem_layer_names",
]

_PACKAGE = "keras_vit"
GROUPS = 32
STEM_WIDTH = 64
PREFIX = "resnet_"


class StemNumerics(NamedTuple):
    """Epsilons of the weight standardisation (`epsilon`, `epsilon_mode`) and of GroupNorm."""

    epsilon: float
    epsilon_mode: str
    group_norm_epsilon: float


# `ViTConfig.numerics` -> the stem's share of `keras_vit.registry.variants.NUMERICS`.
STEM_NUMERICS: dict[str, StemNumerics] = {
    name: StemNumerics(numerics.std_conv_epsilon, numerics.std_conv_epsilon_mode, numerics.group_norm_epsilon)
    for name, numerics in NUMERICS.items()
}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class StdConv2D(keras.layers.Layer):
    """Bias-free 2-D convolution with weight standardisation, TF SAME padding.

    The kernel (HWIO) is standardised per output channel over (H, W, Cin) on every call, so the
    stored weights are the raw checkpoint kernels. `epsilon_mode="variance"` computes
    (w - mean) / sqrt(var + epsilon) (timm), `"std"` computes (w - mean) / (std + epsilon) (JAX).
    Standardisation runs in float32 even under mixed precision, then the kernel is cast to the
    compute dtype.
    """

    EPSILON_MODES = ("variance", "std")

    def __init__(
        self,
        filters: int,
        kernel_size: int,
        strides: int = 1,
        epsilon: float = 1e-8,
        epsilon_mode: str = "variance",
        kernel_initializer="lecun_normal",
        **kwargs,
    ):
        # The raw float32 kernel is needed for the standardisation: cast it by hand in `call`.
        kwargs["autocast"] = False
        super().__init__(**kwargs)
        if epsilon_mode not in self.EPSILON_MODES:
            raise ValueError(f"Unknown epsilon_mode {epsilon_mode!r}: use 'variance' (timm) or 'std' (JAX).")
        self.filters = int(filters)
        self.kernel_size = int(kernel_size)
        self.strides = int(strides)
        self.epsilon = float(epsilon)
        self.epsilon_mode = epsilon_mode
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def build(self, input_shape):
        self.kernel = self.add_weight(
            name="kernel",
            shape=(self.kernel_size, self.kernel_size, input_shape[-1], self.filters),
            initializer=self.kernel_initializer,
        )

    def standardized_kernel(self):
        """The kernel with zero mean and unit variance per output channel, in float32."""
        kernel = ops.cast(self.kernel, "float32")
        mean = ops.mean(kernel, axis=(0, 1, 2), keepdims=True)
        centred = kernel - mean
        variance = ops.mean(ops.square(centred), axis=(0, 1, 2), keepdims=True)
        if self.epsilon_mode == "variance":
            return centred * ops.rsqrt(variance + self.epsilon)
        return centred / (ops.sqrt(variance) + self.epsilon)

    def call(self, inputs):
        # `autocast=False` also leaves the inputs as they come: compute in the compute dtype.
        inputs = ops.cast(inputs, self.compute_dtype)
        kernel = ops.cast(self.standardized_kernel(), self.compute_dtype)
        return ops.conv(inputs, kernel, strides=self.strides, padding="same")

    def compute_output_shape(self, input_shape):
        height, width = (None if size is None else -(-size // self.strides) for size in input_shape[1:3])
        return (input_shape[0], height, width, self.filters)

    def get_config(self):
        config = super().get_config()
        config.update(
            filters=self.filters,
            kernel_size=self.kernel_size,
            strides=self.strides,
            epsilon=self.epsilon,
            epsilon_mode=self.epsilon_mode,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
        )
        return config


@keras.saving.register_keras_serializable(package=_PACKAGE)
class BottleneckUnit(keras.layers.Layer):
    """BiT bottleneck unit without pre-activation, output width `4 * filters`.

    relu(GN(conv3(relu(GN(conv2(relu(GN(conv1(x))))))) + shortcut), with conv2 carrying
    `strides`; the shortcut is `gn_proj(conv_proj(x))` (strided 1x1) when the width or the
    resolution changes, else `x`. `gn3`'s scale starts at zero (as in the JAX reference), so a
    freshly initialised unit passes its shortcut through.
    """

    def __init__(
        self,
        filters: int,
        strides: int = 1,
        epsilon: float = 1e-8,
        epsilon_mode: str = "variance",
        group_norm_epsilon: float = 1e-5,
        groups: int = GROUPS,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.filters = int(filters)
        self.strides = int(strides)
        self.epsilon = float(epsilon)
        self.epsilon_mode = epsilon_mode
        self.group_norm_epsilon = float(group_norm_epsilon)
        self.groups = int(groups)

    def _conv(self, filters: int, kernel_size: int, strides: int, name: str) -> StdConv2D:
        return StdConv2D(
            filters,
            kernel_size,
            strides,
            epsilon=self.epsilon,
            epsilon_mode=self.epsilon_mode,
            dtype=self.dtype_policy,
            name=name,
        )

    def _norm(self, name: str, gamma_initializer: str = "ones") -> keras.layers.GroupNormalization:
        return keras.layers.GroupNormalization(
            groups=self.groups,
            epsilon=self.group_norm_epsilon,
            gamma_initializer=gamma_initializer,
            dtype=self.dtype_policy,
            name=name,
        )

    def build(self, input_shape):
        out_channels = 4 * self.filters
        if input_shape[-1] % self.groups or self.filters % self.groups:
            raise ValueError(
                f"{self.name}: GroupNorm with {self.groups} groups needs channel counts divisible "
                f"by {self.groups}, got {input_shape[-1]} inputs and {self.filters} filters."
            )
        self.needs_projection = input_shape[-1] != out_channels or self.strides != 1
        self.conv1 = self._conv(self.filters, 1, 1, "conv1")
        self.gn1 = self._norm("gn1")
        self.conv2 = self._conv(self.filters, 3, self.strides, "conv2")
        self.gn2 = self._norm("gn2")
        self.conv3 = self._conv(out_channels, 1, 1, "conv3")
        self.gn3 = self._norm("gn3", gamma_initializer="zeros")

        mid_shape = tuple(input_shape[:-1]) + (self.filters,)
        strided_shape = self.conv2.compute_output_shape(mid_shape)
        self.conv1.build(input_shape)
        self.gn1.build(mid_shape)
        self.conv2.build(mid_shape)
        self.gn2.build(strided_shape)
        self.conv3.build(strided_shape)
        self.gn3.build(tuple(strided_shape[:-1]) + (out_channels,))
        if self.needs_projection:
            self.conv_proj = self._conv(out_channels, 1, self.strides, "conv_proj")
            self.gn_proj = self._norm("gn_proj")
            self.conv_proj.build(input_shape)
            self.gn_proj.build(tuple(strided_shape[:-1]) + (out_channels,))

    def call(self, inputs):
        shortcut = self.gn_proj(self.conv_proj(inputs)) if self.needs_projection else inputs
        hidden = ops.relu(self.gn1(self.conv1(inputs)))
        hidden = ops.relu(self.gn2(self.conv2(hidden)))
        hidden = self.gn3(self.conv3(hidden))
        return ops.relu(hidden + shortcut)

    def compute_output_shape(self, input_shape):
        height, width = (None if size is None else -(-size // self.strides) for size in input_shape[1:3])
        return (input_shape[0], height, width, 4 * self.filters)

    def get_config(self):
        config = super().get_config()
        config.update(
            filters=self.filters,
            strides=self.strides,
            epsilon=self.epsilon,
            epsilon_mode=self.epsilon_mode,
            group_norm_epsilon=self.group_norm_epsilon,
            groups=self.groups,
        )
        return config


def _check_hybrid(config: ViTConfig) -> StemNumerics:
    if not config.is_hybrid:
        raise ValueError(f"{config.name} is not a hybrid: it has no ResNet stem (resnet_stages=None).")
    return STEM_NUMERICS[config.numerics]


def feature_map_size(config: ViTConfig, height: int, width: int) -> tuple[int, int]:
    """Size of the ResNet feature map for a `height` x `width` image (each stride-2 step: ceil(n/2))."""
    _check_hybrid(config)
    return config.feature_map_size(height, width)


def stem_layer_names(config: ViTConfig) -> dict[str, str]:
    """Original checkpoint name (`conv_root`, `gn_root`, `block{s}/unit{u}`) -> Keras layer name, in order."""
    _check_hybrid(config)
    names = {"conv_root": f"{PREFIX}conv_root", "gn_root": f"{PREFIX}gn_root"}
    for stage, unit in config.stem_units:
        names[f"block{stage}/unit{unit}"] = f"{PREFIX}block{stage}_unit{unit}"
    return names


def resnet_stem(images: keras.KerasTensor, config: ViTConfig) -> keras.KerasTensor:
    """Apply the hybrid's BiT ResNet (root + `config.resnet_stages`) to `images`, in a functional graph."""
    numerics = _check_hybrid(config)
    names = stem_layer_names(config)
    features = StdConv2D(
        STEM_WIDTH,
        7,
        2,
        epsilon=numerics.epsilon,
        epsilon_mode=numerics.epsilon_mode,
        name=names["conv_root"],
    )(images)
    features = keras.layers.GroupNormalization(
        groups=GROUPS, epsilon=numerics.group_norm_epsilon, name=names["gn_root"]
    )(features)
    features = keras.layers.ReLU(name=f"{PREFIX}relu_root")(features)
    features = keras.layers.MaxPooling2D(3, strides=2, padding="same", name=f"{PREFIX}pool_root")(features)
    for stage, unit in config.stem_units:
        features = BottleneckUnit(
            STEM_WIDTH * 2 ** (stage - 1),
            strides=2 if stage > 1 and unit == 1 else 1,
            epsilon=numerics.epsilon,
            epsilon_mode=numerics.epsilon_mode,
            group_norm_epsilon=numerics.group_norm_epsilon,
            name=names[f"block{stage}/unit{unit}"],
        )(features)
    return features
