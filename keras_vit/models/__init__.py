"""The model: its Keras layers (`layers`), the hybrids' ResNet stem (`hybrid`), the `ViT` class with
`build_vit` / `create_model` / one factory per variant (`vit`) and the layout map of each model family
for `keras.distribution` (`parallel`). Names load on first use."""

from keras_vit.utils.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ViT": "vit",
        "build_vit": "vit",
        "build_with_checkpoint": "vit",
        "create_model": "vit",
        "get_layout_map": "parallel",
        "make_distribution": "parallel",
    },
    submodules=("hybrid", "layers", "parallel", "vit"),
)
