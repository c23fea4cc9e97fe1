"""Training: the run options declared once (`options`), the paper's recipes as data (`recipes`) and the
Keras objects they build (`optimization`), the classification task with `train` / `finetune`
(`classification`), masked patch pre-training (`pretrain`, its model `masked_patch`), and the one run
driver with its backups, reports and distribution (`runs`). Names load on first use, so the CLI reads
`options` without importing Keras."""

from keras_vit.utils.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {"train": "classification", "finetune": "classification"},
    submodules=("classification", "masked_patch", "optimization", "options", "pretrain", "recipes", "runs"),
)
