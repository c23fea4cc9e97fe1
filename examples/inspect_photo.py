"""Look inside a ViT with a real photo (paper §4.5): four PNGs of what it attends to and learned.

    python examples/inspect_photo.py                                  # random weights, offline
    python examples/inspect_photo.py --weights /path/to/vit_b16.npz   # a local checkpoint
    python examples/inspect_photo.py --weights true                   # download the default one
    python examples/inspect_photo.py photo.jpg --model vit_s16 --out pictures
    python examples/inspect_photo.py --out docs/images --dpi 72       # the README's pictures

Writes attention_rollout.png (where the [class] token looks, Figure 6), attention_distance.png
(how far each head attends at each depth, Figure 7 right), position_embedding_similarity.png
(Figure 7 centre) and embedding_filters.png (Figure 7 left). The photo defaults to
scikit-image's `data.chelsea()` (a cat), bundled with scikit-image, so it runs without network.
Without `--weights` the model has random weights (said in the output and on every picture):
the pictures then show how an untrained ViT looks, not what training teaches it.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import keras_vit  # noqa: E402
from keras_vit.inspection.plots import DEFAULT_DPI, write_inspection  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("image", nargs="?", help="an image file; default: skimage.data.chelsea()")
    parser.add_argument("--model", default="vit_b16", help="a variant from `keras-vit models`")
    parser.add_argument(
        "--weights", default=None, help="a local checkpoint, a catalog tag, a hub repo id or 'true'"
    )
    parser.add_argument("--out", default="inspection", help="folder for the PNGs")
    parser.add_argument("--discard-ratio", type=float, default=0.0, help="rollout: drop the weakest weights")
    parser.add_argument("--dpi", type=float, default=DEFAULT_DPI, help="resolution of the PNGs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)

    if args.image is None:
        from skimage import data

        image, source = data.chelsea(), "skimage.data.chelsea() (a tabby cat)"
    else:
        image, source = args.image, args.image
    pretrained = False if args.weights is None else (True if args.weights.lower() == "true" else args.weights)
    keras.utils.set_random_seed(args.seed)
    try:
        model = keras_vit.create_model(args.model, pretrained)
    except keras_vit.WeightsUnavailableError as error:
        print(error, file=sys.stderr)
        return 1
    if pretrained is False:
        label = f"{model.name}, random weights"
        print(f"{model.name} has random weights (no --weights given): the pictures show an untrained model.")
    else:
        label = model.name
    written = write_inspection(
        model, image, args.out, discard_ratio=args.discard_ratio, label=label, dpi=args.dpi
    )
    print(f"{source} through {label}:")
    for path in written.values():
        print(f"  wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
