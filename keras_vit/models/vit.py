"""The model contract: `ViT`, a functional `keras.Model` that carries its `ViTConfig` and names its parts.

Everything that needs a model's architecture (converters, `pretrained`, inspection, masked-patch
pre-training, few-shot evaluation) reads `model.config` and the role accessors (`stem`,
`patch_embed`, `class_token`, `pos_embed`, `blocks`, `encoder_norm`, `pool`, `pre_logits`,
`head`) instead of parsing layer names. `with_head` / `without_head` give a copy with another
top; `feature_model` / `token_model` views that share the weights. A `.keras` round trip keeps
the config (`get_config` holds the constructor's arguments, as keras_hub's backbones do).

Building (`build_vit`, `create_model`, the factories) is `keras_vit.models.build`; the `ViT`
constructor defaults to logits (`classifier_activation=None`), the builders to probabilities.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import keras
import numpy as np

from keras_vit.models import eager_torch, guards
from keras_vit.models.layers import (
    ClassToken,
    MultiheadAttentionPooling,
    PatchEncoder,
    PixelNormalization,
    PositionEmbedding,
    TokenPooling,
    TransformerBlock,
)
from keras_vit.models.parallel import check_array_batches
from keras_vit.models.torch_step import TorchTrainStep, device_constants
from keras_vit.registry import catalog
from keras_vit.registry.variants import NUMERICS, ViTConfig
from keras_vit.utils.validation import positive_int

if TYPE_CHECKING:
    pass

__all__ = ["ViT", "classification_head"]

_PACKAGE = "keras_vit"
IMAGE_DTYPES = ("float32", "uint8")
# The TracerWarnings `keras.src.export.onnx` filters out on PyTorch, in a block that ends before it traces.
_KERAS_SILENCED_TRACER_WARNINGS = (
    "(Converting a tensor to a Python|Iterating over a tensor|Using len to get tensor shape"
    "|torch.tensor results are registered as constants)"
)


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
class ViT(TorchTrainStep, keras.Model):
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

    def call(self, inputs, training=None, mask=None, **kwargs):
        """The functional graph's call; on PyTorch, where every block is plain, the same layers'
        arithmetic without Keras's per-layer call machinery (`eager_torch.model_call`), through
        `torch.compile` after `compile(jit_compile=True)`."""
        if mask is None and not kwargs:
            implementations = eager_torch.model_applies(self, inputs, training)
            if implementations:
                forward = eager_torch.compiled_model_call if self.compiled_forward else eager_torch.model_call
                return forward(self, inputs, implementations)
        with device_constants():  # PyTorch: the layers' constants made without a host-to-device copy
            return super().call(inputs, training=training, mask=mask, **kwargs)

    # --- input checks and a usable model after a failure (`keras_vit.models.guards`) -------------
    def __call__(self, *args, **kwargs):
        guards.check_images(self, args[0] if args else kwargs.get("inputs"))
        return super().__call__(*args, **kwargs)

    def predict(self, x, *args, **kwargs):
        """`keras.Model.predict`, with the input checked first (`guards.check_images`, `check_batch`,
        and under `make_distribution` the last batch: `parallel.check_array_batches`)."""
        guards.check_images(self, x)
        guards.check_batch(self, x)
        check_array_batches(x, kwargs.get("batch_size", args[0] if args else None))
        with guards.state_kept_on_failure(self):
            return super().predict(x, *args, **kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """`keras.Model.evaluate`; a failure leaves the model usable (`guards.state_kept_on_failure`);
        under `make_distribution`, arrays whose last batch the replicas cannot split are refused first."""
        check_array_batches(x, batch_size)
        with guards.state_kept_on_failure(self):
            return super().evaluate(x, y, batch_size, *args, **kwargs)

    @property
    def compiled_forward(self) -> bool:
        """Whether the forward pass runs through `torch.compile` (PyTorch only: `compile(jit_compile=True)`,
        or set it, e.g. for a model that an outer model calls)."""
        return getattr(self, "_compiled_forward", False)

    @compiled_forward.setter
    def compiled_forward(self, value: bool) -> None:
        if value and keras.backend.backend() != "torch":
            raise ValueError(
                "compiled_forward is PyTorch's torch.compile of the forward pass; on "
                f"{keras.backend.backend()} use compile(jit_compile=True)."
            )
        self._compiled_forward = bool(value)

    def compile(self, *args, jit_compile="auto", **kwargs):
        """`keras.Model.compile`. On PyTorch, `jit_compile=True` compiles the model's forward pass
        (`torch.compile` of `eager_torch.model_call`, where it runs) and leaves Keras's step eager:
        Keras's own `torch.compile` of the whole step took minutes to compile for a ViT and ran no
        faster (issue 36). `model.jit_compile` is then False and `model.compiled_forward` True."""
        self.compiled_forward = eager_torch.compiles_forward(jit_compile)
        super().compile(*args, jit_compile=False if self.compiled_forward else jit_compile, **kwargs)

    def compile_from_config(self, config: dict) -> None:
        """Keras's `compile_from_config` (a loaded `.keras` file compiled as it was saved), which
        Keras skips for a class that overrides `compile`."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if hasattr(self, "optimizer") and self.built:
            self.optimizer.build(self.trainable_variables)  # its variables, for the saved ones to load into

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """`keras.Model.fit`; a failure leaves the model usable (`guards.state_kept_on_failure`); under
        `make_distribution`, arrays whose last batch the replicas cannot split are refused first."""
        check_array_batches(x, batch_size, kwargs.get("validation_split") or 0.0)
        with guards.state_kept_on_failure(self, training=True):
            return super().fit(x, y, batch_size, *args, **kwargs)

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
        """`keras.Model.export`; for `format="onnx"` also from a model never called, and on TensorFlow
        with keras_vit's tf2onnx converters registered first.

        Keras's ONNX export asks for a model that has been called once, which a functional model
        needs not be: the input signature (`(None, H, W, C)` images) is passed for it. On TensorFlow,
        Keras converts with tf2onnx, which cannot convert the `Erfc` op of the exact GELU on its own
        (`keras_vit.utils.tf2onnx_ops`). On PyTorch, torch.onnx traces the model: the warnings Keras
        means to silence while it does (shapes read as Python values, constants made with
        `torch.tensor`; its filters end before the trace starts) stay silent.
        """
        if format != "onnx":
            return super().export(filepath, format=format, **kwargs)
        from keras.src.export.export_utils import get_input_signature

        kwargs.setdefault("input_signature", get_input_signature(self))
        backend = keras.backend.backend()
        if backend == "tensorflow":
            from keras_vit.utils import tf2onnx_ops

            tf2onnx_ops.register()
        with warnings.catch_warnings():
            if backend == "torch":
                import torch

                warnings.filterwarnings("ignore", _KERAS_SILENCED_TRACER_WARNINGS, torch.jit.TracerWarning)
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
