"""Run by tests/models/test_attention.py under one Keras backend (`KERAS_BACKEND=jax|torch|tensorflow`).

    python tests/helpers/attention_worker.py OUT.json LENGTH [LENGTH ...]

For every token count and attention implementation ("fused", "fused_padded"), a
`MultiHeadSelfAttention` with random weights computes outputs and the gradients of a fixed
random projection of them (with respect to the tokens and every weight), in inference and in
training mode, next to a "plain" layer with the same weights. Float32, and on JAX matmul precision
"highest". Writes per case the largest absolute differences from the plain layer and the fused
op calls seen (a spy on `jax.nn.dot_product_attention`, PyTorch's `scaled_dot_product_attention`
or, on TensorFlow, `keras.ops.dot_product_attention`: the kernel, and the padded token count).
"""

import json
import os
import sys

BACKEND = os.environ["KERAS_BACKEND"]
if BACKEND == "torch":
    import torch  # before keras (and never TensorFlow in this process)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_vit.models.layers import MultiHeadSelfAttention  # noqa: E402

WIDTH, HEADS, BATCH = 32, 4, 2
CALLS: list[dict] = []

if BACKEND == "jax":
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    _jax_attention = jax.nn.dot_product_attention

    def _spy(query, *args, **kwargs):
        CALLS.append({"kernel": kwargs.get("implementation"), "tokens": int(query.shape[1])})
        return _jax_attention(query, *args, **kwargs)

    jax.nn.dot_product_attention = _spy
elif BACKEND == "torch":  # Keras's op must reach PyTorch's fused kernel; (batch, heads, tokens, dim) there
    _sdpa = torch.nn.functional.scaled_dot_product_attention

    def _spy(query, *args, **kwargs):
        CALLS.append({"kernel": "sdpa", "tokens": int(query.shape[2])})
        return _sdpa(query, *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = _spy
else:
    _keras_attention = keras.ops.dot_product_attention

    def _spy(query, *args, **kwargs):
        CALLS.append({"kernel": "keras", "tokens": int(query.shape[1])})
        return _keras_attention(query, *args, **kwargs)

    keras.ops.dot_product_attention = _spy


def gradients(layer: MultiHeadSelfAttention, tokens: np.ndarray, probe: np.ndarray, training: bool):
    """Outputs, and d(sum(outputs * probe)) by the tokens and by each trainable weight, as NumPy."""
    if BACKEND == "jax":
        trainable = [variable.value for variable in layer.trainable_variables]

        def loss(weights, x):
            outputs, _ = layer.stateless_call(weights, [], x, training=training)
            return (outputs * probe).sum(), outputs

        (weight_grads, token_grads), outputs = jax.grad(loss, argnums=(0, 1), has_aux=True)(
            trainable, jax.numpy.asarray(tokens)
        )
        grads = [token_grads, *weight_grads]
    elif BACKEND == "torch":
        x = torch.tensor(tokens, requires_grad=True)
        for variable in layer.trainable_variables:
            variable.value.grad = None
        outputs = layer(x, training=training)
        (outputs * torch.tensor(probe)).sum().backward()
        grads = [x.grad, *(variable.value.grad for variable in layer.trainable_variables)]
    else:
        import tensorflow as tf

        x = tf.constant(tokens)
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x, training=training)
            loss = tf.reduce_sum(outputs * probe)
        grads = tape.gradient(loss, [x, *layer.trainable_variables])
    return keras.ops.convert_to_numpy(outputs), [keras.ops.convert_to_numpy(g) for g in grads]


def main() -> None:
    out_path, lengths = sys.argv[1], [int(arg) for arg in sys.argv[2:]]
    rng = np.random.default_rng(0)
    results = []
    for length in lengths:
        tokens = rng.normal(size=(BATCH, length, WIDTH)).astype("float32")
        # Scaled so that outputs and gradients are of order 1, where a 1e-5 difference means 1e-5.
        probe = (rng.normal(size=(BATCH, length, WIDTH)) / np.sqrt(BATCH * length)).astype("float32")
        plain = MultiHeadSelfAttention(HEADS, attention_implementation="plain")
        plain.build(tokens.shape)
        plain.set_weights([rng.normal(0, 0.1, w.shape).astype("float32") for w in plain.get_weights()])
        for implementation in ("fused", "fused_padded"):
            layer = MultiHeadSelfAttention(HEADS, attention_implementation=implementation)
            layer.build(tokens.shape)
            layer.set_weights(plain.get_weights())
            for training in (False, True):
                expected, expected_grads = gradients(plain, tokens, probe, training)
                del CALLS[:]
                outputs, grads = gradients(layer, tokens, probe, training)
                results.append(
                    {
                        "length": length,
                        "implementation": implementation,
                        "training": training,
                        "output_diff": float(np.abs(outputs - expected).max()),
                        "output_scale": float(np.abs(expected).max()),
                        "gradient_diffs": [
                            float(np.abs(ours - theirs).max())
                            for ours, theirs in zip(grads, expected_grads, strict=True)
                        ],
                        "gradient_scale": float(max(np.abs(g).max() for g in expected_grads)),
                        "calls": list(CALLS),
                    }
                )
    with open(out_path, "w") as file:
        json.dump({"backend": keras.backend.backend(), "results": results}, file)


if __name__ == "__main__":
    main()
