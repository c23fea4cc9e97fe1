"""Run options and recipes declared once: the library, the command line and the help agree."""

import dataclasses
import inspect

import numpy as np
import pytest

from keras_vit.cli import build_parser
from keras_vit.data import tfdata as data
from keras_vit.training import classification as training
from keras_vit.training import optimization, options, pretrain, recipes

COMMANDS = [
    ("train", options.ClassifierOptions, training.train),
    ("finetune", options.ClassifierOptions, training.finetune),
    ("pretrain", options.MaskedPatchOptions, pretrain.pretrain),
]


@pytest.mark.parametrize(
    ("command", "options_class", "function"), COMMANDS, ids=lambda v: getattr(v, "__name__", v)
)
def test_every_option_is_a_flag_with_the_library_default(command, options_class, function):
    args = build_parser().parse_args([command])
    signature = inspect.signature(function).parameters
    for field, _ in options.option_fields(options_class):
        assert getattr(args, field.name) == signature[field.name].default, field.name
    assert args.options_class is options_class and "options" in signature


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            "train",
            ["peak learning rate (default 0.003)", "stochastic depth rate (default 0.1)", "(default 100)"],
        ),
        ("finetune", ["peak learning rate (default 0.01)", "at most 500", "--pretrained", "model.keras"]),
        ("pretrain", ["peak learning rate (default 0.0002)", "(default 50)", "backbone.keras", "--target"]),
    ],
)
def test_help_names_the_command_recipe(command, expected, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for words in expected:
        assert words in text, words


def test_flags_parse_to_the_library_values():
    argv = "train --jit-compile off --steps-per-execution 4 --crop-scale 0.5 1 --no-flip --pretrained false"
    args = build_parser().parse_args([*argv.split(), "--verbose", "0", "--lr", "1e-3", "--image-size", "48"])
    assert (args.jit_compile, args.steps_per_execution, args.crop_scale) == (False, 4, [0.5, 1.0])
    assert (args.flip, args.pretrained, args.verbose) == (False, False, 0)
    assert (args.learning_rate, args.image_size) == (1e-3, 48)
    assert build_parser().parse_args(["finetune", "--pretrained", "vit_b16.augreg_in21k"]).pretrained == (
        "vit_b16.augreg_in21k"
    )


def test_checks_name_the_option():
    with pytest.raises(ValueError, match="as steps or as epochs, not both"):
        options.RunOptions(steps=2, epochs=1).check()
    with pytest.raises(ValueError, match=r"steps_per_execution must be a positive int or 'auto', got 0"):
        options.RunOptions(steps_per_execution=0).check()
    with pytest.raises(ValueError, match=r"precision must be one of"):
        options.RunOptions(precision="float16").check()
    assert options.RunOptions(strategy=object()).check()  # a strategy object is the caller's


def test_driver_functions_take_their_options_object():
    with pytest.raises(TypeError, match="takes a ClassifierOptions, got RunOptions"):
        training.train(options=options.RunOptions())
    with pytest.raises(TypeError, match="unexpected keyword argument 'learning_rates'"):
        training.train(learning_rates=0.1)
    with pytest.raises(ValueError, match="'finetune' recipe \\(sgd\\) has no weight decay"):
        training.finetune(weight_decay=0.1)


def test_recipes_give_their_values_and_their_optimizer():
    assert recipes.FROM_SCRATCH.schedule(1000) == {
        "learning_rate": 3e-3,
        "warmup_steps": 100,
        "decay": "cosine",
        "weight_decay": 0.05,
    }
    fine = recipes.FINE_TUNING.schedule(10_000, learning_rate=0.03)
    assert fine == {"learning_rate": 0.03, "warmup_steps": 500, "decay": "cosine"}  # warm-up capped
    assert recipes.FINE_TUNING.schedule(10_000, warmup_steps=0)["warmup_steps"] == 0  # 0 is 0
    adamw = recipes.FROM_SCRATCH.build_optimizer(1000, recipes.FROM_SCRATCH.schedule(1000))
    sgd = recipes.FINE_TUNING.build_optimizer(1000, fine, ema_momentum=0.99)
    assert isinstance(adamw, optimization.KernelDecayAdamW) and adamw.weight_decay == 0.05
    assert type(sgd).__name__ == "SGD" and sgd.use_ema
    assert sgd.get_config()["learning_rate"]["config"]["peak_learning_rate"] == 0.03
    assert recipes.get_recipe("finetune") is recipes.FINE_TUNING
    with pytest.raises(ValueError, match="recipe must be one of 'pretrain', 'finetune'"):
        recipes.get_recipe("masked")


def test_augmentation_is_carried_by_the_source():
    digits_train, digits_test = data.load_digits()
    assert (
        digits_train.augmentation() == {"crop_scale": (0.7, 1.0), "flip": False} == digits_test.augmentation()
    )
    photos = data.from_arrays(np.zeros((4, 8, 8, 3), "uint8"), np.array([0, 1, 0, 1]))
    assert photos.augmentation() == {"crop_scale": (0.08, 1.0), "flip": True}
    assert photos.augmentation([0.5, 1.0], False) == {"crop_scale": (0.5, 1.0), "flip": False}
    assert dataclasses.replace(photos, flip=False).augmentation(flip=True)["flip"] is True
