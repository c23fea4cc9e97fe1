"""Keras-free helpers shared by every part: argument checks (`validation`), the defaults the library
and the CLI share (`defaults`), files written atomically and checked (`files`), the environment
(install advice, backend, versions: `environment`), downloads from the Hugging Face Hub (`hub`),
package faces (`lazy`) and the tf2onnx converters our graphs need (`tf2onnx_ops`). Nothing here
imports another part of keras_vit."""

from keras_vit.utils.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__, {}, submodules=("defaults", "environment", "files", "hub", "lazy", "tf2onnx_ops", "validation")
)
