"""The install: TensorFlow is an extra (setup.cfg), the JAX and PyTorch extras carry what their main job
needs, and a TensorFlow feature asked for without TensorFlow names the extra to install."""

import configparser
import pathlib

from keras_vit.cli.startup import error_message

SETUP = pathlib.Path(__file__).resolve().parents[1] / "setup.cfg"


def _requirements() -> tuple[list[str], dict[str, list[str]]]:
    config = configparser.ConfigParser()
    config.read(SETUP)
    required = config["options"]["install_requires"].split()
    extras = {name: value.split() for name, value in config["options.extras_require"].items()}
    return required, extras


def test_tensorflow_is_an_extra_and_the_other_backends_install_their_main_job():
    required, extras = _requirements()
    assert not [name for name in required if name.startswith("tensorflow")]
    assert "importlib_resources" not in required and "tqdm" not in required  # nothing imports them
    assert any(name.startswith("tensorflow>=") for name in extras["tensorflow"])
    for backend in ("jax", "torch"):
        assert "scikit-learn" in extras[backend]  # the main job's digits
        assert not [name for name in extras[backend] if name.startswith("tensorflow")]


def test_missing_tensorflow_names_the_extra():
    message = error_message(ModuleNotFoundError("No module named 'tensorflow'", name="tensorflow"))
    assert message.startswith("This command needs TensorFlow, which is not installed: pip install")
    assert "[tensorflow]" in message
