"""One small config per ViT variant, and the registry that factories and loaders look up."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ViTConfig:
    """Architecture of one variant (paper Table 1; Ti and S from the AugReg configs).

    `patch_size` is the patch on the Transformer's input: the image for plain models, the
    ResNet feature map for hybrids (`resnet_stages` set: BiT units per stage, `()` = stem only).
    `stem_numerics` picks the hybrid stem's epsilons: `"timm"` or `"jax"` (see `keras_vit.hybrid`).
    """

    name: str
    patch_size: int
    hidden_size: int
    depth: int
    num_heads: int
    mlp_dim: int
    resnet_stages: tuple[int, ...] | None = None
    image_size: int = 224
    stem_numerics: str = "timm"

    @property
    def is_hybrid(self) -> bool:
        return self.resnet_stages is not None

    @property
    def stride(self) -> int:
        """Pixels per token side: the patch, times the ResNet's downsampling for hybrids."""
        if not self.is_hybrid:
            return self.patch_size
        return self.patch_size * 4 * 2 ** max(len(self.resnet_stages) - 1, 0)


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
    )
}


def get_config(name: str) -> ViTConfig:
    """The config of variant `name`; a clear error lists the known names otherwise."""
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"Unknown ViT variant {name!r}; known variants: {sorted(VARIANTS)}.") from None
