"""The model contract: `ViT`, a functional `keras.Model` that carries its `ViTConfig` and names its parts.

Everything that needs a model's architecture (converters, `pretrained`, inspection, masked-patch
pre-training, few-shot evaluation) reads `model.config` and the role accessors (`stem`,
`patch_embed`, `class_token`, `pos_embed`, `blocks`, `encoder_norm`, `pool`, `pre_logits`,
`head`) instead of parsing layer names. `with_head` / `without_head` give a copy with another
top; `feature_model` / `token_model` views that share the weights. A `.keras` round trip keeps
the config (`get_config` holds the constructor's arguments, as keras_hub's backbones do).

Factories: `create_model(name, ...)` over the registry `keras_vit.registry.variants.VARIANTS`, and one
generated function per registry row (`vit_b16`, `vit_r50_b16`, `vit_digits`, ...).

Outputs: as keras.applications, the factories and `build_vit` default to
`classifier_activation="softmax"` (probabilities, what `loss="sparse_categorical_crossentropy"`
expects); pass `classifier_activation=None` for logits (timm's and keras_hub's output), as the
training driver does for its from-logits loss. The low-level `ViT` constructor defaults to logits.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import keras
import numpy as np

from keras_vit.models import guards
from keras_vit.models.layers import (
    ClassToken,
    MultiheadAttentionPooling,
    PatchEncoder,
    PixelNormalization,
    PositionEmbedding,
    TokenPooling,
    TransformerBlock,
)
from keras_vit.registry import catalog
from keras_vit.registry.variants import NUMERICS, VARIANTS, ViTConfig, get_config, list_models
from keras_vit.utils.validation import positive_int

if TYPE_CHECKING:
    from keras_vit.checkpoints.pretrained import Checkpoint

__all__ = [
    "ViT",
    "build_vit",
    "build_with_checkpoint",
    "classification_head",
    "create_model",
    "list_models",
    *VARIANTS,
]

_PACKAGE = "keras_vit"
# The head's activation when the factories and `build_vit` are not told (keras.applications' default).
DEFAULT_CLASSIFIER_ACTIVATION = "softmax"
# The model's own keyword arguments; every other keyword of `build_vit` / `create_model` that
# names a `ViTConfig` field (image_size, pooling, class_token, numerics, ...) changes the config.
_MODEL_ARGUMENTS = (
    "num_classes",
    "include_top",
    "representation_size",
    "dropout",
    "attention_dropout",
    "drop_path_rate",
    "classifier_activation",
    "channels",
    "pretrained_tag",
    "quantization",
    "image_dtype",
    "image_mean",
    "image_std",
    "attention_implementation",
)
IMAGE_DTYPES = ("float32", "uint8")


def classification_head(num_classes: int, classifier_activation: str | None = None) -> keras.layers.Dense:
    """The `head` layer: zero-initialised (paper §3.2), float32 so mixed precision gives float32 logits."""
    return keras.layers.Dense(
        num_classes,
        activation=classifier_activation,
        kernel_initializer="zeros",
        name="head",
        dtype="float32",
    )


def _rate(value, what: str) -> float:
    rate = float(value)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{what} must be in [0, 1), got {value!r}.")
    return rate


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ViT(keras.Model):
    """A Vision Transformer (or hybrid ResNet+ViT) built from a `ViTConfig`.

    Layout: [hybrids: the BiT ResNet `stem`] -> `patch_embed` -> `class_token` (if
    `config.class_token`) -> `pos_embed` -> `pos_dropout` -> `blocks` -> `encoder_norm` ->
    `pool` (`config.pooling`: `TokenPooling` for "token" / "gap", `MultiheadAttentionPooling`
    for "map"; absent for `None`, which outputs the token sequence) -> `pre_logits` (with
    `representation_size`) -> `head` (with `include_top`). With `config.fc_norm` the
    `encoder_norm` follows the `pool` (timm's `fc_norm`).

    Args:
        config: the architecture, including `image_size`, `pooling` and `class_token`.
        num_classes: classes of the zero-initialised float32 `head` (with `include_top`).
        include_top: with `False` the model returns the pooled representation `(batch, D)`
            (or `representation_size`), or with `pooling=None` the token sequence after the
            final LayerNorm.
        representation_size: width of the original ImageNet-21k checkpoints' pre-logits
            Dense+tanh layer; `None` for none.
        dropout, attention_dropout, drop_path_rate: regularisation; stochastic depth grows
            linearly from 0 to `drop_path_rate` over the blocks.
        classifier_activation: activation of the head, e.g. `"softmax"`; `None` (this low-level
            constructor's default) gives logits. The factories default to `"softmax"`.
        channels: input channels (3 for RGB).
        pretrained_tag: the catalog tag of the weights, set by the loaders (for preprocessing
            and labels); kept by `.keras` saving.
        quantization: `{sublayer path: {"mode": ..., "config": ...}}` to quantize at
            construction, as recorded by `get_config` after `model.quantize(...)` (the layer's
            serialised `QuantizationConfig`: int4 block size, int8 weight-only), so a quantized
            model round-trips. A bare mode string stands for its default config.
        image_dtype: `"float32"` (default): images already normalised; `"uint8"`: pixels in
            [0, 255], normalised inside the model (`PixelNormalization`, first layer), so
            `model.predict(uint8_images)` moves 4x fewer bytes to the device; equal to
            normalising on the host with `keras_vit.preprocess_input` bit for bit.
        image_mean, image_std: the per-channel statistics of a uint8 input (as
            `keras_vit.Preprocessing`: `(x / 255 - mean) / std`); default those of the catalog
            checkpoint named by `pretrained_tag` or `name` (a model built from a tag), else the
            package default 0.5, 0.5 ([-1, 1]).
        attention_implementation: `"auto"` (default), `"plain"`, `"fused"` or `"fused_padded"`:
            how every block attends (`keras_vit.models.layers.MultiHeadSelfAttention`; `"auto"`
            follows `keras_vit.models.attention.ATTENTION_POLICY`). Same values either way.
    """

    def __init__(
        self,
        config: ViTConfig | dict,
        *,
        num_classes: int = 1000,
        include_top: bool = True,
        representation_size: int | None = None,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        drop_path_rate: float = 0.0,
        classifier_activation: str | None = None,
        channels: int = 3,
        pretrained_tag: str | None = None,
        quantization: dict[str, dict | str] | None = None,
        image_dtype: str = "float32",
        image_mean: Sequence[float] | None = None,
        image_std: Sequence[float] | None = None,
        attention_implementation: str = "auto",
        name: str | None = None,
        **kwargs,
    ):
        if isinstance(config, dict):
            config = ViTConfig.from_dict(config)
        if not isinstance(config, ViTConfig):
            raise TypeError(f"config must be a keras_vit.ViTConfig, got {type(config).__name__}.")
        if include_top and config.pooling is None:
            raise ValueError("pooling=None returns the token sequence: it needs include_top=False.")
        if include_top:
            num_classes = positive_int("num_classes (with include_top=True)", num_classes)
        channels = positive_int("channels (3 for RGB, 1 for grayscale)", channels)
        if representation_size:
            representation_size = positive_int("representation_size", representation_size)
        grid = config.token_grid()
        height, width = config.image_hw

        image_mean, image_std = _image_statistics(
            image_dtype, image_mean, image_std, config, pretrained_tag or name
        )
        images = keras.Input(shape=(height, width, channels), dtype=image_dtype, name="images")
        features = images
        if image_dtype == "uint8":
            features = PixelNormalization(image_mean, image_std, name="pixel_normalization")(images)
        if config.is_hybrid:
            from keras_vit.models.hybrid import resnet_stem

            features = resnet_stem(features, config)
        tokens = PatchEncoder(config.patch_size, config.hidden_size, name="patch_embed")(features)
        if config.class_token:
            tokens = ClassToken(name="class_token")(tokens)
        tokens = PositionEmbedding(grid, num_prefix_tokens=config.num_prefix_tokens, name="pos_embed")(tokens)
        tokens = keras.layers.Dropout(_rate(dropout, "dropout"), name="pos_dropout")(tokens)
        drop_path_rates = np.linspace(0.0, _rate(drop_path_rate, "drop_path_rate"), config.depth)
        numerics = NUMERICS[config.numerics]
        for index, rate in enumerate(drop_path_rates):
            tokens = TransformerBlock(
                config.num_heads,
                config.mlp_dim,
                dropout=dropout,
                attention_dropout=_rate(attention_dropout, "attention_dropout"),
                drop_path=float(rate),
                layer_norm_epsilon=numerics.layer_norm_epsilon,
                approximate_gelu=numerics.approximate_gelu,
                attention_implementation=attention_implementation,
                name=f"block_{index}",
            )(tokens)
        encoder_norm = keras.layers.LayerNormalization(
            epsilon=numerics.layer_norm_epsilon, name="encoder_norm"
        )
        outputs = tokens if config.fc_norm else encoder_norm(tokens)
        if config.pooling is not None:
            outputs = _pooling_layer(config)(outputs)
            if config.fc_norm:
                outputs = encoder_norm(outputs)
            if representation_size:
                outputs = keras.layers.Dense(representation_size, activation="tanh", name="pre_logits")(
                    outputs
                )
        if include_top:
            outputs = classification_head(num_classes, classifier_activation)(outputs)
        super().__init__(inputs=images, outputs=outputs, name=name or config.name, **kwargs)
        self.config = config
        self.num_classes = num_classes if include_top else None
        self.include_top = bool(include_top)
        self.representation_size = representation_size or None
        self.dropout = float(dropout)
        self.attention_dropout = float(attention_dropout)
        self.drop_path_rate = float(drop_path_rate)
        self.classifier_activation = classifier_activation
        self.channels = channels
        self.pretrained_tag = pretrained_tag
        self.image_dtype = image_dtype
        self.image_mean, self.image_std = image_mean, image_std
        self.attention_implementation = attention_implementation
        if quantization:
            self._quantize_layers(quantization)

    # --- parts by role -------------------------------------------------------------------------
    def _optional_layer(self, name: str) -> keras.layers.Layer | None:
        try:
            return self.get_layer(name)
        except ValueError:
            return None

    @property
    def stem(self) -> dict[str, keras.layers.Layer]:
        """A hybrid's ResNet layers by their original checkpoint names (`conv_root`, `gn_root`,
        `block1/unit1`, ...), in order; `{}` for a plain ViT."""
        if not self.config.is_hybrid:
            return {}
        from keras_vit.models.hybrid import stem_layer_names

        return {role: self.get_layer(name) for role, name in stem_layer_names(self.config).items()}

    @property
    def patch_embed(self) -> PatchEncoder:
        return self.get_layer("patch_embed")

    @property
    def class_token(self) -> ClassToken | None:
        return self._optional_layer("class_token") if self.config.class_token else None

    @property
    def pos_embed(self) -> PositionEmbedding:
        return self.get_layer("pos_embed")

    @property
    def blocks(self) -> list[TransformerBlock]:
        return [self.get_layer(f"block_{index}") for index in range(self.config.depth)]

    @property
    def encoder_norm(self) -> keras.layers.LayerNormalization:
        return self.get_layer("encoder_norm")

    @property
    def pool(self) -> TokenPooling | MultiheadAttentionPooling | None:
        return self._optional_layer("pool")

    @property
    def pre_logits(self) -> keras.layers.Dense | None:
        return self._optional_layer("pre_logits")

    @property
    def head(self) -> keras.layers.Dense | None:
        return self._optional_layer("head")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """`(height, width, channels)` of the input."""
        return (*self.config.image_hw, self.channels)

    # --- input checks and a usable model after a failure (`keras_vit.models.guards`) -------------
    def __call__(self, *args, **kwargs):
        guards.check_images(self, args[0] if args else kwargs.get("inputs"))
        return super().__call__(*args, **kwargs)

    def predict(self, x, *args, **kwargs):
        """`keras.Model.predict`, with the input checked first (`guards.check_images`, `check_batch`)."""
        guards.check_images(self, x)
        guards.check_batch(self, x)
        with guards.state_kept_on_failure(self):
            return super().predict(x, *args, **kwargs)

    def evaluate(self, *args, **kwargs):
        """`keras.Model.evaluate`; a failure leaves the model usable (`guards.state_kept_on_failure`)."""
        with guards.state_kept_on_failure(self):
            return super().evaluate(*args, **kwargs)

    def fit(self, *args, **kwargs):
        """`keras.Model.fit`; a failure leaves the model usable (`guards.state_kept_on_failure`)."""
        with guards.state_kept_on_failure(self, training=True):
            return super().fit(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        """`keras.Model.train_on_batch`; a failure leaves the model usable (`guards`)."""
        with guards.state_kept_on_failure(self, training=True):
            return super().train_on_batch(*args, **kwargs)

    # --- views and copies ----------------------------------------------------------------------
    def token_model(self) -> keras.Model:
        """A view (same weights) that returns the token sequence after the final LayerNorm.

        With `config.fc_norm` (the LayerNorm follows the pooling) the last block's output, as
        timm's `forward_features` returns it.
        """
        tokens = self.blocks[-1].output if self.config.fc_norm else self.encoder_norm.output
        return keras.Model(self.input, tokens, name=f"{self.name}_tokens")

    def feature_model(self) -> keras.Model:
        """A view (same weights) that returns the pre-head representation `(batch, D)`.

        The pre-logits output if any, else the pooled tokens, else (pooling `None`) token 0, or
        without a [class] token the mean of the tokens.
        """
        layer = self.pre_logits or (self.encoder_norm if self.config.fc_norm else self.pool)
        if layer is not None:
            features = layer.output
        elif self.config.class_token:
            features = self.encoder_norm.output[:, 0]
        else:
            features = keras.ops.mean(self.encoder_norm.output, axis=1)
        return keras.Model(self.input, features, name=f"{self.name}_features")

    def rebuild(self, *, copy_head: bool = True, **changes) -> ViT:
        """A new model with constructor arguments or config fields changed, and a copy of the weights.

        Every layer both models have with the same weight shapes is copied (the head only with
        `copy_head` and an unchanged class count); the rest keeps its initialisation.
        """
        arguments = self.get_config()
        config_changes = {key: changes.pop(key) for key in list(changes) if key in arguments["config"]}
        unknown = sorted(set(changes) - set(arguments))
        if unknown:
            raise TypeError(f"Unknown argument(s) {unknown} for ViT.rebuild: use ViT or ViTConfig arguments.")
        arguments.update(changes, config=self.config.replace(**config_changes))
        model = ViT(**arguments)
        copy_weights(self, model, skip=() if copy_head else ("head",))
        return model

    def with_head(self, num_classes: int, *, pooling: str | None = None, **changes) -> ViT:
        """A classifier copy with a new zero-initialised `num_classes` head (paper §3.2), for fine-tuning.

        `pooling` defaults to the model's, or `"token"` (`"gap"` without a [class] token) for a
        token-sequence model. `classifier_activation` defaults to the model's own (`"softmax"`
        for a factory-built model): pass `classifier_activation=None` for logits, e.g. to train
        with a from-logits loss such as `keras_vit.training.optimization.loss()`. Other `changes` as
        `rebuild` (e.g. `dropout`, `drop_path_rate`).
        """
        if pooling is None:
            pooling = self.config.pooling or ("token" if self.config.class_token else "gap")
        return self.rebuild(
            copy_head=False, include_top=True, num_classes=num_classes, pooling=pooling, **changes
        )

    def without_head(self, **changes) -> ViT:
        """A copy without the head: the pooled features, or with `pooling=None` the token sequence."""
        return self.rebuild(include_top=False, **changes)

    # --- quantization --------------------------------------------------------------------------
    def quantize(self, mode=None, config=None, filters=None, **kwargs):
        """`keras.Model.quantize` (`"int8"`, `"int4"`, `"float8"` or a `QuantizationConfig`), fast.

        Keras runs a full `gc.collect()` for every kernel it replaces, ~0.3 s each in a process
        with TensorFlow loaded (18 s for ViT-B/16 on a 2-core CPU); the collector's objects are
        frozen meanwhile, so those collections take milliseconds (0.6 s in all).
        """
        with _frozen_gc():
            super().quantize(mode, config=config, filters=filters, **kwargs)

    # --- export ---------------------------------------------------------------------------------
    def export(self, filepath, format: str = "tf_saved_model", **kwargs):
        """`keras.Model.export`; for `format="onnx"` with keras_vit's tf2onnx converters registered first.

        On TensorFlow, Keras converts with tf2onnx, which cannot convert the `Erfc` op of the exact
        GELU on its own (`keras_vit.utils.tf2onnx_ops`); the JAX and PyTorch backends use other converters.
        """
        if format == "onnx" and keras.backend.backend() == "tensorflow":
            from keras_vit.utils import tf2onnx_ops

            tf2onnx_ops.register()
        return super().export(filepath, format=format, **kwargs)

    # --- serialisation -------------------------------------------------------------------------
    def get_config(self) -> dict:
        return {
            "name": self.name,
            "trainable": self.trainable,
            "config": self.config.to_dict(),
            "num_classes": self.num_classes if self.include_top else 1000,
            "include_top": self.include_top,
            "representation_size": self.representation_size,
            "dropout": self.dropout,
            "attention_dropout": self.attention_dropout,
            "drop_path_rate": self.drop_path_rate,
            "classifier_activation": self.classifier_activation,
            "channels": self.channels,
            "pretrained_tag": self.pretrained_tag,
            "quantization": self.quantization() or None,
            "image_dtype": self.image_dtype,
            "image_mean": self.image_mean,
            "image_std": self.image_std,
            "attention_implementation": self.attention_implementation,
        }

    def _quantize_layers(self, quantization: dict[str, dict | str]) -> None:
        """Quantize the sublayers named by path (`block_0/attention/query`) as `Model.quantize` did."""
        layers = {layer.path: layer for layer in self._flatten_layers(include_self=False)}
        unknown = sorted(set(quantization) - set(layers))
        if unknown:
            raise ValueError(f"{self.name}: no sublayers {unknown} to quantize.")
        with _frozen_gc():
            for path, entry in quantization.items():
                entry = {"mode": entry} if isinstance(entry, str) else entry
                config = entry.get("config")
                config = keras.saving.deserialize_keras_object(config) if config else None
                layers[path].quantize(entry["mode"], config=config)

    def quantization(self) -> dict[str, dict]:
        """`{sublayer path: {"mode": ..., "config": ...}}` of the quantized layers; `{}` if none.

        `config` is the layer's serialised `keras.quantizers.QuantizationConfig` (or `None`).
        """
        return {
            layer.path: {
                "mode": layer.quantization_mode,
                "config": keras.saving.serialize_keras_object(getattr(layer, "quantization_config", None)),
            }
            for layer in self._flatten_layers(include_self=False)
            if getattr(layer, "quantization_mode", None)
        }

    @classmethod
    def from_config(cls, config: dict) -> ViT:
        return cls(**config)


def _image_statistics(
    image_dtype: str, mean, std, config: ViTConfig, tag: str | None
) -> tuple[tuple | None, tuple | None]:
    """`(mean, std)` of a uint8 input: as given, else the catalog checkpoint `tag`'s, else the package
    default (`catalog.preprocessing_for`); `(None, None)` for a float input, which takes neither."""
    if image_dtype not in IMAGE_DTYPES:
        raise ValueError(
            f'image_dtype must be one of {IMAGE_DTYPES}, got {image_dtype!r}: "uint8" for pixels in '
            '[0, 255] normalised in the model, "float32" for images normalised beforehand.'
        )
    if image_dtype == "float32":
        if mean is not None or std is not None:
            raise ValueError("image_mean and image_std normalise a uint8 input: pass image_dtype='uint8'.")
        return None, None
    entry = catalog.model_entry(tag) if tag in catalog.list_pretrained() else None
    spec = catalog.preprocessing_for(entry if mean is None or std is None else None, config.image_hw)
    spec = spec.replace(mean=spec.mean if mean is None else mean, std=spec.std if std is None else std)
    return spec.mean, spec.std


def _pooling_layer(config: ViTConfig) -> keras.layers.Layer:
    """The `pool` layer of `config.pooling`: the [class] token or the patch mean, or attention pooling."""
    if config.pooling == "map":
        numerics = NUMERICS[config.numerics]
        return MultiheadAttentionPooling(
            config.num_heads,
            config.mlp_dim,
            num_prefix_tokens=config.num_prefix_tokens,
            layer_norm_epsilon=numerics.layer_norm_epsilon,
            approximate_gelu=numerics.approximate_gelu,
            name="pool",
        )
    return TokenPooling(config.pooling, config.num_prefix_tokens, name="pool")


@contextlib.contextmanager
def _frozen_gc():
    """Objects that exist now are left out of garbage collections until the block ends (`gc.freeze`)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def copy_weights(source: keras.Model, target: keras.Model, skip: Sequence[str] = ()) -> None:
    """Copy every layer's weights from `source` to the same-named layer of `target` where shapes agree.

    All values are read before the first is assigned, so an error leaves `target` unchanged.
    """
    source_layers = {layer.name: layer for layer in source.layers}
    copies = []
    for layer in target.layers:
        other = source_layers.get(layer.name)
        if other is None or layer.name in skip or not layer.weights:
            continue
        values = other.get_weights()
        if [value.shape for value in values] == [tuple(weight.shape) for weight in layer.weights]:
            copies.append((layer, values))
    for layer, values in copies:
        layer.set_weights(values)


def _split_arguments(config: ViTConfig, kwargs: dict) -> tuple[ViTConfig, dict]:
    """`kwargs` naming `ViTConfig` fields change the config; the rest are `ViT` arguments.

    `None` for `image_size`, `num_classes`, `include_top` or `name` means unset (the default).
    """
    kwargs = {key: value for key, value in kwargs.items() if not (key in _UNSET_BY_NONE and value is None)}
    fields = set(ViTConfig.field_names()) - {"name"}
    changes = {key: kwargs.pop(key) for key in list(kwargs) if key in fields}
    unknown = sorted(set(kwargs) - set(_MODEL_ARGUMENTS) - {"name"})
    if unknown:
        raise TypeError(
            f"Unknown argument(s) {unknown}: model arguments are {list(_MODEL_ARGUMENTS)}, config fields "
            f"{sorted(fields)}."
        )
    return (config.replace(**changes) if changes else config), kwargs


# Keywords of `build_vit` / `create_model` whose `None` means "not given".
_UNSET_BY_NONE = ("image_size", "num_classes", "include_top", "name")


def build_vit(config: ViTConfig, **kwargs) -> ViT:
    """A `ViT` from a config; keywords are `ViT` arguments or `ViTConfig` fields to change.

    E.g. `build_vit(config, image_size=384, pooling="gap", num_classes=10)`. The head gives
    probabilities (`classifier_activation="softmax"`) unless `classifier_activation=None` (logits).
    """
    config, arguments = _split_arguments(config, kwargs)
    arguments.setdefault("classifier_activation", DEFAULT_CLASSIFIER_ACTIVATION)
    return ViT(config, **arguments)


def build_with_checkpoint(
    config: ViTConfig,
    checkpoint: Checkpoint,
    kwargs: Mapping | None = None,
    pos_embed_interpolation: str | None = None,
) -> ViT:
    """The model a checkpoint fits, built and loaded: the one build-with-checkpoint step.

    The checkpoint answers the model's arguments once (`Checkpoint.model_kwargs`: the caller's
    `kwargs`, and for what they leave unset its layout, numerics, size, head, pre-logits and
    name), the model is built from `config` with them (`build_vit`), then the weights are
    loaded (`pos_embed_interpolation`: as `load_checkpoint`). `create_model(..., pretrained=)`
    and `keras_vit.load_pretrained` build through it.
    """
    model = build_vit(config, **checkpoint.model_kwargs(config, kwargs))
    checkpoint.load_into(model, pos_embed_interpolation=pos_embed_interpolation)
    return model


def create_model(
    variant: str | ViTConfig,
    pretrained: bool | str | os.PathLike = False,
    *,
    image_size: int | Sequence[int] | None = None,
    num_classes: int | None = None,
    include_top: bool | None = None,
    representation_size: int | None = None,
    name: str | None = None,
    pos_embed_interpolation: str | None = None,
    verify: bool = True,
    **kwargs,
) -> ViT:
    """Build the ViT variant `variant` (see `list_models()`), optionally with published weights.

    Args:
        variant: a name from `list_models()`, e.g. `"vit_b16"`, or a `ViTConfig`.
        pretrained: `False` for random weights (training init of the paper); `True` for the
            variant's default checkpoint; a tag (`"augreg_in21k_ft_in1k"` or
            `"vit_b16.augreg_in21k_ft_in1k"`, see `keras_vit.list_pretrained()`); a local
            checkpoint file (Google `.npz`, timm or Hugging Face `.safetensors` / `.bin`); or
            a Hugging Face Hub repo id `"org/name"`. The model is built to fit the checkpoint:
            unset `image_size`, `num_classes` and `representation_size` take its values, and
            a model built from a tag is named after it (see `keras_vit.checkpoints.pretrained`).
        image_size: int or `(height, width)`; each side a multiple of the patch size.
            Defaults to the variant's, or the checkpoint's resolution; another size
            resizes the position embedding.
        num_classes: classes of the head, default 1000 or the checkpoint's; a count other
            than the checkpoint's gives a new zero-initialised head.
        include_top: with `False`, the model returns the pooled representation
            `(batch, D)` (or `representation_size`), or with `pooling=None` the token
            sequence `(batch, 1 + patches, D)` after the final LayerNorm. Default `True`,
            except for a checkpoint without a head (`orig_in21k`) and no `num_classes`.
        representation_size: adds the pre-logits Dense+tanh layer of the original ImageNet-21k
            checkpoints with this width; loaded from a checkpoint that has one, `0` drops it.
        name: model name, defaults to the variant's (or the checkpoint's tag).
        pos_embed_interpolation: how a checkpoint's position embedding is resampled to another
            `image_size` (`keras_vit.checkpoints.pos_embed.POS_EMBED_INTERPOLATIONS`): `"jax"` (the original
            code's `scipy.ndimage.zoom(order=1)`), `"timm"` (antialiased bicubic) or `"hf"`
            (bicubic); default the checkpoint source's: `"jax"` for Google `.npz`, `"timm"` else.
        verify: for a `keras_vit.save_pretrained` folder or repo, check the SHA-256 checksums
            its `keras_vit.json` records before loading (a changed or damaged file is a
            `keras_vit.utils.files.ChecksumError` naming it); `False` loads files edited on purpose.
        **kwargs: `ViT` arguments (`dropout`, `attention_dropout`, `drop_path_rate`,
            `classifier_activation`, `channels`, `image_dtype` (`"uint8"`: pixels normalised in
            the model, with the checkpoint's mean and std), `attention_implementation`) and
            `ViTConfig` fields to change: `pooling`
            (`"token"`, the paper's default; `"gap"`; `"map"`, attention pooling; `None` for
            the token sequence), `class_token` (`False`: no [class] token; with pooling
            `"gap"`, `"map"` or `None`), `fc_norm`, `numerics` (`"timm"`, `"jax"`, `"hf"`: see
            `keras_vit.registry.variants.NUMERICS`; default the checkpoint source's: `"jax"` for a Google
            `.npz`, `"timm"` for timm, `"hf"` for transformers, else `"timm"`). A checkpoint's token layout
            (`class_token`, `pooling`, `fc_norm`: `keras_vit.inspect_checkpoint(...).layout`)
            is taken where these are not given. `classifier_activation` defaults to
            `"softmax"`, as in keras.applications: the model outputs probabilities; `None`
            gives logits.

    Inputs are images `(batch, height, width, channels)` already normalised as the weights
    expect: for all Google-trained checkpoints that is [-1, 1] (`keras_vit.preprocess_input`).
    """
    config = variant if isinstance(variant, ViTConfig) else get_config(variant)
    kwargs = dict(
        kwargs,
        image_size=image_size,
        num_classes=num_classes,
        include_top=include_top,
        representation_size=representation_size,
        name=name,
    )
    if pretrained is False or pretrained is None:
        if pos_embed_interpolation is not None:
            raise ValueError(
                "pos_embed_interpolation resamples a checkpoint's position embedding: it needs pretrained=."
            )
        return build_vit(config, **kwargs)
    from keras_vit.checkpoints.pretrained import resolve_pretrained

    _split_arguments(config, kwargs)  # argument errors before any download
    checkpoint = resolve_pretrained(
        pretrained, config.name if config.name in VARIANTS else None, verify=verify
    )
    return build_with_checkpoint(config, checkpoint, kwargs, pos_embed_interpolation)


def _factory(variant: str):
    def factory(pretrained: bool | str | os.PathLike = False, **kwargs) -> ViT:
        return create_model(variant, pretrained, **kwargs)

    factory.__name__ = factory.__qualname__ = variant
    factory.__doc__ = f"{variant}: {VARIANTS[variant].description}. Arguments as `create_model`."
    return factory


# One factory per registry row: keras_vit.vit_b16(pretrained=True), keras_vit.vit_digits(), ...
globals().update({variant: _factory(variant) for variant in VARIANTS})
