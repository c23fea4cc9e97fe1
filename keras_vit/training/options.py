"""Run options: the arguments of every training run, each declared once with its default, help and check.

`RunOptions` holds what every run shares (data, length, optimisation, precision, strategy,
output); `ClassifierOptions` adds supervised training's (`keras_vit.training.train`,
`finetune`), `MaskedPatchOptions` masked patch prediction's (`keras_vit.training.pretrain.pretrain`).
Each field is declared with `option(...)`: its default, its help text, its check (a
`keras_vit.utils.validation` validator with its bounds), its command-line flag and its help group.
From these:

* `train`, `finetune` and `pretrain` take the options as keyword arguments
  (`takes_options` gives them the generated signature and docstring), check them all
  (`RunOptions.check`) before anything runs, and hand one object to the driver;
* `keras-vit train|finetune|pretrain` generate their flags and help
  (`keras_vit.cli.parser.add_options`).

A default of `None` means "the recipe's" (`keras_vit.training.recipes`: learning rate, weight decay,
stochastic depth, mixup, length) or "the data's" (augmentation: `keras_vit.data.tfdata.Source`). Help
texts may name the recipe's value as `{recipe.learning_rate:g}`. Pure Python: the command line
reads this module before it imports a backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keras_vit.training.recipes import WARMUP_FRACTION, Recipe
from keras_vit.utils import defaults
from keras_vit.utils import validation as check
from keras_vit.utils.environment import keras_backend

__all__ = [
    "ClassifierOptions",
    "MaskedPatchOptions",
    "Option",
    "Processes",
    "RunOptions",
    "option",
    "help_context",
    "option_fields",
    "takes_options",
]


@dataclass(frozen=True)
class Option:
    """How one run option is checked and offered on the command line (a dataclass field's metadata)."""

    help: str  # may name the recipe's values: "{recipe.learning_rate:g}"
    group: str  # the command's help section: data, model, optimisation, run, task
    validator: Callable | None = None  # keras_vit.utils.validation-style: (name, value, **bounds) -> value
    bounds: tuple[tuple[str, Any], ...] = ()  # keyword arguments of the validator
    choices: tuple | None = None  # the values allowed (checked with validation.one_of)
    parse: Callable[[str], Any] | None = None  # command-line text -> value (default: the validator's kind)
    flag: str | None = None  # default: --name-with-dashes
    aliases: tuple[str, ...] = ()
    metavar: str | tuple[str, ...] | None = None
    nargs: int | None = None
    exclusive: str | None = None  # options in the same exclusive set cannot be given together
    switch: bool = False  # a yes/no flag: --name / --no-name

    def check(self, name: str, value, default) -> None:
        """`ValueError` naming `name` unless `value` is allowed (`None` is, where it is the default).

        `choices` apply to plain values; an object (a `tf.distribute.Strategy`) goes to the validator.
        """
        if value is None and default is None:
            return
        if self.choices is not None and isinstance(value, (str, int, float)):
            check.one_of(name, value, self.choices)
        if self.validator is not None:
            self.validator(name, value, **dict(self.bounds))

    def help_text(self, context: dict) -> str:
        """The help with the recipe's values filled in (`context`: see `help_context`)."""
        return self.help.format(**context)

    def flags(self, name: str) -> list[str]:
        return [self.flag or "--" + name.replace("_", "-"), *self.aliases]


def option(
    default, help: str, group: str, validator: Callable | None = None, **settings
) -> dataclasses.Field:
    """A run option: a dataclass field with its default and its `Option` (help, check, flag, group).

    Keyword arguments the `Option` does not name are the validator's bounds (`minimum=0`).
    """
    own = {field.name for field in dataclasses.fields(Option)}
    bounds = tuple((key, settings.pop(key)) for key in list(settings) if key not in own)
    spec = Option(help=help, group=group, validator=validator, bounds=bounds, **settings)
    return dataclasses.field(default=default, metadata={"option": spec})


def option_fields(options_class: type) -> list[tuple[dataclasses.Field, Option]]:
    """The fields of an options class with their `Option`, in declaration order."""
    return [(field, field.metadata["option"]) for field in dataclasses.fields(options_class)]


def _on_off_auto(text: str) -> bool | str:
    """`--jit-compile on|off|auto` as True, False or "auto"."""
    values = {"on": True, "off": False, "auto": "auto"}
    if text not in values:
        raise argparse.ArgumentTypeError(f"expected auto, on or off, got {text!r}")
    return values[text]


def _jit_compile(name: str, value) -> None:
    if isinstance(value, str) and value != "auto" or value not in defaults.JIT_CHOICES:
        raise ValueError(f"{name} must be True, False or 'auto', got {value!r}.")


def checkpoint_flag(text: str) -> bool | str:
    """`--pretrained`: true / false (also default, none, random), else a tag, file or repo id."""
    lowered = text.lower()
    if lowered in ("true", "default"):
        return True
    if lowered in ("false", "none", "random"):
        return False
    return text


def _int_or_auto(text: str) -> int | str:
    """`--verbose`: "auto" or an int (its choices are checked by argparse)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or an integer, got {text!r}") from None


def _positive_int_or_auto(name: str, value) -> int | str:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"{name} must be a positive int or 'auto', got {value!r}.")


def _steps_per_execution(text: str) -> int | str:
    """`--steps-per-execution`: "auto" or a positive int."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive integer, got {text!r}")
    return value


# A host name, an IPv4 address, or an IPv6 address in brackets: no scheme (http://), path or user.
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")


def _job_addresses(name: str, value) -> str:
    """`HOST:PORT` (or Keras's comma-separated list of them, process 0's first), the port in 1..65535."""
    for address in value.split(",") if isinstance(value, str) else [value]:
        host, _, port = address.strip().rpartition(":") if isinstance(address, str) else ("", "", "")
        if not (_HOST.fullmatch(host) and port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(
                f"{name} must be process 0's address as HOST:PORT with a port in 1..65535 (e.g. "
                f"10.0.0.1:1234, or localhost:1234 on one machine), got {value!r}."
            )
    return value


# The environment variables `keras.distribution.initialize` reads, by the option that overrides each.
PROCESS_VARIABLES = {
    "coordinator": "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "num_processes": "KERAS_DISTRIBUTION_NUM_PROCESSES",
    "process_id": "KERAS_DISTRIBUTION_PROCESS_ID",
}


@dataclass(frozen=True)
class Processes:
    """A multi-process JAX run: `keras.distribution.initialize`'s arguments (`RunOptions.processes`)."""

    job_addresses: str  # process 0's HOST:PORT (the coordinator), or Keras's comma-separated list
    num_processes: int
    process_id: int


@dataclass(kw_only=True)
class RunOptions:
    """What every training run takes (`train`, `finetune`, `pretrain`; the `keras-vit` training commands)."""

    # data
    data_dir: str | None = option(None, "tensorflow-datasets data_dir", "data")
    train_split: str = option("train", "the tensorflow-datasets split trained on", "data")
    image_size: int | None = option(
        None,
        "training resolution (default: the model's or the checkpoint's)",
        "data",
        check.image_size,
        parse=int,
    )
    crop_scale: tuple[float, float] | None = option(
        None,
        "inception crop area range (default: the data's: 0.7 1 for digits, 0.08 1 otherwise)",
        "data",
        check.crop_scale,
        parse=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
    )
    flip: bool | None = option(
        None,
        "random horizontal flips (default: the data's: off for digits, on otherwise)",
        "data",
        switch=True,
    )
    on_bad_image: str = option(
        defaults.BAD_IMAGE_ACTIONS[0],
        "an image folder's unreadable files: stop naming them (default), or skip them with a warning",
        "data",
        choices=defaults.BAD_IMAGE_ACTIONS,
    )
    # optimisation
    batch_size: int = option(64, "global batch, split across replicas", "optimisation", check.positive_int)
    steps: int | None = option(
        None, "training length in steps", "optimisation", check.positive_int, exclusive="length"
    )
    epochs: float | None = option(
        None,
        "passes over the training data (default {recipe.epochs:g})",
        "optimisation",
        check.positive_number,
        exclusive="length",
    )
    steps_per_epoch: int | None = option(
        None,
        "steps between backups and log lines (default: one pass, at most 1000)",
        "optimisation",
        check.positive_int,
    )
    learning_rate: float | None = option(
        None,
        "peak learning rate (default {recipe.learning_rate:g})",
        "optimisation",
        check.positive_number,
        aliases=("--lr",),
    )
    warmup_steps: int | None = option(
        None,
        "linear warm-up (default: {warmup_fraction:.0%} of the steps, at most {recipe.warmup_cap})",
        "optimisation",
        check.non_negative_int,
    )
    weight_decay: float | None = option(
        None,
        "decoupled weight decay on kernels, AdamW recipes only (default {recipe.weight_decay:g})",
        "optimisation",
        check.number,
        minimum=0.0,
    )
    # model
    dropout: float = option(0.0, "dropout rate", "model", check.fraction)
    # run
    output_dir: str = option(
        "vit_run",
        "{saved_file}, report.json, logs/ and, while unfinished, backup/",
        "run",
        check.output_folder,
        parse=str,
    )
    overwrite: bool = option(
        False,
        "replace a finished run's {saved_file}, report.json and logs in the output folder, or discard an "
        "unfinished run's backup made with other arguments (the folder's other files are kept)",
        "run",
        choices=(False, True),
        switch=True,
    )
    strategy: Any = option(
        defaults.STRATEGIES[0],
        "tf.distribute strategy (keras_vit.training.runs.distribute.get_strategy), or a strategy object",
        "run",
        choices=defaults.STRATEGIES,
    )
    model_parallel: int = option(
        1,
        "JAX: shard each model replica over N devices (Megatron-style attention and MLP kernels, "
        "keras_vit.models.parallel.get_layout_map), data parallel over the rest; 1: data parallel only",
        "run",
        check.positive_int,
    )
    coordinator: str | None = option(
        None,
        "JAX multi-process run: process 0's HOST:PORT, the same in every process (default "
        "$KERAS_DISTRIBUTION_JOB_ADDRESSES; unset: one process)",
        "run",
        _job_addresses,
        parse=str,
        metavar="HOST:PORT",
    )
    num_processes: int | None = option(
        None,
        "JAX multi-process run: how many processes (default $KERAS_DISTRIBUTION_NUM_PROCESSES)",
        "run",
        check.positive_int,
    )
    process_id: int | None = option(
        None,
        "JAX multi-process run: this process's index, 0 (writes the run's files) to N-1 "
        "(default $KERAS_DISTRIBUTION_PROCESS_ID)",
        "run",
        check.non_negative_int,
    )
    join_timeout: float = option(
        30.0,
        "JAX multi-process run: seconds the processes wait for each other to start (and for a lost one "
        "before the others stop); every process must be given the same arguments",
        "run",
        check.positive_number,
        parse=float,
        metavar="SECONDS",
    )
    precision: str = option(
        defaults.PRECISIONS[0],
        "float32, or mixed precision (mixed_float16 is loss-scaled)",
        "run",
        choices=defaults.PRECISIONS,
    )
    jit_compile: bool | str = option(
        defaults.JIT_CHOICES[0],
        "XLA-compile the train and evaluation steps (auto: on for a single replica; on PyTorch, on "
        "compiles the ViT's forward pass with torch.compile, auto is off)",
        "run",
        _jit_compile,
        parse=_on_off_auto,
        metavar="{auto,on,off}",
    )
    steps_per_execution: int | str = option(
        "auto",
        "train steps per call into the backend (auto: the largest divisor of the epoch up to "
        f"{defaults.STEPS_PER_EXECUTION_CAP}); the results are the same for any value",
        "run",
        _positive_int_or_auto,
        parse=_steps_per_execution,
    )
    seed: int = option(0, "initialisation, data order and augmentation", "run", check.non_negative_int)
    verbose: int | str = option(
        "auto",
        "fit's verbosity (auto: a progress bar on a terminal, a line per epoch otherwise)",
        "run",
        choices=("auto", 0, 1, 2),
        parse=_int_or_auto,
    )

    def check(self) -> RunOptions:
        """Check every option (`ValueError` naming the first bad one); `self` if all are good."""
        for field, spec in option_fields(type(self)):
            spec.check(field.name, getattr(self, field.name), field.default)
        if self.steps is not None and self.epochs is not None:
            raise ValueError("Give the training length as steps or as epochs, not both.")
        self.processes()
        return self

    def processes(self) -> Processes | None:
        """The multi-process run asked for, or `None` for one process.

        `coordinator`, `num_processes` and `process_id` (each else its
        `KERAS_DISTRIBUTION_*` variable, `PROCESS_VARIABLES`) go together: given one, all three
        are needed, `process_id` must be below `num_processes`, and Keras must run on JAX (the one
        backend `keras.distribution.initialize` is implemented on). `ValueError` says what is wrong.
        """
        given = {}
        for name, variable in PROCESS_VARIABLES.items():
            value, flag = getattr(self, name), "--" + name.replace("_", "-")
            if value is None and os.environ.get(variable):
                value, flag = os.environ[variable], f"${variable}"
                if name != "coordinator":
                    try:
                        value = int(value)
                    except ValueError:
                        raise ValueError(f"{variable} must be an integer, got {value!r}.") from None
            if value is not None:
                given[name] = (value, flag)
        if not given:
            return None
        backend = keras_backend()
        if backend != "jax":
            flags = ", ".join(flag for _, flag in given.values())
            instead = (
                " (on TensorFlow: TF_CONFIG and --strategy multi_worker)" if backend == "tensorflow" else ""
            )
            raise ValueError(
                f"A multi-process run ({flags}) needs the JAX backend (keras.distribution.initialize), but "
                f"Keras runs on {backend!r}: run every process with KERAS_BACKEND=jax{instead}."
            )
        missing = [name for name in PROCESS_VARIABLES if name not in given]
        if missing:
            flags = ", ".join("--" + name.replace("_", "-") for name in missing)
            variables = ", ".join(PROCESS_VARIABLES[name] for name in missing)
            raise ValueError(
                "A multi-process run needs --coordinator, --num-processes and --process-id together: "
                f"give {flags} too (or set {variables})."
            )
        (addresses, address_flag), (count, count_flag), (index, index_flag) = (
            given[name] for name in PROCESS_VARIABLES
        )
        _job_addresses(address_flag, addresses)
        check.positive_int(count_flag, count)
        check.non_negative_int(index_flag, index)
        if index >= count:
            raise ValueError(
                f"{index_flag} {index} is out of range for {count} processes: use 0 (process 0, which "
                f"writes the run's files) to {count - 1}."
            )
        return Processes(addresses, count, index)

    def arguments(self) -> dict:
        """The options by name (for reports and the exact-resume check)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


@dataclass(kw_only=True)
class ClassifierOptions(RunOptions):
    """`train` / `finetune`: supervised classification, evaluated on a held-out split."""

    test_split: str = option("test", "the tensorflow-datasets split evaluated at the end", "data")
    pretrained: Any = option(
        False,
        "checkpoint to start from: true (the variant's default), a catalog tag, a file or a hub repo id; "
        "or a keras_vit model or .keras file (e.g. a keras-vit pretrain backbone)",
        "model",
        parse=checkpoint_flag,
    )
    drop_path_rate: float | None = option(
        None,
        "stochastic depth rate (default {recipe.drop_path_rate:g})",
        "model",
        check.fraction,
        flag="--drop-path",
    )
    mixup_alpha: float | None = option(
        None,
        "mixup of each training batch with itself reversed, weight ~ Beta(alpha, alpha); 0: off "
        "(default {recipe.mixup_alpha:g})",
        "model",
        check.number,
        flag="--mixup",
        minimum=0.0,
    )
    label_smoothing: float = option(0.1, "label smoothing of the loss", "optimisation", check.fraction)
    ema_momentum: float | None = option(
        None,
        "Polyak averaging momentum, e.g. 0.9999: the averaged weights are evaluated and saved",
        "optimisation",
        check.number,
        flag="--ema",
        minimum=0.0,
        maximum=1.0,
        exclusive_minimum=True,
        exclusive_maximum=True,
    )


@dataclass(kw_only=True)
class MaskedPatchOptions(RunOptions):
    """`pretrain`: masked patch prediction on unlabeled images (`keras_vit.training.masked_patch`)."""

    output_dir: str = option(
        "vit_mpp",
        "{saved_file}, report.json, logs/ and, while unfinished, backup/",
        "run",
        check.output_folder,
        parse=str,
    )
    target: str = option(
        defaults.MPP_TARGETS[0],
        "3-bit mean colour (paper), 4x4 grid of 3-bit colours, or L2 on the patch pixels",
        "task",
        choices=defaults.MPP_TARGETS,
    )
    bits: int = option(
        defaults.MPP_BITS,
        "bits per channel of the colour targets",
        "task",
        check.integer,
        minimum=1,
        maximum=8,
    )
    corrupt_rate: float = option(
        defaults.MPP_CORRUPT_RATE,
        "share of patches corrupted per image",
        "task",
        check.number,
        minimum=0.0,
        maximum=1.0,
        exclusive_minimum=True,
    )
    mask_rate: float = option(
        defaults.MPP_MASK_RATE, "of those, share set to [mask]", "task", check.fraction, allow_one=True
    )
    random_rate: float = option(
        defaults.MPP_RANDOM_RATE,
        "of those, share set to another patch",
        "task",
        check.fraction,
        allow_one=True,
    )


def help_context(recipe: Recipe, saved_file: str) -> dict:
    """What help texts may name: the command's recipe, the file it saves, the default warm-up share."""
    return {"recipe": recipe, "saved_file": saved_file, "warmup_fraction": WARMUP_FRACTION}


def takes_options(
    options_class: type[RunOptions], recipe: Recipe, saved_file: str, **defaults_here
) -> Callable:
    """Give `function(..., options)` the run options as keyword arguments, with their defaults and help.

    The decorated function takes its own parameters plus every field of `options_class` as a
    keyword; they are gathered into one `options_class` passed as `options`. A caller may pass
    a whole `options=` object instead (keywords given beside it replace its fields). The
    signature and docstring list the options, generated from their declarations (help values
    from `recipe`, the function's default recipe); `defaults_here` changes a default for this
    function (e.g. `pretrained=True` for `finetune`).
    """
    fields = option_fields(options_class)
    names = {field.name for field, _ in fields}
    context = help_context(recipe, saved_file)

    def decorate(function: Callable) -> Callable:
        own = inspect.signature(function)
        kept = [parameter for name, parameter in own.parameters.items() if name != "options"]
        whole = inspect.Parameter(
            "options",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=f"{options_class.__name__} | None",
        )
        generated = [
            inspect.Parameter(
                field.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=defaults_here.get(field.name, field.default),
                annotation=field.type,
            )
            for field, _ in fields
        ]

        @functools.wraps(function)
        def with_options(*args, options: RunOptions | None = None, **kwargs):
            given = {key: kwargs.pop(key) for key in list(kwargs) if key in names}
            if options is None:
                options = options_class(**{**defaults_here, **given})
            elif not isinstance(options, options_class):
                raise TypeError(
                    f"{function.__name__}(options=...) takes a {options_class.__name__}, "
                    f"got {type(options).__name__}."
                )
            elif given:  # keywords change the options object given
                options = dataclasses.replace(options, **given)
            return function(*args, options=options, **kwargs)

        with_options.__signature__ = own.replace(parameters=[*kept, *generated, whole])
        lines = [
            "",
            "",
            "    Run options (keyword arguments, `training.options`; all checked before anything runs):",
        ]
        for field, spec in fields:
            default = defaults_here.get(field.name, field.default)
            lines.append(f"        {field.name} = {default!r}: {spec.help_text(context)}")
        with_options.__doc__ = (function.__doc__ or "") + "\n".join(lines) + "\n"
        return with_options

    return decorate
