"""Where keras_vit runs: install advice for the optional extras, and the machine for run reports.

`install_hint("train")` is the command that installs an extra where the user is: from a source
checkout (the package's parent folder holds the `setup.cfg` of `keras-vit-zoo`) an editable
install of that checkout, `pip install -e ".[train]"` (with the checkout's path when the
current directory is elsewhere); otherwise the package-index form
`pip install "keras-vit-zoo[train]"`. Every error message and notice that suggests an install
builds it here.

`machine()` and `versions()` describe the hardware and software of a run (`report.json`).

`enable_onednn()` turns on TensorFlow's oneDNN CPU kernels (fused matmul + bias + GELU):
TensorFlow enables them by itself only on CPUs with AVX-512 VNNI/BF16 or AMX, and a ViT runs
faster with them on an AVX2-only CPU (measured in the docs). The setting is read once, when TensorFlow is
imported: the `keras-vit` command sets it first thing; a library user calls
`keras_vit.enable_onednn()` before importing TensorFlow, and `import keras_vit` notes it once
when TensorFlow was already imported with the kernels off (`TF_ENABLE_ONEDNN_OPTS` unset).

Pure Python: imports neither TensorFlow nor Keras (`versions` reads the modules already loaded).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import platform
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator

__all__ = [
    "tensorflow_loads_quietly",
    "DISTRIBUTION",
    "checkout_root",
    "cpu_model",
    "enable_onednn",
    "install_hint",
    "machine",
    "onednn_enabled",
    "keras_backend",
    "require_tensorflow_backend",
    "versions",
]

DISTRIBUTION = "keras-vit-zoo"
ONEDNN_VARIABLE = "TF_ENABLE_ONEDNN_OPTS"
_NAME_LINE = re.compile(r"^\s*name\s*=\s*(\S+)\s*$", re.MULTILINE)


@functools.lru_cache(maxsize=1)
def checkout_root() -> str | None:
    """The source checkout keras_vit is imported from, or `None` for an installed package.

    A checkout is recognised by the `setup.cfg` next to the package folder naming the
    distribution `keras-vit-zoo` (an editable install imports from the checkout too).
    """
    root = str(pathlib.Path(__file__).resolve().parents[2])  # keras_vit/utils/ -> the checkout
    try:
        with open(os.path.join(root, "setup.cfg"), encoding="utf-8") as file:
            match = _NAME_LINE.search(file.read())
    except OSError:
        return None
    return root if match and match.group(1) == DISTRIBUTION else None


def keras_backend() -> str:
    """The backend Keras runs on, or will run on once imported, found without importing it.

    As Keras decides: `KERAS_BACKEND`, else the `backend` of `keras.json` in `KERAS_HOME`
    (default `~/.keras`), else TensorFlow.
    """
    if "keras" in sys.modules:
        return sys.modules["keras"].backend.backend()
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json"), encoding="utf-8") as file:
            backend = json.load(file).get("backend")
    except (OSError, ValueError, AttributeError):
        backend = None
    return backend if isinstance(backend, str) and backend else "tensorflow"


# What TensorFlow's C++ libraries print while they load (absl INFO / WARNING lines and their preamble).
_STARTUP_NOISE = re.compile(
    r"[IW]\d{4} \d\d:\d\d:[\d.]+ +\d+ |WARNING: All log messages before absl::InitializeLog\(\)|"
    r"To enable the following instructions: |This TensorFlow binary is optimized"
)


# Whether the user chose TensorFlow's C++ log level (before keras_vit set one).
_USER_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL" in os.environ


@contextlib.contextmanager
def tensorflow_loads_quietly(level: str = "1") -> Iterator[None]:
    """While this lasts, TensorFlow's start-up lines are hidden if it loads (everything else written to
    stderr meanwhile is shown after, and all of it if something fails).

    TensorFlow's shared libraries print their INFO lines (oneDNN, "Could not find cuda drivers",
    twice, as each library loads) straight to file descriptor 2 before any log level applies.
    Nothing is hidden when TensorFlow is already imported or is not the backend, or when the
    user chose a level (`TF_CPP_MIN_LOG_LEVEL` set); else that is set to `level` (1: INFO hidden).
    """
    if "tensorflow" in sys.modules or keras_backend() != "tensorflow" or _USER_LOG_LEVEL:
        yield
        return
    ours = "TF_CPP_MIN_LOG_LEVEL" not in os.environ  # set here: taken back unless TensorFlow loaded
    if ours:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = level
    sys.stderr.flush()
    failed, saved = True, None
    with contextlib.suppress(OSError):  # no usable descriptor 2: nothing to hide
        saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        if saved is not None:
            os.dup2(caught.fileno(), 2)
        try:
            yield
            failed = False
        finally:
            if ours and "tensorflow" not in sys.modules:
                del os.environ["TF_CPP_MIN_LOG_LEVEL"]
            if saved is not None:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                caught.seek(0)
                lines = caught.read().decode(errors="replace").splitlines(keepends=True)
                shown = lines if failed else [line for line in lines if not _STARTUP_NOISE.match(line)]
                sys.stderr.write("".join(shown))


def require_tensorflow_backend(feature: str) -> None:
    """Stop at once, saying what to do, when `feature` (TensorFlow by nature) runs on another backend."""
    backend = keras_backend()
    if backend != "tensorflow":
        raise RuntimeError(
            f"{feature} needs the TensorFlow backend (it writes through TensorFlow), but Keras runs on "
            f"{backend!r}: run it with KERAS_BACKEND=tensorflow, on the model saved as .keras on {backend} "
            "(a .keras file loads on every backend; README: Training on JAX, PyTorch and TensorFlow)."
        )


def onednn_enabled() -> bool | None:
    """Whether TensorFlow's oneDNN kernels are on in this process (`None`: TensorFlow not imported)."""
    if "tensorflow" not in sys.modules:
        return None
    from tensorflow.python.util import _pywrap_util_port  # the flag TensorFlow read at import

    return bool(_pywrap_util_port.IsMklEnabled())


def _onednn_off_message() -> str:
    return (
        "TensorFlow was imported with its oneDNN CPU kernels off, which makes ViTs slower on this CPU:"
        f" set {ONEDNN_VARIABLE}=1 in the environment, or call keras_vit.enable_onednn() before "
        f"importing TensorFlow ({ONEDNN_VARIABLE}=0 silences this note)."
    )


def enable_onednn() -> bool:
    """Turn TensorFlow's oneDNN CPU kernels on, unless the user set `TF_ENABLE_ONEDNN_OPTS`.

    Effective only before TensorFlow is imported: `import keras_vit; keras_vit.enable_onednn()`
    first thing. Returns whether the kernels are (or will be) on; warns when TensorFlow is
    already imported with them off. Numerics: outputs differ from the plain kernels by float
    rounding only (the parity tests hold either way).
    """
    os.environ.setdefault(ONEDNN_VARIABLE, "1")
    enabled = onednn_enabled()
    if enabled is None:
        return os.environ[ONEDNN_VARIABLE].lower() not in ("0", "false")
    if not enabled:
        warnings.warn(_onednn_off_message(), stacklevel=2)
    return enabled


def note_onednn_off() -> None:
    """Warn once when TensorFlow is already imported with oneDNN off by default on an x86 CPU."""
    if os.environ.get(ONEDNN_VARIABLE) is not None or platform.machine().lower() not in ("x86_64", "amd64"):
        return
    if onednn_enabled() is False and os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
        warnings.warn(_onednn_off_message(), stacklevel=3)


def import_tensorflow(feature: str):
    """`import tensorflow` for `feature`; without it, a `ModuleNotFoundError` naming the extra to install
    (`tensorflow`: TensorFlow is optional, JAX and PyTorch users install without it)."""
    try:
        import tensorflow
    except ModuleNotFoundError as error:
        if error.name != "tensorflow":
            raise
        raise ModuleNotFoundError(
            f"{feature} needs TensorFlow, which is not installed: {install_hint('tensorflow')}.",
            name="tensorflow",
        ) from None
    return tensorflow


def install_hint(extra: str) -> str:
    """The pip command that installs keras_vit's optional `extra` (`train`, `plots`, `export`, ...)."""
    root = checkout_root()
    if root is None:
        return f'pip install "{DISTRIBUTION}[{extra}]"'
    try:
        here = os.path.samefile(os.getcwd(), root)
    except OSError:
        here = False
    return f'pip install -e ".[{extra}]"' if here else f'pip install -e "{root}[{extra}]"'


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; elsewhere the platform's processor name)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[dict]:
    """The GPUs TensorFlow sees (name and compute capability when it reports them); [] without TF."""
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return []
    gpus = []
    for device in tf.config.list_physical_devices("GPU"):
        entry = {"device": device.name}
        try:
            details = tf.config.experimental.get_device_details(device)
        except (RuntimeError, ValueError):
            details = {}
        if details.get("device_name"):
            entry["name"] = details["device_name"]
        if details.get("compute_capability"):
            entry["compute_capability"] = list(details["compute_capability"])
        gpus.append(entry)
    return gpus


def machine() -> dict:
    """The hardware of this process: CPU model and cores, GPUs, operating system, host name."""
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gpus": _gpus(),
        "platform": platform.platform(),
        "hostname": platform.node(),
    }


def versions() -> dict:
    """Python and the versions of keras_vit and of the frameworks loaded in this process."""
    from keras_vit.version import __version__

    found = {"python": platform.python_version(), "keras_vit": __version__}
    for module in ("keras", "tensorflow", "jax", "torch", "numpy", "tensorflow_datasets"):
        loaded = sys.modules.get(module)
        if loaded is not None:
            found[module] = getattr(loaded, "__version__", None)
    return found
