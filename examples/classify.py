"""Classify a real photo with a pretrained ViT-B/16.

    python examples/classify.py                      # scikit-image's cat photo, default checkpoint
    python examples/classify.py photo.jpg --weights vit_b16.augreg_in21k_ft_in1k_384
    python examples/classify.py --weights /path/to/model.safetensors   # offline, a local checkpoint

The default checkpoint (vit_b16.augreg2_in21k_ft_in1k) is downloaded once from the Hugging Face Hub.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_vit  # noqa: E402
from keras_vit.data.preprocessing import Preprocessing  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("image", nargs="?", help="an image file; default: skimage.data.chelsea()")
    parser.add_argument("--model", default="vit_b16")
    parser.add_argument("--weights", default="true", help="true, a catalog tag, a local file or a repo id")
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args(argv)

    if args.image is None:
        from skimage import data

        image, label = data.chelsea(), "skimage.data.chelsea() (a tabby cat)"
    else:
        image, label = args.image, args.image
    pretrained = True if args.weights.lower() == "true" else args.weights
    try:
        model = keras_vit.create_model(args.model, pretrained)
    except keras_vit.WeightsUnavailableError as error:
        print(error, file=sys.stderr)
        return 1

    spec = Preprocessing.for_model(model)  # the checkpoint's resize, crop and normalisation
    pixels = keras_vit.load_image(image, spec)
    probabilities = model.predict(keras_vit.preprocess_input(pixels[None], spec), verbose=0)  # softmax head
    print(f"{label} with {model.name}:")
    for index, name, probability in keras_vit.decode_predictions(probabilities, args.top, model)[0]:
        print(f"  {probability:7.2%}  {name} ({index})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
