"""The `keras-vit` command line's arguments: every command's flags and help, declared or generated.

The training commands' flags are generated from the run options (`keras_vit.training.options`): each
option's flag, type, check, default and help are declared once there, and its help names the
command's recipe values (`keras_vit.training.recipes`). The other commands declare their few flags here.
Parsing imports nothing heavy, so `--help` is instant and no backend is chosen before
`keras_vit.cli.startup` chooses it.
"""

from __future__ import annotations

import argparse

from keras_vit.checkpoints.formats import FORMATS
from keras_vit.cli import commands
from keras_vit.deploy.formats import EXPORT_FORMATS
from keras_vit.training.options import (
    ClassifierOptions,
    MaskedPatchOptions,
    RunOptions,
    checkpoint_flag,
    help_context,
    option_fields,
)
from keras_vit.training.recipes import FINE_TUNING, FROM_SCRATCH, MASKED_PATCH_PREDICTION, Recipe
from keras_vit.utils import defaults, validation

__all__ = ["add_options", "build_parser"]

DESCRIPTION = """`keras-vit`: the command line for the common jobs (models, weights, train, predict, inspect,
export).

The command line prints its own messages only: TensorFlow's C++ start-up lines are hidden
(`TF_CPP_MIN_LOG_LEVEL=3` unless set, and the lines it prints before that setting applies are
caught while TensorFlow is imported), Python-side TensorFlow and absl logging shows errors only,
and a failure is one `keras-vit: error: ...` line. `keras-vit --debug COMMAND` shows everything,
with tracebacks. The Keras backend is `KERAS_BACKEND`'s (or keras.json's), imported first.
"""

# argparse `type=`s: a bad value fails while parsing, with the usage line (keras_vit.utils.validation).
_POSITIVE_INT = validation.cli_type(validation.positive_int)
_NON_NEGATIVE_INT = validation.cli_type(validation.non_negative_int)
_RATE = validation.cli_type(validation.fraction, float)  # [0, 1)
_MAX_PIXELS_HELP = (
    f"the most pixels (height x width) an image may have; larger files are refused before decoding "
    f"(default {defaults.MAX_PIXELS:,}, Pillow's limit)"
)
_WEIGHTS_HELP = "true (the variant's default checkpoint), a catalog tag, a local file or a hub repo id"
_MODEL_HELP = (
    f"a variant from `keras-vit models` (default {commands.MODEL}), a .keras file (keras-vit train's "
    "model.keras), a save_pretrained folder or a checkpoint file; these hold their weights (no --weights)"
)
_LABELS_HELP = (
    "a text file of class names, one per line in head order (default: the catalog's names, the "
    f"{defaults.LABELS_FILE} next to a .keras model, which keras-vit train writes, or a save_pretrained "
    "folder's)"
)
# The order of the training commands' help sections.
_GROUPS = ("model", "task", "data", "optimisation", "run")
_INTEGER_VALIDATORS = (validation.positive_int, validation.non_negative_int, validation.integer)


def _option_type(spec, nargs: int | None):
    """The argparse `type=` of an option: parse the text, then check it with the option's validator."""
    parse = spec.parse or (int if spec.validator in _INTEGER_VALIDATORS else float)
    if spec.validator is None or nargs is not None:  # a pair is checked whole, when the run starts
        return parse

    def checked(name, value, **bounds):
        spec.validator(name, value, **bounds)
        return value  # as parsed (an image size stays one int)

    return validation.cli_type(checked, parse, **dict(spec.bounds))


class _StoreGiven(argparse._StoreAction):
    """argparse's `store`, noting the option in `namespace.given` (the options typed, not defaulted)."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


def add_options(
    parser: argparse.ArgumentParser,
    options_class: type[RunOptions],
    recipe: Recipe,
    saved_file: str,
    groups: dict[str, argparse._ArgumentGroup],
    **defaults_here,
) -> None:
    """Add a flag for every option of `options_class`, in its help group, as the option declares it."""
    context = help_context(recipe, saved_file)
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for field, spec in option_fields(options_class):
        group = groups[spec.group]
        if spec.exclusive is not None:
            if spec.exclusive not in exclusive:
                exclusive[spec.exclusive] = group.add_mutually_exclusive_group()
            group = exclusive[spec.exclusive]
        default = defaults_here.get(field.name, field.default)
        text = spec.help_text(context)
        if default is not None and "default" not in text:
            text += f" (default {default})"
        settings = dict(dest=field.name, default=default, help=text.replace("%", "%%"), action=_StoreGiven)
        if spec.switch:
            settings["action"] = argparse.BooleanOptionalAction
        elif spec.choices is not None and spec.parse is None:
            settings["choices"] = spec.choices
        elif spec.validator is not None or spec.parse is not None:
            settings["type"] = _option_type(spec, spec.nargs)
            if spec.choices is not None:
                settings["choices"] = spec.choices
        if spec.nargs is not None:
            settings["nargs"] = spec.nargs
        if spec.metavar is not None:
            settings["metavar"] = spec.metavar
        group.add_argument(*spec.flags(field.name), **settings)
    parser.set_defaults(options_class=options_class)


def _add_run_command(
    subparsers,
    name: str,
    help: str,
    options_class: type[RunOptions],
    recipe: Recipe,
    saved_file: str,
    model: str,
    dataset_help: str,
    **defaults_here,
) -> argparse.ArgumentParser:
    """A training command: the model and dataset flags, then the generated run options."""
    parser = subparsers.add_parser(name, help=help)
    groups = {group: parser.add_argument_group(group) for group in _GROUPS}
    groups["model"].add_argument(
        "--model", default=model, help="a variant from `keras-vit models`, or vit_digits (the main job's)"
    )
    for flag, text in (
        ("--patch-size", "patch size"),
        ("--hidden-size", "width D"),
        ("--depth", "number of blocks"),
        ("--heads", "attention heads"),
        ("--mlp-dim", "MLP width"),
    ):
        groups["model"].add_argument(flag, type=_POSITIVE_INT, default=None, help=f"custom size: {text}")
    groups["data"].add_argument("--dataset", default=defaults.DATASET, help=dataset_help)
    add_options(parser, options_class, recipe, saved_file, groups, **defaults_here)
    parser.set_defaults(recipe=recipe.name, check=commands.check_run_options)
    return parser


def _add_training_commands(subparsers) -> None:
    """`train` (from scratch), `finetune` (from a checkpoint) and `pretrain` (masked patch prediction)."""
    classification_data = (
        "digits (scikit-learn, offline), an image folder with train/ and test/, or a prepared tfds name"
    )
    _add_run_command(
        subparsers,
        "train",
        "train a ViT from scratch (AdamW recipe); no arguments: the digits main job",
        ClassifierOptions,
        FROM_SCRATCH,
        "model.keras",
        defaults.TRAIN_MODEL,
        classification_data,
    ).set_defaults(run=commands.run_train)
    _add_run_command(
        subparsers,
        "finetune",
        "fine-tune a pretrained ViT (SGD momentum recipe)",
        ClassifierOptions,
        FINE_TUNING,
        "model.keras",
        defaults.FINETUNE_MODEL,
        classification_data,
        pretrained=True,
    ).set_defaults(run=commands.run_train)
    _add_run_command(
        subparsers,
        "pretrain",
        "self-supervised pre-training by masked patch prediction (labels unused); writes backbone.keras",
        MaskedPatchOptions,
        MASKED_PATCH_PREDICTION,
        "backbone.keras",
        defaults.TRAIN_MODEL,
        "digits (train split), an image folder (train/ if present) or a prepared tfds name",
    ).set_defaults(run=commands.run_pretrain)


def _add_models(subparsers) -> None:
    """`models`: the variants table."""
    models = subparsers.add_parser("models", help="list the model variants")
    models.set_defaults(run=commands.run_models, needs_backend=False)


def _add_pretrained(subparsers) -> None:
    """`pretrained` (`weights`): the checkpoint catalog."""
    listing = subparsers.add_parser(
        "pretrained",
        aliases=["weights"],
        help="list the published checkpoints (each variant's default marked)",
    )
    listing.add_argument("variant", nargs="?", help="only this variant, e.g. vit_b16")
    listing.add_argument("--markdown", action="store_true", help="print the catalog as a markdown table")
    listing.set_defaults(run=commands.run_pretrained)


def _add_checkpoint(subparsers) -> None:
    """`checkpoint`: what a checkpoint file holds."""
    checkpoint = subparsers.add_parser("checkpoint", help="describe a checkpoint file (format, shapes)")
    checkpoint.add_argument("checkpoint", help="a Google .npz, timm or Hugging Face .safetensors / .bin file")
    checkpoint.set_defaults(run=commands.run_checkpoint, check=commands.check_checkpoint)


def _add_predict(subparsers) -> None:
    """`predict`: top-k classes of image files."""
    predict = subparsers.add_parser("predict", help="top-k classes (with names) of image files")
    predict.add_argument("images", nargs="+", help="image files (JPEG, PNG, ...)")
    predict.add_argument("--model", help=_MODEL_HELP)
    predict.add_argument("--weights", type=checkpoint_flag, help=_WEIGHTS_HELP + " (default: true)")
    predict.add_argument("--labels", help=_LABELS_HELP)
    predict.add_argument(
        "--top", type=_POSITIVE_INT, default=None, help="classes to show (default: 5, or all if fewer)"
    )
    predict.add_argument("--max-pixels", type=_POSITIVE_INT, help=_MAX_PIXELS_HELP)
    predict.add_argument(
        "--saved-model",
        metavar="DIR",
        help="predict through a `keras-vit export` SavedModel (its directory or a version); "
        "--model, --weights, --labels and --max-pixels are then refused (the SavedModel holds them)",
    )
    predict.set_defaults(run=commands.run_predict, check=commands.check_predict)


_NO_VERIFY_HELP = (
    "load a save_pretrained folder without checking the SHA-256 checksums in its keras_vit.json "
    "(for files edited on purpose)"
)


def _add_convert(subparsers) -> None:
    """`convert`: a model written as .keras or a published format."""
    convert = subparsers.add_parser(
        "convert",
        help="write a model as a .keras file, or with --to as a timm / transformers / Google checkpoint",
    )
    convert.add_argument(
        "source",
        nargs="?",
        help="a variant, a .keras file, a save_pretrained folder, hf-hub:org/name, or a checkpoint to load "
        "into --model (default: --model with --weights)",
    )
    convert.add_argument("output", help="the .keras file to write, or with --to the folder")
    convert.add_argument(
        "--to",
        choices=tuple(FORMATS),
        help="write this published format (keras_vit.save_pretrained)",
    )
    convert.add_argument("--labels", help="with --to: a text file of class names, one per line in head order")
    convert.add_argument(
        "--overwrite",
        action="store_true",
        help="replace keras_vit's own earlier output there (the .keras file, or the files an earlier "
        "--to wrote into the folder); the folder's other files are kept",
    )
    convert.add_argument("--no-verify", dest="verify", action="store_false", help=_NO_VERIFY_HELP)
    convert.add_argument(
        "--model",
        help="the variant a checkpoint SOURCE loads into, or without SOURCE "
        f"the variant to write (default {commands.MODEL})",
    )
    convert.add_argument(
        "--weights", type=checkpoint_flag, help="without SOURCE: " + _WEIGHTS_HELP + " (default: true)"
    )
    convert.add_argument(
        "--image-size", type=_POSITIVE_INT, default=None, help="resize the position embedding"
    )
    convert.add_argument(
        "--num-classes", type=_POSITIVE_INT, default=None, help="a new zero-initialised head"
    )
    convert.set_defaults(run=commands.run_convert, check=commands.check_convert)


def _add_push(subparsers) -> None:
    """`push`: a model uploaded to the Hugging Face Hub."""
    push = subparsers.add_parser(
        "push", help="upload a model to the Hugging Face Hub in a published format, with a model card"
    )
    push.add_argument(
        "source",
        help="a .keras file (its labels.txt and report.json are used), a save_pretrained folder, a variant, "
        "or a checkpoint to load into --model",
    )
    push.add_argument("repo_id", help="the Hub repo, user/name (created if missing)")
    push.add_argument("--format", choices=tuple(FORMATS), default="timm")
    push.add_argument(
        "--model", help=f"the variant a checkpoint SOURCE loads into (default {commands.MODEL})"
    )
    push.add_argument(
        "--weights", type=checkpoint_flag, help="for a variant SOURCE: " + _WEIGHTS_HELP + " (default: true)"
    )
    push.add_argument("--labels", help="a text file of class names, one per line in head order")
    push.add_argument("--report", help="a training run's report.json for the model card")
    push.add_argument("--private", action="store_true", help="create the repo private")
    push.add_argument("--no-verify", dest="verify", action="store_false", help=_NO_VERIFY_HELP)
    push.set_defaults(run=commands.run_push, check=commands.check_push, image_size=None, num_classes=None)


def _add_inspect(subparsers) -> None:
    """`inspect`: pictures of what the model attends to."""
    inspection = subparsers.add_parser(
        "inspect", help="attention rollout, attention distance, position embeddings, filters as PNGs"
    )
    inspection.add_argument("image", help="an image file (JPEG, PNG, ...)")
    inspection.add_argument("--model", help=_MODEL_HELP)
    inspection.add_argument(
        "--weights", type=checkpoint_flag, help=_WEIGHTS_HELP + ", or random (default: true)"
    )
    inspection.add_argument("--out", default="inspection", help="folder for the PNGs (default: ./inspection)")
    inspection.add_argument(
        "--discard-ratio", type=_RATE, default=0.0, help="rollout: drop the weakest weights"
    )
    inspection.add_argument("--head-fusion", choices=defaults.HEAD_FUSIONS, default=defaults.HEAD_FUSIONS[0])
    inspection.set_defaults(run=commands.run_inspect, check=commands.check_inspect)


def _add_export(subparsers) -> None:
    """`export`: a TF Serving SavedModel, an ONNX or a LiteRT file."""
    export = subparsers.add_parser(
        "export",
        help="write a TF Serving SavedModel that takes raw images (preprocessing in the graph), "
        "or an ONNX or LiteRT file",
    )
    export.add_argument(
        "export_dir",
        help="TF Serving's model base path: writes EXPORT_DIR/VERSION; with --format onnx|litert "
        "the file to write",
    )
    export.add_argument(
        "--format",
        choices=tuple(EXPORT_FORMATS),
        default="saved_model",
        help="; ".join(f"{row.name}: {row.writes}" for row in EXPORT_FORMATS.values()),
    )
    export.add_argument(
        "--preprocessing",
        action="store_true",
        default=None,
        help="onnx/litert: take uint8 pixels at the model's input size and normalise them in the graph",
    )
    export.add_argument(
        "--int8", action="store_true", default=None, help="litert: int8 weights (dynamic-range quantization)"
    )
    export.add_argument("--model", help=_MODEL_HELP)
    export.add_argument(
        "--weights", type=checkpoint_flag, default=None, help=_WEIGHTS_HELP + " (default: true)"
    )
    export.add_argument(
        "--version", type=_NON_NEGATIVE_INT, help="saved_model: the version directory (default: 1)"
    )
    export.add_argument(
        "--top-k",
        type=_POSITIVE_INT,
        default=None,
        help="saved_model: classes in the top_k_* outputs (default: 5, or all if fewer)",
    )
    export.add_argument(
        "--labels",
        help="saved_model: " + _LABELS_HELP,
    )
    export.add_argument(
        "--max-pixels",
        type=_POSITIVE_INT,
        help="saved_model: " + _MAX_PIXELS_HELP.replace("an image", "an image sent to serving_bytes"),
    )
    export.add_argument(
        "--no-warmup", action="store_true", default=None, help="saved_model: no TF Serving warm-up requests"
    )
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="replace keras_vit's own earlier export of this version (or file); nothing else is touched",
    )
    export.set_defaults(run=commands.run_export, check=commands.check_export)


def build_parser() -> argparse.ArgumentParser:
    """The `keras-vit` parser: one sub-command per job (its `run` is in `keras_vit.cli.commands`)."""
    parser = argparse.ArgumentParser(
        prog="keras-vit", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show TensorFlow's log lines and full tracebacks (before the command: keras-vit --debug train)",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in (
        _add_models,
        _add_pretrained,
        _add_checkpoint,
        _add_predict,
        _add_convert,
        _add_push,
        _add_inspect,
        _add_export,
        _add_training_commands,
    ):
        add(subparsers)
    return parser
