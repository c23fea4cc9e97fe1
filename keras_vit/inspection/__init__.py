"""Looking inside a model: attention maps, rollout, attention distance, position-embedding similarity
and embedding filters (`analysis`), their pictures (`plots`) and accuracy on a dataset (`evaluate`).
Names load on first use."""

from keras_vit.utils.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__, {}, submodules=("analysis", "evaluate", "plots"), forward="analysis"
)
