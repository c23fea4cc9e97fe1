"""The training recipes, each declared once: optimizer, schedule, regularisation and their defaults.

A `Recipe` says how a run trains when the user does not: which optimizer (`"adamw"`: AdamW
with decoupled weight decay on kernels; `"sgd"`: SGD momentum 0.9, no weight decay), the peak
learning rate, the cap of the linear warm-up (`WARMUP_FRACTION` of the steps, at most the cap),
the decay, weight decay, stochastic depth, mixup and the default length. Every one of these is
a run option too (`keras_vit.training.options`): a value given there wins, `None` takes the recipe's.

* `FROM_SCRATCH` (`"pretrain"`, `keras-vit train`): AdamW + warm-up + cosine, the paper's
  pre-training optimizer with its ImageNet-1k learning rate, and the small-data
  regularisation of DeiT and AugReg (stochastic depth, mixup): the digits main job's recipe.
* `FINE_TUNING` (`"finetune"`, `keras-vit finetune`): the paper's fine-tuning recipe
  (App. B.1.1), SGD momentum + warm-up + cosine from a checkpoint, no regularisation.
* `MASKED_PATCH_PREDICTION` (`keras-vit pretrain`): the paper's self-supervised setting
  (App. B.1.2), Adam at 2e-4 + warm-up + cosine.

This module imports nothing heavy, so the command line's help shows the recipes' values. The
Keras objects the recipes build (`WarmupDecay`, `pretraining_optimizer`,
`finetuning_optimizer`, `loss`, `LabelAccuracy`, ...) live in `keras_vit.training.optimization` and are
reachable here under their old names too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import keras

__all__ = [
    "FINE_TUNING",
    "FROM_SCRATCH",
    "MASKED_PATCH_PREDICTION",
    "OPTIMIZERS",
    "RECIPES",
    "WARMUP_FRACTION",
    "Recipe",
    "get_recipe",
]

OPTIMIZERS = ("adamw", "sgd")
WARMUP_FRACTION = 0.1  # the default warm-up: this share of the steps, at most the recipe's cap


class OptimizerOptions(Protocol):
    """The run options a recipe's optimizer reads (`keras_vit.training.options.RunOptions` has them): `None`
    takes the recipe's value."""

    learning_rate: float | None
    warmup_steps: int | None
    weight_decay: float | None


@dataclass(frozen=True)
class Recipe:
    """One training recipe: its optimizer and the defaults of the values a run may set itself."""

    name: str  # as given to `train(recipe=...)` and recorded in report.json
    description: str  # the optimizer and schedule in words, for reports
    optimizer: str  # one of OPTIMIZERS
    learning_rate: float  # peak, reached after the warm-up
    warmup_cap: int  # the default warm-up's longest length, in steps
    weight_decay: float = 0.0  # decoupled, kernels only ("adamw"; "sgd" has none)
    drop_path_rate: float = 0.0  # stochastic depth of the classifier built for the run
    mixup_alpha: float = 0.0  # mixup's Beta(alpha, alpha); 0: off
    epochs: float = 100  # passes over the training data when neither steps nor epochs is given
    decay: str = "cosine"  # after the warm-up, to 0 at the last step

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"Recipe {self.name!r}: optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}."
            )

    @property
    def has_weight_decay(self) -> bool:
        return self.optimizer == "adamw"

    def check_weight_decay(self, weight_decay: float | None) -> None:
        """Refuse a weight decay this recipe's optimizer has no place for (SGD: none)."""
        if weight_decay and not self.has_weight_decay:
            raise ValueError(
                f"weight_decay={weight_decay!r}: the {self.name!r} recipe ({self.optimizer}) has no weight "
                "decay; leave it unset (or 0)."
            )

    def warmup_steps(self, requested: int | None, total_steps: int) -> int:
        """The warm-up length: as requested, else `WARMUP_FRACTION` of the steps, at most the cap."""
        if requested is not None:
            return requested
        return min(self.warmup_cap, int(total_steps * WARMUP_FRACTION))

    def schedule(
        self,
        total_steps: int,
        *,
        learning_rate: float | None = None,
        warmup_steps: int | None = None,
        weight_decay: float | None = None,
    ) -> dict:
        """The optimizer values a run uses: each as given, else the recipe's."""
        self.check_weight_decay(weight_decay)
        values = {
            "learning_rate": self.learning_rate if learning_rate is None else learning_rate,
            "warmup_steps": self.warmup_steps(warmup_steps, total_steps),
            "decay": self.decay,
        }
        if self.has_weight_decay:
            values["weight_decay"] = self.weight_decay if weight_decay is None else weight_decay
        return values

    def build_optimizer(
        self, total_steps: int, schedule: dict, ema_momentum: float | None = None
    ) -> keras.optimizers.Optimizer:
        """The Keras optimizer of this recipe with the values of `schedule` (see `Recipe.schedule`)."""
        from keras_vit.training import optimization

        if self.optimizer == "adamw":
            return optimization.pretraining_optimizer(total_steps, ema_momentum=ema_momentum, **schedule)
        values = {key: value for key, value in schedule.items() if key != "decay"}
        return optimization.finetuning_optimizer(total_steps, ema_momentum=ema_momentum, **values)

    def run_optimizer(
        self, total_steps: int, options: OptimizerOptions, ema_momentum: float | None = None
    ) -> tuple[dict, keras.optimizers.Optimizer]:
        """A run's `(schedule, optimizer)`: the `schedule` of `options`' learning rate, warm-up and
        weight decay (each the recipe's where `None`) and the optimizer built from it; what every
        task's `compile` uses (`keras_vit.training.runs.Task`)."""
        schedule = self.schedule(
            total_steps,
            learning_rate=options.learning_rate,
            warmup_steps=options.warmup_steps,
            weight_decay=options.weight_decay,
        )
        return schedule, self.build_optimizer(total_steps, schedule, ema_momentum)


FROM_SCRATCH = Recipe(
    name="pretrain",
    description="AdamW (weight decay on kernels), warm-up + cosine decay: the paper's pre-training recipe",
    optimizer="adamw",
    learning_rate=3e-3,  # the paper's ImageNet-1k value
    warmup_cap=10_000,
    weight_decay=0.05,
    drop_path_rate=0.1,  # DeiT's and AugReg's small-data regularisation
    mixup_alpha=0.2,  # DeiT's, lighter
    epochs=100,
)
FINE_TUNING = Recipe(
    name="finetune",
    description="SGD momentum 0.9, warm-up + cosine decay, no weight decay: the paper's fine-tuning recipe",
    optimizer="sgd",
    learning_rate=0.01,  # the middle of the paper's sweep {0.001, 0.003, 0.01, 0.03}
    warmup_cap=500,  # the reference code's warm-up
    epochs=100,
)
MASKED_PATCH_PREDICTION = Recipe(
    name="masked_patch_prediction",
    description="masked patch prediction (paper §4.6); Adam, warm-up + cosine",
    optimizer="adamw",  # with weight decay 0: Adam
    learning_rate=2e-4,  # the paper's (App. B.1.2)
    warmup_cap=10_000,
    weight_decay=0.0,
    epochs=50,
)
# The recipes `train(recipe=...)` takes, by name; masked patch prediction is `keras_vit.training.pretrain`'s.
RECIPES = {recipe.name: recipe for recipe in (FROM_SCRATCH, FINE_TUNING)}


def get_recipe(recipe: str | Recipe) -> Recipe:
    """A `Recipe`, or the one of `RECIPES` with this name."""
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(
            f"recipe must be one of {', '.join(map(repr, RECIPES))} or a Recipe; got {recipe!r}."
        )
    return RECIPES[recipe]
