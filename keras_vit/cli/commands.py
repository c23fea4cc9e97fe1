"""What each `keras-vit` command does, given its parsed arguments (`keras_vit.cli.parser` declares them).

Each `run_*` function imports what it needs when it runs, so that parsing (and `--help`)
imports nothing heavy, and returns the exit status. Errors are raised as exceptions with a
message that says what to do; `keras_vit.cli.main` prints them as one line.
"""

from __future__ import annotations

import os
import sys

from keras_vit.cli.startup import op_error_message
from keras_vit.utils import defaults
from keras_vit.utils.validation import existing_file, output_file, output_folder

MODEL = "vit_b16"  # --model's default (predict, inspect, export, convert, push)

__all__ = [
    "check_checkpoint",
    "check_convert",
    "check_export",
    "check_inspect",
    "check_predict",
    "check_push",
    "run_checkpoint",
    "run_convert",
    "run_export",
    "run_inspect",
    "run_models",
    "run_predict",
    "run_pretrain",
    "run_pretrained",
    "run_push",
    "run_train",
]


def run_models(args) -> int:
    from keras_vit.registry.variants import VARIANTS

    header = f"{'model':<12} {'D':>5} {'layers':>6} {'heads':>5} {'MLP':>5} {'px/token':>8} {'size':>5}"
    print(f"{header}  ResNet stages")
    for name, config in sorted(VARIANTS.items()):
        stages = {None: "", (): "root only"}.get(config.resnet_stages, str(config.resnet_stages))
        print(
            f"{name:<12} {config.hidden_size:>5} {config.depth:>6} {config.num_heads:>5} "
            f"{config.mlp_dim:>5} {config.stride:>8} {config.image_hw[0]:>5}  {stages}"
        )
    return 0


def run_pretrained(args) -> int:
    from keras_vit.registry import catalog

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


def check_checkpoint(args) -> None:
    existing_file("checkpoint", args.checkpoint)


def run_checkpoint(args) -> int:
    from keras_vit.checkpoints import inspect_checkpoint

    info = inspect_checkpoint(args.checkpoint)
    for field, value in vars(info).items():
        print(f"{field}: {value}")
    return 0


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def refuse_flags(args, dests: tuple[str, ...], why: str) -> None:
    """A flag given that this mode cannot honour is an error that says so, before anything runs.

    A flag counts as given when its value is not `None` (the unset default of every flag checked
    here, switches included: `--weights false` is given).
    """
    given = [_flag(dest) for dest in dests if getattr(args, dest, None) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} cannot be used {why}.")


def _holds_weights(model: str) -> bool:
    """Whether `model` names what holds its own weights: a .keras file or a save_pretrained folder."""
    return model.endswith(".keras") or os.path.isfile(os.path.join(model, defaults.METADATA_FILE))


def _is_checkpoint(model: str) -> bool:
    """Whether `--model` names a checkpoint file (a Google .npz, timm or transformers file)."""
    return os.path.isfile(model) and not model.endswith(".keras")


def _check_model_flags(args) -> None:
    """`--model` a variant with `--weights`; or without: a .keras file, a save_pretrained folder
    or a checkpoint file (its variant found from its shapes)."""
    from keras_vit.registry.variants import VARIANTS

    if _holds_weights(args.model) or _is_checkpoint(args.model):
        kind = "a .keras file" if args.model.endswith(".keras") else "a save_pretrained folder"
        kind = "a checkpoint file" if _is_checkpoint(args.model) else kind
        refuse_flags(args, ("weights",), f"with --model {args.model}: {kind} already holds its weights")
        if args.model.endswith(".keras"):
            existing_file("--model", args.model)
    elif args.model not in VARIANTS and os.path.isdir(args.model):
        inside = os.path.join(args.model, "model.keras")
        hint = f": pass {inside}" if os.path.isfile(inside) else ""
        raise ValueError(
            f"--model {args.model} is a folder that keras_vit.save_pretrained did not write (no "
            f"keras_vit.json){hint}."
        )


def _model(args, default_weights: bool | str = True):
    """The model `--model` names (checked by `_check_model_flags`): a variant built with
    `--weights` (default `default_weights`), a .keras file (keras-vit train's model.keras), a
    save_pretrained folder or a checkpoint file."""
    from keras_vit.deploy.sharing import load_pretrained
    from keras_vit.models.build import create_model
    from keras_vit.saving import load_model

    if args.model.endswith(".keras"):
        return load_model(args.model)
    if _holds_weights(args.model):
        return load_pretrained(args.model)
    if _is_checkpoint(args.model):
        from keras_vit.checkpoints import inspect_checkpoint

        variant = inspect_checkpoint(args.model).variant
        if variant is None:
            raise ValueError(
                f"--model {args.model}: no keras_vit variant has this checkpoint's architecture; pass a "
                "variant as --model and the file as --weights."
            )
        return create_model(variant, args.model)
    return create_model(args.model, _weights(args, default_weights))


def _fetch_weights(model: str, weights) -> None:
    """The checkpoint `weights` names for a variant `model`, downloaded before the backend loads: no
    network, an unknown tag or a missing file is one line at once (the model then reads it cached)."""
    from keras_vit.registry.variants import VARIANTS

    if model in VARIANTS:
        from keras_vit.checkpoints.pretrained import fetch_pretrained

        fetch_pretrained(weights, model)


def _weights(args, default_weights: bool | str = True):
    """`--weights` as given, else `default_weights`."""
    return default_weights if args.weights is None else args.weights


def _class_names_file(args) -> str | None:
    """`--labels`, else the labels.txt keras-vit train wrote next to a .keras `--model`."""
    return args.labels or _beside(args.model, defaults.LABELS_FILE)


def _read_class_names(path: str, model) -> list[str]:
    """The class names in `path`, one per class of `model`'s head (an error naming the file if not)."""
    from keras_vit.data.preprocessing import read_labels

    names = read_labels(existing_file("the labels file", path))
    classes = int(model.output_shape[-1])
    if len(names) != classes:
        raise ValueError(
            f"{path} holds {len(names)} class names but {model.name}'s head has {classes} classes: "
            "give one name per class, in head order."
        )
    return names


def _shared_class_names(args) -> list[str] | None:
    """The class names a save_pretrained folder `--model` records, if any."""
    if args.model.endswith(".keras") or not _holds_weights(args.model):
        return None
    from keras_vit.deploy.sharing import read_metadata

    return read_metadata(args.model).get("labels")


def check_predict(args) -> None:
    if args.saved_model:
        refuse_flags(
            args,
            ("model", "weights", "labels", "max_pixels"),
            "with --saved-model: the SavedModel holds its model, weights, class names and pixel limit "
            "(export it again to change them)",
        )
    else:
        args.model = args.model or MODEL
        _check_model_flags(args)
    for path in args.images:
        existing_file("image", path)
    if args.labels:
        existing_file("the labels file", args.labels)
    if not args.saved_model:
        _fetch_weights(args.model, _weights(args))


def run_predict(args) -> int:
    if args.saved_model:
        return _predict_saved_model(args)
    from keras_vit.data.preprocessing import Preprocessing, decode_predictions, load_image, preprocess_input
    from keras_vit.registry import catalog

    model = _model(args)
    if args.weights is False:
        print(
            f"keras-vit: warning: {model.name} has random weights (--weights false): its classes are "
            "meaningless; pass --weights true, a tag or a checkpoint file for real predictions.",
            file=sys.stderr,
        )
    labels_file = _class_names_file(args)
    names = _read_class_names(labels_file, model) if labels_file else _shared_class_names(args)
    classes = int(model.output_shape[-1])
    if names is None and catalog.model_entry(model) is None:  # a new head: no shipped names
        print(
            f"keras-vit: warning: {model.name}'s {classes} classes have no names: pass --labels FILE "
            "(one name per line, in head order) to name them.",
            file=sys.stderr,
        )
        names = [""] * classes
    if args.top is not None and args.top > classes:
        raise ValueError(f"--top {args.top} is more than the {classes} classes of {model.name}.")
    top = min(5, classes) if args.top is None else args.top
    spec = Preprocessing.for_model(model)  # the checkpoint's, else the package default
    max_pixels = defaults.MAX_PIXELS if args.max_pixels is None else args.max_pixels
    for path in args.images:
        image = load_image(path, spec, max_pixels=max_pixels)
        probabilities = model.predict(preprocess_input(image[None], spec), verbose=0)
        print(path)
        decoded = decode_predictions(probabilities, top, model, class_names=names)[0]
        for index, name, probability in decoded:
            print(f"  {probability:7.2%}  {index:>5}  {name}")
    return 0


def _check_source_flags(args) -> None:
    """`convert` / `push`: the flags SOURCE's kind cannot honour are refused, before anything runs."""
    from keras_vit.registry.variants import VARIANTS

    source = args.source
    if source is None:
        return
    if source.endswith(".keras"):
        existing_file("SOURCE", source)
    if source.endswith(".keras") or source.startswith("hf-hub:") or _holds_weights(source):
        refuse_flags(
            args,
            ("model", "weights", "image_size", "num_classes"),
            f"with SOURCE {source}: it holds its model and weights as they are",
        )
    elif source in VARIANTS:
        refuse_flags(args, ("model",), f"with SOURCE {source}: SOURCE names the variant")
    else:  # a checkpoint file loaded into --model
        refuse_flags(args, ("weights",), f"with SOURCE {source}: SOURCE is the checkpoint")


def _convert_source(args):
    """The model `convert` writes: SOURCE (a variant, a .keras file, a save_pretrained folder or
    `hf-hub:` repo, or a checkpoint into --model), else --model with --weights."""
    from keras_vit.deploy.sharing import load_pretrained
    from keras_vit.models.build import create_model
    from keras_vit.registry.variants import VARIANTS
    from keras_vit.saving import load_model

    source = args.source
    args.model = args.model or MODEL
    weights = True if args.weights is None else args.weights
    sizes = dict(image_size=args.image_size, num_classes=args.num_classes)
    if source is None or source in VARIANTS:
        return create_model(source or args.model, weights, **sizes)
    if source.endswith(".keras"):
        return load_model(source)
    from keras_vit.deploy.sharing import METADATA_FILE

    if source.startswith("hf-hub:") or os.path.isfile(os.path.join(source, METADATA_FILE)):
        return load_pretrained(source, verify=args.verify)
    return create_model(args.model, source, **sizes)


def check_convert(args) -> None:
    from keras_vit.utils.files import refuse_overlap

    _check_source_flags(args)
    if not args.to:
        refuse_flags(args, ("labels",), "without --to: a .keras file holds no class names")
    (output_folder if args.to else output_file)("OUTPUT", args.output)
    refuse_overlap(args.output, [args.source, args.labels])  # before anything is read or written
    if not args.to and os.path.exists(args.output) and not args.overwrite:
        raise FileExistsError(f"{args.output} already exists: pass --overwrite to replace it.")


def run_convert(args) -> int:
    from keras_vit.utils.files import replace_file

    model = _convert_source(args)
    if args.to:
        from keras_vit.data.preprocessing import read_labels
        from keras_vit.deploy.sharing import save_pretrained

        labels = read_labels(args.labels) if args.labels else None
        save_pretrained(model, args.output, args.to, labels=labels, overwrite=args.overwrite)
        print(
            f"wrote {args.output} ({model.name} in the {args.to} format, {model.count_params():,} parameters)"
        )
        return 0
    replace_file(args.output, model.save)
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


def check_push(args) -> None:
    _check_source_flags(args)


def run_push(args) -> int:
    from keras_vit.data.preprocessing import read_labels
    from keras_vit.deploy.sharing import push_to_hub

    model = _convert_source(args)
    labels_file = args.labels or _beside(args.source, defaults.LABELS_FILE)
    report = args.report or _beside(args.source, "report.json")
    url = push_to_hub(
        model,
        args.repo_id,
        args.format,
        labels=read_labels(labels_file) if labels_file else None,
        report=report,
        private=args.private or None,
    )
    print(f"pushed {model.name} ({args.format} format) to {args.repo_id}: {url}")
    return 0


def check_inspect(args) -> None:
    args.model = args.model or MODEL
    _check_model_flags(args)
    existing_file("image", args.image)  # before the model is built and the output folder made
    output_folder("--out", args.out)
    _fetch_weights(args.model, _weights(args))


def run_inspect(args) -> int:
    from keras_vit.inspection.plots import write_inspection

    model = _model(args)
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


def _predict_saved_model(args) -> int:
    """`predict --saved-model`: the files' bytes through the export's `serving_bytes` signature."""
    import tensorflow as tf

    from keras_vit.deploy.export import BYTES_SIGNATURE, latest_version

    serve = tf.saved_model.load(latest_version(args.saved_model)).signatures[BYTES_SIGNATURE]
    for path in args.images:
        with open(path, "rb") as file:
            data = file.read()
        try:
            outputs = serve(image_bytes=tf.constant([data]))
        except tf.errors.InvalidArgumentError as error:
            raise ValueError(f"{path}: {op_error_message(error.message)}") from None
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


def _check_export_flags(args) -> None:
    """Every `export` flag is honoured by the chosen format (`EXPORT_FORMATS`), or refused here,
    before anything runs."""
    from keras_vit.deploy.formats import EXPORT_FORMATS, refused_options

    refused = refused_options(args.format)
    given = [option for option in refused if getattr(args, option, None) is not None]
    if given:
        owners = "; ".join(
            f"{_flag(option)} applies to --format {' or '.join(refused[option])}" for option in given
        )
        refuse_flags(args, tuple(given), f"with --format {args.format}: {owners}")
    args.model = args.model or MODEL
    _check_model_flags(args)
    target = EXPORT_FORMATS[args.format].target
    (output_folder if target == "folder" else output_file)("EXPORT_DIR", args.export_dir)


def check_export(args) -> None:
    from keras_vit.utils.files import refuse_overlap

    _check_export_flags(args)
    written = args.export_dir
    if args.format == "saved_model":  # what is written: one version folder
        written = os.path.join(args.export_dir, str(1 if args.version is None else args.version))
    refuse_overlap(written, [args.model, args.labels])  # before anything is read or written
    if args.labels:
        existing_file("the labels file", args.labels)
    _fetch_weights(args.model, _weights(args))


# `keras-vit export` flags whose writer argument has another name or sense.
_EXPORT_ARGUMENTS = {"no_warmup": ("warmup", lambda value: not value)}


def run_export(args) -> int:
    """`export`: the chosen format's writer (`EXPORT_FORMATS`) with the flags that format honours."""
    from keras_vit.deploy import export
    from keras_vit.deploy.formats import EXPORT_FORMATS

    row = EXPORT_FORMATS[args.format]
    model = _model(args)
    labels_file = _class_names_file(args)
    arguments = {"overwrite": args.overwrite}
    for option in row.options:
        value = getattr(args, option)
        if option == "labels":  # --labels, else the class names a save_pretrained folder records
            value = _read_class_names(labels_file, model) if labels_file else _shared_class_names(args)
        if value is not None:
            name, convert = _EXPORT_ARGUMENTS.get(option, (option, lambda given: given))
            arguments[name] = convert(value)
    if "top_k" in row.options and args.top_k is None:
        arguments["top_k"] = min(5, int(model.output_shape[-1]))
    path = getattr(export, row.writer)(model, args.export_dir, **arguments)
    if row.target == "file":
        size = os.path.getsize(path) / 2**20
        print(f"wrote {path} ({model.name}, {args.format}, input {model.input_shape[1:]}, {size:.1f} MiB)")
        return 0
    found = f"; class names from {labels_file}" if labels_file and not args.labels else ""
    print(f"wrote {path} ({model.name}, input {model.input_shape[1:]}, top {arguments['top_k']}{found})")
    return 0


def _model_config(args):
    """The architecture named by `--model` with the custom sizes given on the command line."""
    from keras_vit.registry.variants import model_config

    return model_config(
        args.model,
        patch_size=args.patch_size,
        hidden_size=args.hidden_size,
        depth=args.depth,
        num_heads=args.heads,
        mlp_dim=args.mlp_dim,
    )


def _options(args) -> dict:
    """The run options of the command (`keras_vit.training.options`), by name, as parsed."""
    from keras_vit.training.options import option_fields

    return {field.name: getattr(args, field.name) for field, _ in option_fields(args.options_class)}


def check_run_options(args) -> None:
    """The training commands' checks before the backend is imported: a multi-process run's flags
    (`--coordinator`, `--num-processes`, `--process-id` or their variables) go together, on JAX;
    such a run is noted in `args.multi_process` (its process then runs supervised: `main`); the
    `--pretrained` checkpoint of a variant is downloaded (`_fetch_weights`)."""
    args.multi_process = args.options_class(**_options(args)).processes()
    pretrained = getattr(args, "pretrained", None)
    if not (isinstance(pretrained, str) and pretrained.endswith(".keras")):  # a checkpoint to start from
        _fetch_weights(args.model, pretrained)


def _run_folder(args, saved_file: str) -> None:
    """Without `--output-dir`, each run gets a folder of its own: the default one, or the first of
    `vit_run-2`, `vit_run-3`, ... without a finished run (`new_run_folder`); `--output-dir` as typed."""
    if "output_dir" not in getattr(args, "given", ()):
        from keras_vit.training.runs.driver import new_run_folder

        args.output_dir = new_run_folder(args.output_dir, saved_file)


def run_train(args) -> int:
    """`train` and `finetune`: `keras_vit.training.train` with the command's recipe."""
    from keras_vit.training import classification as training

    _run_folder(args, "model.keras")
    result = training.train(_model_config(args), args.dataset, recipe=args.recipe, **_options(args))
    report = result.report
    print(
        f"held-out accuracy: {report['accuracy']:.2%} on {report['test_examples']} images "
        f"(loss {report['loss']:.4f}; {report['steps']} steps, {report['seconds']:.0f} s)"
    )
    print(f"wrote {os.path.join(args.output_dir, 'model.keras')} and report.json")
    return 0


def run_pretrain(args) -> int:
    """`pretrain`: `keras_vit.training.pretrain.pretrain` (masked patch prediction)."""
    from keras_vit.training import pretrain

    _run_folder(args, "backbone.keras")
    result = pretrain.pretrain(_model_config(args), args.dataset, **_options(args))
    report = result.report
    accuracy = "" if report["patch_accuracy"] is None else f", patch accuracy {report['patch_accuracy']:.2%}"
    print(
        f"masked patch prediction: loss {report['loss']:.4f}{accuracy} after {report['steps']} steps "
        f"({report['seconds']:.0f} s)"
    )
    print(f"wrote {os.path.join(args.output_dir, 'backbone.keras')} and report.json")
    return 0
