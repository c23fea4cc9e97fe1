"""The model registry: one `ViTConfig` row per variant, read by factories, loaders and the CLI.

Pure Python (no TensorFlow or Keras import), so `keras_vit.list_models()` and `keras-vit models`
are instant. Adding a variant is one row in `VARIANTS`; its factory (`keras_vit.<name>`) is
generated from the row (`keras_vit.models.vit`), and a published checkpoint is one row of
`weights/catalog.json`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from keras_vit.utils import validation

__all__ = [
    "NUMERICS",
    "POOLINGS",
    "VARIANTS",
    "Numerics",
    "SHAPE_FIELDS",
    "WIDTHS",
    "ViTConfig",
    "architecture",
    "config_of",
    "get_config",
    "list_models",
    "model_config",
    "variant_for",
]

POOLINGS = ("token", "gap", "map", None)


@dataclass(frozen=True)
class Numerics:
    """The small numerical choices on which the reference implementations differ.

    Each changes logits by ~1e-5 to ~1e-3 on the same weights, so exact parity with a
    checkpoint's own code needs its values: `approximate_gelu` (the MLP's GELU: the tanh
    approximation, Flax's `nn.gelu`, or exact erf), `layer_norm_epsilon` (every LayerNorm),
    and for hybrids the weight standardisation, `(w - mean) / sqrt(var + eps)`
    (`std_conv_epsilon_mode="variance"`) or `(w - mean) / (std + eps)` (`"std"`), and the
    GroupNorm epsilon.
    """

    approximate_gelu: bool
    layer_norm_epsilon: float
    std_conv_epsilon: float
    std_conv_epsilon_mode: str
    group_norm_epsilon: float


# `ViTConfig.numerics` -> what the model computes with. The loaders pick the checkpoint source's.
NUMERICS: dict[str, Numerics] = {
    # timm: exact GELU, LayerNorm eps 1e-6; `StdConv2dSame(eps=1e-8)`, `GroupNormAct` eps 1e-5.
    "timm": Numerics(False, 1e-6, 1e-8, "variance", 1e-5),
    # The original JAX code (vision_transformer models_vit.py / models_resnet.py, big_vision):
    # `nn.gelu` (tanh), Flax LayerNorm and GroupNorm eps 1e-6, `weight_standardize(eps=1e-5)`.
    "jax": Numerics(True, 1e-6, 1e-5, "std", 1e-6),
    # transformers ViT: exact GELU (`hidden_act="gelu"`), `layer_norm_eps` 1e-12 (its default and
    # the value in every google/vit-* config.json); its BiT stem (`modeling_bit`) has timm's epsilons.
    "hf": Numerics(False, 1e-12, 1e-8, "variance", 1e-5),
}


def image_hw(image_size: int | Sequence[int]) -> tuple[int, int]:
    """`(height, width)` of an int or a pair (`keras_vit.utils.validation.image_size`), with a clear error."""
    return validation.image_size("image_size", image_size)


@dataclass(frozen=True)
class ViTConfig:
    """Architecture of a ViT (paper Table 1; Ti and S from the AugReg configs), as its model carries it.

    `patch_size` is the patch on the Transformer's input: the image for plain models, the
    ResNet feature map for hybrids (`resnet_stages` set: BiT units per stage, `()` = stem only).
    `image_size` is the input resolution (int, or `(height, width)`); `pooling` how the
    classifier reads the tokens: `"token"` (the [class] token), `"gap"` (mean of the patch
    tokens), `"map"` (multihead attention pooling of the patch tokens by a learned probe:
    big_vision's `MAPHead`, timm's `global_pool="map"`) or `None` (the token sequence is the
    output); `class_token` whether a [class] token is prepended (`False`: the paper's
    Appendix D.3 GAP model, big_vision's `pool_type="gap"`/`"map"`, then pooling `"gap"` or
    `"map"`). `fc_norm` puts the final LayerNorm after the `"gap"` pooling instead of before
    (timm's `fc_norm`, its default for `global_pool="avg"`). `numerics` names the reference
    whose numerics the model computes with (`NUMERICS`: GELU form, LayerNorm and hybrid-stem
    epsilons): `"timm"` (the default for new models), `"jax"` (the original code: what the
    loaders pick for Google `.npz` files) or `"hf"` (transformers).
    """

    name: str
    patch_size: int
    hidden_size: int
    depth: int
    num_heads: int
    mlp_dim: int
    resnet_stages: tuple[int, ...] | None = None
    image_size: int | tuple[int, int] = 224
    numerics: str = "timm"
    pooling: str | None = "token"
    class_token: bool = True
    fc_norm: bool = False

    def __post_init__(self):
        for field in ("patch_size", "hidden_size", "depth", "num_heads", "mlp_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {field} must be a positive int, got {value!r}.")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"{self.name}: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}."
            )
        height, width = image_hw(self.image_size)
        object.__setattr__(self, "image_size", height if height == width else (height, width))
        if self.resnet_stages is not None:
            object.__setattr__(self, "resnet_stages", tuple(int(units) for units in self.resnet_stages))
        if self.pooling not in POOLINGS:
            raise ValueError(
                f"Unknown pooling {self.pooling!r}: use 'token' (the [class] token), 'gap' (mean of the "
                "patch tokens), 'map' (attention pooling of the patch tokens), or None (the token "
                "sequence, with include_top=False)."
            )
        if self.pooling == "token" and not self.class_token:
            raise ValueError(
                f"{self.name}: pooling='token' reads the [class] token, but class_token=False: "
                "use pooling='gap' or 'map' for a model without a [class] token."
            )
        if self.fc_norm and self.pooling != "gap":
            raise ValueError(
                f"{self.name}: fc_norm=True normalises the average of the patch tokens (timm's "
                f"global_pool='avg'): it needs pooling='gap', got pooling={self.pooling!r}."
            )
        if self.numerics not in NUMERICS:
            raise ValueError(
                f"{self.name}: unknown numerics {self.numerics!r}; use one of {sorted(NUMERICS)}."
            )

    @property
    def is_hybrid(self) -> bool:
        return self.resnet_stages is not None

    @property
    def stride(self) -> int:
        """Pixels per token side: the patch, times the ResNet's downsampling for hybrids."""
        if not self.is_hybrid:
            return self.patch_size
        return self.patch_size * 4 * 2 ** max(len(self.resnet_stages) - 1, 0)

    @property
    def image_hw(self) -> tuple[int, int]:
        return image_hw(self.image_size)

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patch tokens: the [class] token, if any."""
        return int(self.class_token)

    def feature_map_size(self, height: int, width: int) -> tuple[int, int]:
        """What the patch embedding sees: the image, or a hybrid's ResNet map (each stride 2: ceil(n/2))."""
        if not self.is_hybrid:
            return height, width
        for _ in range(2 + max(len(self.resnet_stages) - 1, 0)):  # conv_root, max-pool, stages 2..
            height, width = -(-height // 2), -(-width // 2)
        return height, width

    @property
    def stem_units(self) -> list[tuple[int, int]]:
        """`(stage, unit)` of every bottleneck unit of a hybrid's ResNet stem, both from 1, in order."""
        return [
            (stage, unit)
            for stage, units in enumerate(self.resnet_stages or (), 1)
            for unit in range(1, units + 1)
        ]

    def token_grid(self, image_size: int | Sequence[int] | None = None) -> tuple[int, int]:
        """The patch grid for `image_size` (default the config's), with an error proposing valid sizes."""
        height, width = image_hw(self.image_size if image_size is None else image_size)
        feature_hw = self.feature_map_size(height, width)
        for axis, image_side, size in zip(("height", "width"), (height, width), feature_hw, strict=True):
            if size % self.patch_size:
                lower = max(self.stride, image_side // self.stride * self.stride)
                feature_map = f" (ResNet feature map {size})" if self.is_hybrid else ""
                raise ValueError(
                    f"{self.name}: image {axis} {image_side}{feature_map} is not divisible by the patch "
                    f"size {self.patch_size}; use a multiple of {self.stride}, e.g. image_size={lower} or "
                    f"{lower + self.stride}."
                )
        return feature_hw[0] // self.patch_size, feature_hw[1] // self.patch_size

    @property
    def description(self) -> str:
        """One line for docstrings and `keras-vit models`."""
        width = f"D={self.hidden_size}, {self.depth} layers, {self.num_heads} heads, MLP {self.mlp_dim}"
        if not self.is_hybrid:
            return f"ViT/{self.patch_size}: {width}, {self.image_hw[0]} px"
        stages = f"ResNet stages {self.resnet_stages}" if self.resnet_stages else "ResNet root block only"
        return (
            f"hybrid: BiT {stages}, then ViT ({width}) on {self.patch_size}x{self.patch_size} patches "
            f"of the feature map ({self.stride} px per token)"
        )

    def replace(self, **changes) -> ViTConfig:
        """A copy with fields changed; unknown field names are an error that lists the fields."""
        unknown = sorted(set(changes) - {field.name for field in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"Unknown ViTConfig field(s) {unknown}: fields are {self.field_names()}.")
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> list[str]:
        return [field.name for field in dataclasses.fields(cls)]

    def to_dict(self) -> dict:
        """JSON-friendly fields (tuples as lists), the inverse of `from_dict`."""
        fields = dataclasses.asdict(self)
        return {key: list(value) if isinstance(value, tuple) else value for key, value in fields.items()}

    @classmethod
    def from_dict(cls, fields: dict) -> ViTConfig:
        """The inverse of `to_dict`; configs saved before `numerics` existed name `stem_numerics`."""
        fields = dict(fields)
        if "stem_numerics" in fields:
            fields.setdefault("numerics", fields.pop("stem_numerics"))
        return cls(**fields)


# width name -> (hidden_size, depth, num_heads, mlp_dim)
WIDTHS = {
    "ti": (192, 12, 3, 768),
    "s": (384, 12, 6, 1536),
    "b": (768, 12, 12, 3072),
    "l": (1024, 24, 16, 4096),
    "h": (1280, 32, 16, 5120),
}


def _plain(width: str, patch: int) -> ViTConfig:
    return ViTConfig(f"vit_{width}{patch}", patch, *WIDTHS[width])


VARIANTS: dict[str, ViTConfig] = {
    config.name: config
    for config in (
        _plain("ti", 16),
        _plain("s", 16),
        _plain("s", 32),
        _plain("s", 8),
        _plain("b", 8),
        _plain("b", 16),
        _plain("b", 32),
        _plain("l", 16),
        _plain("l", 32),
        _plain("h", 14),
        # Hybrids (paper §3.1): ViT on 1x1 patches of a BiT ResNet feature map (8x8 for r_ti16).
        ViTConfig("vit_r50_b16", 1, *WIDTHS["b"], resnet_stages=(3, 4, 9)),
        ViTConfig("vit_r50_l32", 1, *WIDTHS["l"], resnet_stages=(3, 4, 6, 3)),
        ViTConfig("vit_r26_b32", 1, *WIDTHS["b"], resnet_stages=(2, 2, 2, 2)),
        ViTConfig("vit_r26_s32", 1, *WIDTHS["s"], resnet_stages=(2, 2, 2, 2)),
        ViTConfig("vit_r_ti16", 8, *WIDTHS["ti"], resnet_stages=()),
        # A ViT small enough to train on a CPU: the main job's model (8x8 digits upscaled to
        # 32 px, patches of 4 px: 64 tokens).
        ViTConfig("vit_digits", 4, 64, 4, 4, 128, image_size=32),
    )
}


def get_config(name: str) -> ViTConfig:
    """The config of variant `name`; a clear error lists the known names otherwise."""
    try:
        return VARIANTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"Unknown ViT variant {name!r}; known variants: {sorted(VARIANTS)}.") from None


def list_models() -> list[str]:
    """Names of every registered variant (each has a factory `keras_vit.<name>`), e.g. `['vit_b16', ...]`."""
    return sorted(VARIANTS)


# The fields that make an architecture: a checkpoint fits a model when these agree.
SHAPE_FIELDS = ("hidden_size", "depth", "num_heads", "mlp_dim", "patch_size", "resnet_stages")


def architecture(source) -> dict[str, object]:
    """The shape of a config's or checkpoint's Transformer (and hybrid ResNet): its `SHAPE_FIELDS`."""
    return {field: getattr(source, field) for field in SHAPE_FIELDS}


def variant_for(source, prefer: str | None = None) -> str | None:
    """The registry variant with the architecture of `source` (a `ViTConfig`, a `CheckpointInfo`), or `None`.

    `prefer` (e.g. the model's own variant name) is taken if it has that architecture; else the
    one variant that has it (`None` if none does, or several do).
    """
    shape = architecture(source)
    if prefer in VARIANTS and architecture(VARIANTS[prefer]) == shape:
        return prefer
    matches = [name for name, config in VARIANTS.items() if architecture(config) == shape]
    return matches[0] if len(matches) == 1 else None


def config_of(model) -> ViTConfig:
    """The `ViTConfig` a keras_vit model carries; a clear error for any other object."""
    config = getattr(model, "config", None)
    if not isinstance(config, ViTConfig):
        raise ValueError(
            f"Model {getattr(model, 'name', model)!r} is a {type(model).__name__}, not a keras_vit.ViT: "
            "build it with keras_vit.create_model / build_vit (for a model that wraps a ViT, pass the "
            "inner ViT, e.g. `outer.get_layer('vit_b16')`)."
        )
    return config


def model_config(model: str | ViTConfig, **overrides) -> ViTConfig:
    """The architecture `model` (a registry name such as `"vit_digits"`, or a config) with fields replaced.

    `overrides` are `ViTConfig` fields (`patch_size`, `hidden_size`, `depth`, `num_heads`,
    `mlp_dim`, `image_size`); `None` values are ignored. Changing any gives a custom model
    named `<model>_custom`.
    """
    config = model if isinstance(model, ViTConfig) else None
    if config is None:
        if model not in VARIANTS:
            raise ValueError(f"Unknown model {model!r}: use one of {list_models()} (see `keras-vit models`).")
        config = VARIANTS[model]
    overrides = {key: value for key, value in overrides.items() if value is not None}
    if overrides and any(getattr(config, key) != value for key, value in overrides.items()):
        config = config.replace(name=f"{config.name}_custom", **overrides)
    return config
