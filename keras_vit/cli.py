"""`keras-vit`: the command line for the common jobs (models, weights, train, predict, inspect, export).

The command line prints its own messages only: TensorFlow's C++ start-up lines are hidden
(`TF_CPP_MIN_LOG_LEVEL=3` unless set, and the lines it prints before that setting applies are
caught while TensorFlow is imported), Python-side TensorFlow and absl logging shows errors only,
and a failure is one `keras-vit: error: ...` line. `keras-vit --debug COMMAND` shows everything,
with tracebacks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

from keras_vit import defaults, validation
from keras_vit.environment import enable_onednn

# argparse `type=`s: a bad value fails while parsing, with the usage line (keras_vit.validation).
_POSITIVE_INT = validation.cli_type(validation.positive_int)
_NON_NEGATIVE_INT = validation.cli_type(validation.non_negative_int)
_POSITIVE_NUMBER = validation.cli_type(validation.positive_number, float)
_NON_NEGATIVE_NUMBER = validation.cli_type(validation.number, float, minimum=0.0)
_RATE = validation.cli_type(validation.fraction, float)  # [0, 1)
_RATE_TO_ONE = validation.cli_type(validation.fraction, float, allow_one=True)  # [0, 1]
_MOMENTUM = validation.cli_type(
    validation.number, float, minimum=0.0, maximum=1.0, exclusive_minimum=True, exclusive_maximum=True
)
_MAX_PIXELS_HELP = (
    f"the most pixels (height x width) an image may have; larger files are refused before decoding "
    f"(default {defaults.MAX_PIXELS:,}, Pillow's limit)"
)


def _pretrained_arg(value: str):
    """`--weights` accepts true/false besides a tag, path or repo id."""
    lowered = value.lower()
    if lowered in ("true", "default"):
        return True
    if lowered in ("false", "none", "random"):
        return False
    return value


def _cmd_models(args) -> int:
    from keras_vit.variants import VARIANTS

    header = f"{'model':<12} {'D':>5} {'layers':>6} {'heads':>5} {'MLP':>5} {'px/token':>8} {'size':>5}"
    print(f"{header}  ResNet stages")
    for name, config in sorted(VARIANTS.items()):
        stages = {None: "", (): "root only"}.get(config.resnet_stages, str(config.resnet_stages))
        print(
            f"{name:<12} {config.hidden_size:>5} {config.depth:>6} {config.num_heads:>5} "
            f"{config.mlp_dim:>5} {config.stride:>8} {config.image_hw[0]:>5}  {stages}"
        )
    return 0


def _cmd_pretrained(args) -> int:
    from keras_vit import catalog

    if args.markdown:
        print(catalog.catalog_markdown())
        return 0
    default_tags = set(catalog.default_tags().values())
    for tag in catalog.list_pretrained(args.variant):
        entry = catalog.get_entry(tag)
        classes = entry.num_classes or "no head"
        marker = "  (default)" if tag in default_tags else ""
        numerics = f"numerics {entry.numerics}"
        print(f"{tag:<48} {entry.resolution:>4}px {classes!s:>7}  {numerics:<13}  {entry.hub_repo}{marker}")
    return 0


def _cmd_checkpoint(args) -> int:
    from keras_vit.converters import inspect_checkpoint

    info = inspect_checkpoint(args.checkpoint)
    for field, value in vars(info).items():
        print(f"{field}: {value}")
    return 0


def _cmd_predict(args) -> int:
    if args.saved_model:
        return _predict_saved_model(args)
    import keras_vit
    from keras_vit.preprocessing import Preprocessing

    model = keras_vit.create_model(args.model, args.weights)
    if args.weights is False:
        print(
            f"keras-vit: warning: {model.name} has random weights (--weights false): its classes are "
            "meaningless; pass --weights true, a tag or a checkpoint file for real predictions.",
            file=sys.stderr,
        )
    spec = Preprocessing.for_model(model)  # the checkpoint's, else the package default
    for path in args.images:
        image = keras_vit.load_image(path, spec, max_pixels=args.max_pixels)
        probabilities = model.predict(keras_vit.preprocess_input(image[None], spec), verbose=0)
        print(path)
        top = min(5 if args.top is None else args.top, probabilities.shape[-1])
        for index, name, probability in keras_vit.decode_predictions(probabilities, top, model)[0]:
            print(f"  {probability:7.2%}  {index:>5}  {name}")
    return 0


def _convert_source(args):
    """The model `convert` writes: SOURCE (a variant, a .keras file, a save_pretrained folder or
    `hf-hub:` repo, or a checkpoint into --model), else --model with --weights."""
    import keras_vit

    source = args.source
    sizes = dict(image_size=args.image_size, num_classes=args.num_classes)
    if source is None or source in keras_vit.VARIANTS:
        return keras_vit.create_model(source or args.model, args.weights, **sizes)
    if source.endswith(".keras"):
        return keras_vit.load_model(source)
    from keras_vit.sharing import METADATA_FILE

    if source.startswith("hf-hub:") or os.path.isfile(os.path.join(source, METADATA_FILE)):
        return keras_vit.load_pretrained(source)
    return keras_vit.create_model(args.model, source, **sizes)


def _cmd_convert(args) -> int:
    model = _convert_source(args)
    if args.to:
        import keras_vit
        from keras_vit.preprocessing import read_labels

        labels = read_labels(args.labels) if args.labels else None
        keras_vit.save_pretrained(model, args.output, args.to, labels=labels, overwrite=args.overwrite)
        print(
            f"wrote {args.output} ({model.name} in the {args.to} format, {model.count_params():,} parameters)"
        )
        return 0
    if os.path.exists(args.output) and not args.overwrite:
        raise FileExistsError(f"{args.output} already exists: pass --overwrite to replace it.")
    model.save(args.output)
    print(
        f"wrote {args.output} ({model.name}, input {model.input_shape}, {model.count_params():,} parameters)"
    )
    return 0


def _beside(source: str | None, name: str) -> str | None:
    """`name` next to a .keras file (what keras-vit train writes there), if it exists."""
    if not source or not source.endswith(".keras"):
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(source)), name)
    return path if os.path.isfile(path) else None


def _cmd_push(args) -> int:
    import keras_vit
    from keras_vit.preprocessing import read_labels

    model = _convert_source(args)
    labels_file = args.labels or _beside(args.source, defaults.LABELS_FILE)
    report = args.report or _beside(args.source, "report.json")
    url = keras_vit.push_to_hub(
        model,
        args.repo_id,
        args.format,
        labels=read_labels(labels_file) if labels_file else None,
        report=report,
        private=args.private or None,
    )
    print(f"pushed {model.name} ({args.format} format) to {args.repo_id}: {url}")
    return 0


def _cmd_inspect(args) -> int:
    import keras_vit
    from keras_vit.plots import write_inspection

    model = keras_vit.create_model(args.model, args.weights)
    label = model.name if args.weights is not False else f"{model.name}, random weights"
    written = write_inspection(
        model,
        args.image,
        args.out,
        discard_ratio=args.discard_ratio,
        head_fusion=args.head_fusion,
        label=label,
    )
    for path in written.values():
        print(f"wrote {path}")
    return 0


def _serving_error(message: str) -> str:
    """The reason in a TF op error, without the graph-node lines around it."""
    noise = ("Graph execution error", "Detected at node", "<stack traces unavailable>", "\t [[")
    return " ".join(
        line.strip() for line in message.splitlines() if line.strip() and not line.startswith(noise)
    )


def _predict_saved_model(args) -> int:
    """`predict --saved-model`: the files' bytes through the export's `serving_bytes` signature."""
    import tensorflow as tf

    from keras_vit.export import BYTES_SIGNATURE, latest_version

    serve = tf.saved_model.load(latest_version(args.saved_model)).signatures[BYTES_SIGNATURE]
    for path in args.images:
        with open(path, "rb") as file:
            data = file.read()
        try:
            outputs = serve(image_bytes=tf.constant([data]))
        except tf.errors.InvalidArgumentError as error:
            raise ValueError(f"{path}: {_serving_error(error.message)}") from None
        exported_k = outputs["top_k_indices"].shape[-1]
        top = min(5, exported_k) if args.top is None else args.top
        if top > exported_k:
            raise ValueError(
                f"--top {args.top} is more than the {exported_k} classes the SavedModel returns: "
                f"export it again with --top-k {args.top}."
            )
        indices, scores = outputs["top_k_indices"][0].numpy(), outputs["top_k_scores"][0].numpy()
        names = outputs["top_k_classes"][0].numpy() if "top_k_classes" in outputs else [None] * exported_k
        print(path)
        for index, name, score in list(zip(indices, names, scores, strict=True))[:top]:
            print(f"  {score:7.2%}  {index:>5}  {name.decode() if name is not None else None}")
    return 0


def _cmd_export(args) -> int:
    import keras_vit

    labels_file = args.labels
    if args.model.endswith(".keras"):
        if args.weights is not None:
            raise ValueError("--weights applies to a variant; a .keras file already holds its weights.")
        model = keras_vit.load_model(args.model)  # registers keras_vit's classes first
        beside = os.path.join(os.path.dirname(os.path.abspath(args.model)), defaults.LABELS_FILE)
        if labels_file is None and os.path.isfile(beside):  # written by keras-vit train next to model.keras
            labels_file = beside
    else:
        model = keras_vit.create_model(args.model, True if args.weights is None else args.weights)
    labels = None
    if labels_file:
        from keras_vit.preprocessing import read_labels

        labels = read_labels(labels_file)
    if args.format != "saved_model":
        write = keras_vit.export_onnx if args.format == "onnx" else keras_vit.export_litert
        options = {"int8": True} if args.int8 else {}
        if args.int8 and args.format != "litert":
            raise ValueError("--int8 applies to --format litert (dynamic-range int8 weights).")
        path = write(
            model, args.export_dir, preprocessing=args.preprocessing, overwrite=args.overwrite, **options
        )
        size = os.path.getsize(path) / 2**20
        print(f"wrote {path} ({model.name}, {args.format}, input {model.input_shape[1:]}, {size:.1f} MiB)")
        return 0
    top_k = min(5, int(model.output_shape[-1])) if args.top_k is None else args.top_k
    path = keras_vit.export_serving(
        model,
        args.export_dir,
        args.version,
        top_k=top_k,
        labels=labels,
        warmup=not args.no_warmup,
        overwrite=args.overwrite,
        max_pixels=args.max_pixels,
    )
    found = f"; class names from {labels_file}" if labels_file and not args.labels else ""
    print(f"wrote {path} ({model.name}, input {model.input_shape[1:]}, top {top_k}{found})")
    return 0


def _model_config(args):
    """The architecture named by `--model` with the custom sizes given on the command line."""
    from keras_vit import training

    return training.model_config(
        args.model,
        patch_size=args.patch_size,
        hidden_size=args.hidden_size,
        depth=args.depth,
        num_heads=args.heads,
        mlp_dim=args.mlp_dim,
    )


def _cmd_train(args) -> int:
    from keras_vit import training

    config = _model_config(args)
    result = training.train(
        config,
        args.dataset,
        recipe="finetune" if args.command == "finetune" else "pretrain",
        pretrained=args.pretrained,
        learning_rate=args.learning_rate,
        label_smoothing=args.label_smoothing,
        ema_momentum=args.ema,
        dropout=args.dropout,
        drop_path_rate=args.drop_path,
        mixup_alpha=args.mixup,
        test_split=args.test_split,
        **_run_arguments(args),
    )
    report = result.report
    print(
        f"held-out accuracy: {report['accuracy']:.2%} on {report['test_examples']} images "
        f"(loss {report['loss']:.4f}; {report['steps']} steps, {report['seconds']:.0f} s)"
    )
    print(f"wrote {os.path.join(args.output_dir, 'model.keras')} and report.json")
    return 0


def _add_model_arguments(parser, default: str):
    """The `model` group of train/finetune/pretrain: a named model, or custom sizes."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model", default=default, help="a variant from `keras-vit models`, or vit_digits (the main job's)"
    )
    for flag, text in (
        ("--patch-size", "patch size"),
        ("--hidden-size", "width D"),
        ("--depth", "number of blocks"),
        ("--heads", "attention heads"),
        ("--mlp-dim", "MLP width"),
    ):
        model.add_argument(flag, type=_POSITIVE_INT, default=None, help=f"custom size: {text}")
    return model


def _add_data_and_length_arguments(parser, dataset_help: str, image_size_help: str, default_epochs: int):
    """The `data` and `optimisation` groups' shared arguments (source, size, flips, batch, length)."""
    dataset = parser.add_argument_group("data")
    dataset.add_argument("--dataset", default=defaults.DATASET, help=dataset_help)
    dataset.add_argument("--data-dir", default=None, help="tensorflow-datasets data_dir")
    dataset.add_argument("--train-split", default=defaults.TRAIN_SPLIT)
    dataset.add_argument("--image-size", type=_POSITIVE_INT, default=None, help=image_size_help)
    dataset.add_argument(
        "--flip",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="random horizontal flips (default: on, off for digits)",
    )
    dataset.add_argument(
        "--on-bad-image",
        choices=defaults.BAD_IMAGE_ACTIONS,
        default=defaults.BAD_IMAGE_ACTIONS[0],
        help="an image folder's unreadable files: stop naming them (default), or skip them with a warning",
    )
    schedule = parser.add_argument_group("optimisation")
    schedule.add_argument(
        "--batch-size", type=_POSITIVE_INT, default=defaults.BATCH_SIZE, help="global batch"
    )
    length = schedule.add_mutually_exclusive_group()
    length.add_argument("--steps", type=_POSITIVE_INT, default=None)
    length.add_argument(
        "--epochs",
        type=_POSITIVE_NUMBER,
        default=None,
        help=f"passes over the training data (default {default_epochs})",
    )
    schedule.add_argument(
        "--steps-per-epoch",
        type=_POSITIVE_INT,
        default=None,
        help="steps between backups (default: one pass, <= 1000)",
    )
    schedule.add_argument(
        "--warmup-steps",
        type=_NON_NEGATIVE_INT,
        default=None,
        help=f"linear warm-up (default: {defaults.WARMUP_FRACTION * 100:.0f}%% of the steps, recipe-capped)",
    )
    return dataset, schedule


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


def _add_run_arguments(parser, output_dir: str, writes: str) -> None:
    """The `run` group shared by train/finetune/pretrain (the one driver, `keras_vit.runs.fit_task`)."""
    run = parser.add_argument_group("run")
    run.add_argument("--output-dir", default=output_dir, help=f"{writes}, report.json, logs/, backup/")
    run.add_argument(
        "--strategy",
        choices=defaults.STRATEGIES,
        default=defaults.STRATEGIES[0],
        help="tf.distribute strategy (keras_vit.distribute.get_strategy)",
    )
    run.add_argument("--precision", choices=defaults.PRECISIONS, default=defaults.PRECISIONS[0])
    run.add_argument(
        "--jit-compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="XLA-compile the train step (auto: on for a single replica)",
    )
    run.add_argument(
        "--steps-per-execution",
        type=_steps_per_execution,
        default=defaults.STEPS_PER_EXECUTION,
        help=f"train steps per call (auto: epoch divisor <= {defaults.STEPS_PER_EXECUTION_CAP})",
    )
    run.add_argument("--seed", type=_NON_NEGATIVE_INT, default=defaults.SEED)
    run.add_argument(
        "--verbose", type=int, choices=(0, 1, 2), default=None, help="default: bar on a terminal"
    )


def _run_arguments(args) -> dict:
    """The keyword arguments every training command passes on, from the shared argument groups."""
    return dict(
        output_dir=args.output_dir,
        image_size=args.image_size,
        batch_size=args.batch_size,
        steps=args.steps,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        flip=args.flip,
        strategy=args.strategy,
        precision=args.precision,
        jit_compile={"on": True, "off": False}.get(args.jit_compile, "auto"),
        steps_per_execution=args.steps_per_execution,
        seed=args.seed,
        train_split=args.train_split,
        data_dir=args.data_dir,
        on_bad_image=args.on_bad_image,
        verbose="auto" if args.verbose is None else args.verbose,
    )


def _add_training_parser(commands, name: str) -> None:
    """`train` (from scratch, AdamW recipe) or `finetune` (from a checkpoint, SGD recipe)."""
    finetune = name == "finetune"
    parser = commands.add_parser(
        name,
        help="fine-tune a pretrained ViT (SGD momentum recipe)"
        if finetune
        else "train a ViT from scratch (AdamW recipe); no arguments: the digits main job",
    )
    model = _add_model_arguments(parser, defaults.FINETUNE_MODEL if finetune else defaults.TRAIN_MODEL)
    model.add_argument(
        "--pretrained",
        type=_pretrained_arg,
        default=finetune,
        help="checkpoint to start from: true (the variant's default), a catalog tag, a file or a hub repo id",
    )
    model.add_argument("--dropout", type=_RATE, default=defaults.DROPOUT)
    model.add_argument(
        "--drop-path",
        type=_RATE,
        default=None,
        help=f"stochastic depth rate (default {defaults.SCRATCH_DROP_PATH} from scratch, 0 fine-tuning)",
    )
    model.add_argument(
        "--mixup",
        type=_NON_NEGATIVE_NUMBER,
        default=None,
        help=f"mixup Beta(alpha, alpha) of the training batches, 0 off (default {defaults.SCRATCH_MIXUP} "
        "from scratch, 0 fine-tuning)",
    )
    dataset, schedule = _add_data_and_length_arguments(
        parser,
        "digits (scikit-learn, offline), an image folder with train/ and test/, or a prepared tfds name",
        "default: the model's or checkpoint's",
        defaults.TRAIN_EPOCHS,
    )
    dataset.add_argument(
        "--test-split", default=defaults.TEST_SPLIT, help="the held-out split evaluated at the end"
    )
    schedule.add_argument(
        "--learning-rate",
        "--lr",
        type=_POSITIVE_NUMBER,
        default=None,
        help=f"peak LR (default {defaults.SCRATCH_LEARNING_RATE:g}; "
        f"{defaults.FINETUNE_LEARNING_RATE:g} to fine-tune)",
    )
    schedule.add_argument(
        "--weight-decay",
        type=_NON_NEGATIVE_NUMBER,
        default=defaults.WEIGHT_DECAY,
        help="AdamW decoupled weight decay",
    )
    schedule.add_argument("--label-smoothing", type=_RATE, default=defaults.LABEL_SMOOTHING)
    schedule.add_argument(
        "--ema", type=_MOMENTUM, default=None, help="Polyak averaging momentum, e.g. 0.9999"
    )
    _add_run_arguments(parser, defaults.TRAIN_OUTPUT_DIR, "model.keras")
    parser.set_defaults(run=_cmd_train)


def _cmd_pretrain(args) -> int:
    from keras_vit import pretrain

    config = _model_config(args)
    result = pretrain.pretrain(
        config,
        args.dataset,
        learning_rate=args.learning_rate,
        target=args.target,
        bits=args.bits,
        corrupt_rate=args.corrupt_rate,
        mask_rate=args.mask_rate,
        random_rate=args.random_rate,
        **_run_arguments(args),
    )
    report = result.report
    accuracy = "" if report["patch_accuracy"] is None else f", patch accuracy {report['patch_accuracy']:.2%}"
    print(
        f"masked patch prediction: loss {report['loss']:.4f}{accuracy} after {report['steps']} steps "
        f"({report['seconds']:.0f} s)"
    )
    print(f"wrote {os.path.join(args.output_dir, 'backbone.keras')} and report.json")
    return 0


def _add_pretraining_parser(commands) -> None:
    """`pretrain`: self-supervised masked patch prediction on unlabeled images (paper §4.6)."""
    parser = commands.add_parser(
        "pretrain",
        help="self-supervised pre-training by masked patch prediction (labels unused); writes backbone.keras",
    )
    _add_model_arguments(parser, defaults.TRAIN_MODEL)
    task = parser.add_argument_group("task")
    task.add_argument(
        "--target",
        choices=defaults.MPP_TARGETS,
        default=defaults.MPP_TARGETS[0],
        help="3-bit mean colour (paper), 4x4 grid of 3-bit colours, or L2 on the patch pixels",
    )
    for flag, kind, default, text in (
        ("--bits", _POSITIVE_INT, defaults.MPP_BITS, "bits per channel of the colour targets"),
        ("--corrupt-rate", _RATE_TO_ONE, defaults.MPP_CORRUPT_RATE, "share of patches corrupted per image"),
        ("--mask-rate", _RATE_TO_ONE, defaults.MPP_MASK_RATE, "of those, share set to [mask]"),
        ("--random-rate", _RATE_TO_ONE, defaults.MPP_RANDOM_RATE, "of those, share set to another patch"),
    ):
        task.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")
    _, schedule = _add_data_and_length_arguments(
        parser,
        "digits (train split), an image folder (train/ if present) or a prepared tfds name",
        "default: the model's",
        defaults.PRETRAIN_EPOCHS,
    )
    schedule.add_argument(
        "--learning-rate",
        "--lr",
        type=_POSITIVE_NUMBER,
        default=defaults.PRETRAIN_LEARNING_RATE,
        help="peak LR (paper: 2e-4)",
    )
    schedule.add_argument(
        "--weight-decay",
        type=_NON_NEGATIVE_NUMBER,
        default=defaults.PRETRAIN_WEIGHT_DECAY,
        help="> 0: AdamW on kernels",
    )
    _add_run_arguments(parser, defaults.PRETRAIN_OUTPUT_DIR, "backbone.keras")
    parser.set_defaults(run=_cmd_pretrain)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-vit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show TensorFlow's log lines and full tracebacks (before the command: keras-vit --debug train)",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    models = commands.add_parser("models", help="list the model variants")
    models.set_defaults(run=_cmd_models, uses_tensorflow=False)

    listing = commands.add_parser(
        "pretrained",
        aliases=["weights"],
        help="list the published checkpoints (each variant's default marked)",
    )
    listing.add_argument("variant", nargs="?", help="only this variant, e.g. vit_b16")
    listing.add_argument("--markdown", action="store_true", help="print the catalog as a markdown table")
    listing.set_defaults(run=_cmd_pretrained)

    checkpoint = commands.add_parser("checkpoint", help="describe a checkpoint file (format, shapes)")
    checkpoint.add_argument("checkpoint", help="a Google .npz, timm or Hugging Face .safetensors / .bin file")
    checkpoint.set_defaults(run=_cmd_checkpoint)

    weights_help = "true (the variant's default checkpoint), a catalog tag, a local file or a hub repo id"
    predict = commands.add_parser("predict", help="top-k classes (with names) of image files")
    predict.add_argument("images", nargs="+", help="image files (JPEG, PNG, ...)")
    predict.add_argument("--model", default="vit_b16", help="a variant from `keras-vit models`")
    predict.add_argument("--weights", type=_pretrained_arg, default=True, help=weights_help)
    predict.add_argument(
        "--top", type=_POSITIVE_INT, default=None, help="classes to show (default: 5, or all if fewer)"
    )
    predict.add_argument(
        "--max-pixels", type=_POSITIVE_INT, default=defaults.MAX_PIXELS, help=_MAX_PIXELS_HELP
    )
    predict.add_argument(
        "--saved-model",
        metavar="DIR",
        help="predict through a `keras-vit export` SavedModel (its directory or a version); "
        "--model and --weights are then not used",
    )
    predict.set_defaults(run=_cmd_predict)

    convert = commands.add_parser(
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
        choices=("timm", "hf", "google_npz"),
        help="write this published format (keras_vit.save_pretrained)",
    )
    convert.add_argument("--labels", help="with --to: a text file of class names, one per line in head order")
    convert.add_argument(
        "--overwrite", action="store_true", help="replace an existing file or non-empty folder"
    )
    convert.add_argument("--model", default="vit_b16")
    convert.add_argument("--weights", type=_pretrained_arg, default=True, help=weights_help)
    convert.add_argument(
        "--image-size", type=_POSITIVE_INT, default=None, help="resize the position embedding"
    )
    convert.add_argument(
        "--num-classes", type=_POSITIVE_INT, default=None, help="a new zero-initialised head"
    )
    convert.set_defaults(run=_cmd_convert)

    push = commands.add_parser(
        "push", help="upload a model to the Hugging Face Hub in a published format, with a model card"
    )
    push.add_argument(
        "source",
        help="a .keras file (its labels.txt and report.json are used), a save_pretrained folder, a variant, "
        "or a checkpoint to load into --model",
    )
    push.add_argument("repo_id", help="the Hub repo, user/name (created if missing)")
    push.add_argument("--format", choices=("timm", "hf", "google_npz"), default="timm")
    push.add_argument("--model", default="vit_b16", help="the variant a checkpoint SOURCE loads into")
    push.add_argument(
        "--weights", type=_pretrained_arg, default=True, help="for a variant SOURCE: " + weights_help
    )
    push.add_argument("--labels", help="a text file of class names, one per line in head order")
    push.add_argument("--report", help="a training run's report.json for the model card")
    push.add_argument("--private", action="store_true", help="create the repo private")
    push.set_defaults(run=_cmd_push, image_size=None, num_classes=None)

    inspection = commands.add_parser(
        "inspect", help="attention rollout, attention distance, position embeddings, filters as PNGs"
    )
    inspection.add_argument("image", help="an image file (JPEG, PNG, ...)")
    inspection.add_argument("--model", default="vit_b16", help="a variant from `keras-vit models`")
    inspection.add_argument(
        "--weights", type=_pretrained_arg, default=True, help=weights_help + ", or random"
    )
    inspection.add_argument("--out", default="inspection", help="folder for the PNGs (default: ./inspection)")
    inspection.add_argument(
        "--discard-ratio", type=_RATE, default=0.0, help="rollout: drop the weakest weights"
    )
    inspection.add_argument("--head-fusion", choices=defaults.HEAD_FUSIONS, default=defaults.HEAD_FUSIONS[0])
    inspection.set_defaults(run=_cmd_inspect)

    export = commands.add_parser(
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
        choices=("saved_model", "onnx", "litert"),
        default="saved_model",
        help="saved_model (TF Serving, default), onnx (a .onnx file) or litert (a .tflite file)",
    )
    export.add_argument(
        "--preprocessing",
        action="store_true",
        help="onnx/litert: take uint8 pixels at the model's input size and normalise them in the graph",
    )
    export.add_argument(
        "--int8", action="store_true", help="litert: int8 weights (dynamic-range quantization)"
    )
    export.add_argument(
        "--model", default="vit_b16", help="a variant from `keras-vit models`, or a .keras file"
    )
    export.add_argument(
        "--weights", type=_pretrained_arg, default=None, help=weights_help + " (default: true)"
    )
    export.add_argument(
        "--version", type=_NON_NEGATIVE_INT, default=1, help="the version directory (default: 1)"
    )
    export.add_argument(
        "--top-k",
        type=_POSITIVE_INT,
        default=None,
        help="classes in the top_k_* outputs (default: 5, or all if fewer)",
    )
    export.add_argument(
        "--labels",
        help="a text file of class names, one per line in head order (any model; default: the catalog's "
        f"names, or the {defaults.LABELS_FILE} next to a .keras model, which keras-vit train writes)",
    )
    export.add_argument(
        "--max-pixels",
        type=_POSITIVE_INT,
        default=defaults.MAX_PIXELS,
        help=_MAX_PIXELS_HELP.replace("an image", "an image sent to serving_bytes"),
    )
    export.add_argument("--no-warmup", action="store_true", help="no TF Serving warm-up requests")
    export.add_argument("--overwrite", action="store_true", help="replace an existing version")
    export.set_defaults(run=_cmd_export)

    _add_training_parser(commands, "train")
    _add_training_parser(commands, "finetune")
    _add_pretraining_parser(commands)
    return parser


def _quiet_logging() -> None:
    """TensorFlow's C++ logs hidden (unless the user set their level); Python-side logs at errors only."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    for name in ("tensorflow", "absl", "h5py"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging  # TensorFlow's (and tensorflow-datasets') Python logging
    except ImportError:
        return
    absl_logging.set_verbosity(absl_logging.ERROR)


def _import_tensorflow_quietly() -> None:
    """Import TensorFlow with the C++ lines it prints while loading sent nowhere.

    TensorFlow's shared libraries log a few lines (oneDNN, "Could not find cuda drivers", ...)
    before `TF_CPP_MIN_LOG_LEVEL` applies, straight to file descriptor 2: they are caught in a
    temporary file and shown only if the import fails.
    """
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no usable descriptor 2: nothing to hide
        import tensorflow  # noqa: F401

        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            import tensorflow  # noqa: F401
        except BaseException:
            os.dup2(saved, 2)
            caught.seek(0)
            sys.stderr.write(caught.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _tensorflow_error(error: BaseException) -> str | None:
    """A TensorFlow op error (e.g. an unreadable image met by the input pipeline) as one line, or None."""
    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(error, tf.errors.OpError):
        return None
    return f"TensorFlow: {_serving_error(error.message)} (keras-vit --debug shows the full error)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    enable_onednn()  # before TensorFlow is imported: fused CPU kernels (keras_vit.environment)
    if not args.debug:
        _quiet_logging()
        if getattr(args, "uses_tensorflow", True):
            _import_tensorflow_quietly()
    try:
        return args.run(args)
    except Exception as error:
        if args.debug:
            raise
        message = _tensorflow_error(error)
        if message is None and isinstance(error, (ValueError, OSError, ImportError)):
            message = str(error)  # our errors say what to do; no traceback needed
        if message is None:
            raise
        print(f"keras-vit: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
