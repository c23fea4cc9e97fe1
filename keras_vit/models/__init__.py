"""The model: its Keras layers (`layers`, `attention`), the hybrids' ResNet stem (`hybrid`), the `ViT`
class (`vit`, with its input checks in `guards`), building with or without a checkpoint: `build_vit`,
`create_model`, one factory per variant (`build`), and the layout map of each model family for
`keras.distribution` (`parallel`). Names load on first use."""

from keras_vit.utils.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ViT": "vit",
        "build_vit": "build",
        "build_with_checkpoint": "build",
        "create_model": "build",
        "get_layout_map": "parallel",
        "make_distribution": "parallel",
    },
    submodules=("attention", "build", "guards", "hybrid", "layers", "parallel", "vit"),
)
