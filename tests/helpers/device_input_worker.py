"""One mixup batch trained two ways on this process's Keras backend, printed as JSON: the host's
float32 batch (`train_pipeline(pixels="float32")`: normalised and mixed in NumPy) through the ViT,
and the uint8 batch with its mixup weights (`pixels="uint8"`) through `DeviceInput`, which
normalises and mixes on the device. Then the training driver's held-out metrics (uint8 evaluation
batches through `DeviceInput`, `ClassificationTask.finish`) against the ViT's on the host's
normalised float32 batches. `tests/training/test_device_input.py` runs it per backend."""

import json

import keras
import numpy as np

from keras_vit.data import pyinput
from keras_vit.data.datasets import input_module
from keras_vit.models.build import build_vit
from keras_vit.registry.catalog import preprocessing_for
from keras_vit.registry.variants import model_config
from keras_vit.training import optimization
from keras_vit.training.classification import ClassificationTask
from keras_vit.training.device_input import DeviceInput, unwrapped
from keras_vit.training.options import ClassifierOptions
from keras_vit.training.recipes import FROM_SCRATCH

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)


def compare() -> dict:
    """Loss, accuracy and the weights after one SGD step, host-mixed against device-mixed."""
    images, labels, _ = pyinput.digits_arrays()
    source = pyinput.from_arrays(images[:64], labels[:64], num_classes=10)
    options = dict(image_size=16, batch_size=16, seed=5, mixup_alpha=0.4, mean=MEAN, std=STD)
    host_x, host_y = pyinput.train_pipeline(source, **options).batch(1, 2)
    device_x, device_y = pyinput.train_pipeline(source, pixels="uint8", **options).batch(1, 2)
    config = model_config("vit_digits", image_size=16, patch_size=4)
    keras.utils.set_random_seed(0)
    network = build_vit(config, num_classes=10, classifier_activation=None)
    rng = np.random.default_rng(0)  # a random head too (the built one is zeros: every loss log 10)
    start = [w + rng.normal(0.0, 0.05, w.shape).astype(w.dtype) for w in network.get_weights()]
    network.set_weights(start)
    twin = build_vit(config, num_classes=10, classifier_activation=None)
    twin.set_weights(start)
    trainer = DeviceInput(twin, MEAN, STD, num_classes=10)
    results = {}
    for name, model, x, y in (("host", network, host_x, host_y), ("device", trainer, device_x, device_y)):
        model.compile(
            optimizer=keras.optimizers.SGD(0.5),
            loss=optimization.loss(),
            metrics=[optimization.LabelAccuracy()],
        )
        evaluated = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
        model.train_on_batch(x, y)
        weights = [np.asarray(keras.ops.convert_to_numpy(w), "float64") for w in model.weights]
        results[name] = {**evaluated, "weights": weights}
    host, device = results["host"], results["device"]
    return {
        "backend": keras.backend.backend(),
        "host_images_dtype": str(host_x.dtype),
        "device_images_dtype": str(device_x["images"].dtype),
        "host_loss": host["loss"],
        "device_loss": device["loss"],
        "host_accuracy": host["accuracy"],
        "device_accuracy": device["accuracy"],
        "step_moved_weights_by": max(
            float(np.abs(a - b).max()) for a, b in zip(host["weights"], start, strict=True)
        ),
        "weight_difference": max(
            float(np.abs(a - b).max()) for a, b in zip(host["weights"], device["weights"], strict=True)
        ),
    }


def evaluation() -> dict:
    """The held-out loss and accuracy `ClassificationTask.finish` reports (uint8 batches, 50 digits:
    a padded last batch) against the returned ViT's on the normalised float32 batches."""
    images, labels, _ = pyinput.digits_arrays()
    inputs = input_module()
    test = inputs.from_arrays(images[:50], labels[:50], num_classes=10)
    options = ClassifierOptions(batch_size=16)
    task = ClassificationTask(model_config("vit_digits"), (test, test), FROM_SCRATCH, options)
    task.prepare(16)
    keras.utils.set_random_seed(0)
    network = task.build()
    rng = np.random.default_rng(1)  # a random head (the built one is zeros)
    network.set_weights([w + rng.normal(0.0, 0.05, w.shape).astype(w.dtype) for w in network.get_weights()])
    task.compile(network, total_steps=1, jit_compile=False, steps_per_execution=1)
    reported = task.finish(network, {})
    model = unwrapped(network)
    spec = preprocessing_for(model).replace(crop_pct=None, resampler="tensorflow")
    floats = inputs.eval_pipeline(test, spec, batch_size=16)
    floats = list(floats) if inputs is not pyinput else [floats[index] for index in range(len(floats))]
    logits = np.concatenate([keras.ops.convert_to_numpy(model(x)) for x, _ in floats])
    truth = np.asarray(labels[:50])
    return {
        "evaluation_dtype": keras.backend.standardize_dtype(floats[0][0].dtype),
        "reported_loss": reported["loss"],
        "float_loss": float(keras.ops.convert_to_numpy(model.loss(truth, logits))),
        "reported_accuracy": reported["accuracy"],
        "float_accuracy": float((logits.argmax(axis=-1) == truth).mean()),
    }


if __name__ == "__main__":
    print(json.dumps({**compare(), **evaluation()}))
