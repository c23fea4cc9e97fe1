"""tf2onnx converters for the TensorFlow ops keras_vit's graphs hold and tf2onnx 1.17 cannot convert.

The exact GELU of TensorFlow (`tf.nn.gelu(approximate=False)`, what `keras.ops.gelu` runs on the
TensorFlow backend) computes `0.5 * x * erfc(-x / sqrt(2))`. tf2onnx 1.17 has no converter for
`Erfc`: it logs "Tensorflow op [...Erfc] is not supported" and leaves the node in the graph,
which onnxruntime then rejects ("No Op registered for Erfc"). ONNX has `Erf` (opset 9+), and
`Erfc(x) = 1 - Erf(x)`.

tf2onnx's converters are process-wide, so `register()` must run before a conversion: Keras's
`model.export(format="onnx")` on a keras_vit model (`keras_vit.ViT.export`) and
`keras_vit.export_onnx` call it. Importing this module imports nothing heavy; `register()`
imports tf2onnx (and so TensorFlow), and does nothing where tf2onnx is not installed (Keras then
says what to install).
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["register"]


@functools.lru_cache(maxsize=1)
def register() -> bool:
    """Register the converters with tf2onnx (once per process); `False` if tf2onnx is not installed."""
    try:
        from tf2onnx import utils
        from tf2onnx.handler import tf_op
    except ImportError:
        return False

    @tf_op("Erfc")
    class Erfc:
        @classmethod
        def version_9(cls, ctx, node, **kwargs):
            node.type = "Erf"
            dtype = ctx.get_dtype(node.output[0])
            one = ctx.make_const(
                utils.make_name(f"{node.name}_one"), np.array(1, utils.map_onnx_to_numpy_type(dtype))
            )
            complement = ctx.insert_new_node_on_output(
                "Sub",
                node.output[0],
                name=utils.make_name(f"{node.name}_complement"),
                inputs=[one.output[0], node.output[0]],
            )
            ctx.set_dtype(complement.output[0], dtype)
            ctx.copy_shape(node.output[0], complement.output[0])

    return True
