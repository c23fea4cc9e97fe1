"""`keras-vit`: the command line for the common jobs (list models and checkpoints, predict, convert)."""

from __future__ import annotations

import argparse
import os
import sys


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

    print(f"{'model':<12} {'D':>5} {'layers':>6} {'heads':>5} {'MLP':>5} {'patch':>5}  ResNet stages")
    for name, config in sorted(VARIANTS.items()):
        stages = "" if config.resnet_stages is None else str(config.resnet_stages)
        print(
            f"{name:<12} {config.hidden_size:>5} {config.depth:>6} {config.num_heads:>5} "
            f"{config.mlp_dim:>5} {config.patch_size:>5}  {stages}"
        )
    return 0


def _cmd_pretrained(args) -> int:
    from keras_vit import pretrained

    if args.markdown:
        print(pretrained.catalog_markdown())
        return 0
    for tag in pretrained.list_pretrained(args.variant):
        entry = pretrained.get_entry(tag)
        classes = entry.num_classes or "no head"
        print(f"{tag:<48} {entry.resolution:>4}px {classes!s:>7}  {entry.hub_repo}")
    return 0


def _cmd_checkpoint(args) -> int:
    from keras_vit.converters import inspect_checkpoint

    info = inspect_checkpoint(args.checkpoint)
    for field, value in vars(info).items():
        print(f"{field}: {value}")
    return 0


def _cmd_predict(args) -> int:
    import keras_vit
    from keras_vit.pretrained import model_entry

    model = keras_vit.create_model(args.model, args.weights)
    entry = model_entry(model)
    height, width = model.input_shape[1:3]
    crop_pct = entry.crop_pct if entry is not None else 0.9
    interpolation = (entry.interpolation if entry is not None else None) or "bicubic"
    for path in args.images:
        image = keras_vit.load_image(path, (height, width), crop_pct, interpolation)
        logits = model.predict(keras_vit.preprocess_input(image[None], model), verbose=0)
        print(path)
        for index, name, probability in keras_vit.decode_predictions(logits, args.top, model)[0]:
            print(f"  {probability:7.2%}  {index:>5}  {name}")
    return 0


def _cmd_convert(args) -> int:
    import keras_vit

    model = keras_vit.create_model(
        args.model, args.weights, image_size=args.image_size, num_classes=args.num_classes
    )
    model.save(args.output)
    print(
        f"wrote {args.output} ({model.name}, input {model.input_shape}, {model.count_params():,} parameters)"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-vit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("models", help="list the model variants").set_defaults(run=_cmd_models)

    listing = commands.add_parser("pretrained", help="list the published checkpoints")
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
    predict.add_argument("--top", type=int, default=5)
    predict.set_defaults(run=_cmd_predict)

    convert = commands.add_parser("convert", help="write a published checkpoint as a .keras model")
    convert.add_argument("output", help="path of the .keras file to write")
    convert.add_argument("--model", default="vit_b16")
    convert.add_argument("--weights", type=_pretrained_arg, default=True, help=weights_help)
    convert.add_argument("--image-size", type=int, default=None, help="resize the position embedding")
    convert.add_argument("--num-classes", type=int, default=None, help="a new zero-initialised head")
    convert.set_defaults(run=_cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as error:  # our errors say what to do; no traceback needed
        print(f"keras-vit: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
