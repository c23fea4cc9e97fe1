"""Issue 36's experiments on keras_vit's JAX steps, without editing keras_vit: A/B of candidate changes.

    python benchmarks/gpu_experiments.py --output DIR [--cases ...] [--variants ...] [--deadline S]
        [--profile] [--tag NAME] [--tiny]          # timings (+ kernel profiles), JSON lines
    python benchmarks/gpu_experiments.py --check [--tiny]   # CPU: each variant against the stock model

Each variant is the stock model (`keras_vit.create_model`, random weights, the GPU mode's case:
`mixed_bfloat16`, AdamW 1e-3 / 0.05) with one change made from outside the package:

* `stock`: the package as it is (`attention_implementation="auto"`: on a GPU in half precision
  cuDNN flash attention, unpadded at inference, padded to 256 tokens while training);
* `plain`, `fused`, `fused_padded`: the attention forced (`attention_implementation=`);
* `heads_major`: every `MultiHeadSelfAttention` swapped for `HeadsMajorAttention` below: one
  einsum projects the tokens to q|k|v laid out `[3, batch, heads, tokens, head_dim]`, cuDNN's
  flash attention runs on that layout (`BNTH`; padded to a multiple of 128 tokens with
  sequence-length masks while training, as "fused_padded"), and the output projection contracts
  `(heads, head_dim)` straight from it. Off a GPU (or in float32) the same layout runs softmax(q kᵀ) v
  as einsums with float32 softmax statistics, which is what `--check` compares on a CPU.
* `split_qkv`: every `MultiHeadSelfAttention` swapped for `SplitProjectionAttention` below: q, k and v
  each by a matrix product of its own (not merged by XLA: each takes the tokens through an
  `optimization_barrier` output of its own), each output `(batch, tokens, heads, head_dim)` as it is laid out,
  where the stock layer makes one product of the concatenated kernels and cuts q, k and v out of it:
  cuts that are strided, so XLA copies them for cuDNN (`loop_slice_fusion`, 1.35 ms of a 20.8 ms B/16
  inference call at batch 256 on the H200, 2026-11-28, session 17). Three narrower products instead
  of one wide one; the output projection as stock. Inference only: in training the padded attention
  copies q, k and v anyway, and `gpu_hlo.py` estimates the split step 0.5 ms slower.
* `pos_matmul` (training): every `PositionEmbedding` swapped for `MatmulGradientPositionEmbedding`
  below: the embedding's gradient, a sum over the batch, computed as a matrix product. Autodiff's
  reduce over the batch makes XLA's layout assignment lay the whole residual stream out batch-minor in
  training, so every matrix product and LayerNorm is bracketed by transposes (`input_transpose_fusion`,
  2.55 ms of the 20.7 ms B/16 step measured on the H200 on 2026-11-28; found without a GPU by
  `gpu_hlo.py`, which estimates the variant 2.3 ms faster per step).
* `pad_once` (training, on top of `pos_matmul`): where the token count is odd (197), the position
  embedding appends one zero token while training and every attention masks it by sequence lengths
  (`pad_once_classes`), so cuDNN trains on 198 tokens instead of each block padding q, k and v to 256
  and cutting the context back (the extra token's outputs reach nothing: token pooling reads the
  [class] token). `gpu_hlo.py`: pads and slices 0.3 ms less per B/16 step, attention FLOPs 40% less (what
  cuDNN makes of that, with its 128-token tiles, is for the GPU to say).
* `ln_one_pass`: every Keras `LayerNormalization` swapped for `OnePassLayerNormalization` below: the
  statistics E[x] and E[x²] from one reduction instead of the mean and then the variance about it, one
  read of the tokens less per LayerNorm (`gpu_hlo.py`: 0.49 ms of an estimated 18.6 ms B/16 inference
  call, 0.25 ms of an 18.0 ms training step; XLA's reductions ran at half the bandwidth it assumes).
* `split_ln` (inference): `split_qkv` and `ln_one_pass` together, what would move into the package if
  both win (`gpu_hlo.py`: B/16 at batch 256 18.59 -> 16.71 ms, at 384 px and batch 64 16.23 -> 14.86).

(`erf_gelu`, the exact GELU through erf in float32, was a variant here until it became keras_vit's
GELU on JAX, `layers._erf_gelu`: +11.7% B/16 inference, +2.9% training on the H200.)

An XLA flag is a process-wide setting: run this script again with `XLA_FLAGS` set and `--tag`
(the flags are recorded in every line).

Timing is the GPU mode's (`worker.py`): training is Keras's `fit` of the device-resident batch
(`compile(jit_compile=True)`), the last loss fetched after the last step; inference is `jax.jit` of
`model.stateless_call`, the logits fetched every call. Each (case, variant): one compiling call,
one more untimed, then `--rounds` measurements of at least `--min-time` s; images/s is their
median and TFLOP/s uses `cases.py`'s FLOP count. Every variant model starts from the same weights
(the stock model's, copied), so the first training step's loss and the inference logits are
compared with the stock model's in the same run (bf16 on the GPU: `loss_vs_stock`,
`logits_vs_stock` as relative differences). With `--profile`, a 5-step `fit` (or 5 inference
calls) is traced with `jax.profiler` and the device's kernel times are summed per step, by kernel
and by kind (`gpu_profile.kernel_times`, plus a finer split of XLA's fusions by what they do).

`--check` (a CPU, float32, JAX matmul precision "highest"): for B/16 at 224 px (197 tokens, batch 2)
and the test-size model at 32 and 48 px (5 and 10 tokens), each variant's logits (training=False)
and the gradients of the training loss (training=True) against the stock model with the same
(randomised) weights: the largest absolute difference over the largest absolute value (for the
gradients, over all of them: some are zero in exact arithmetic, e.g. the key bias's).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("KERAS_BACKEND", "jax")

from cases import GPU_CASES, lookup_case  # noqa: E402
from worker import KerasWorker, fit_runner, random_batch, timed  # noqa: E402

from keras_vit.utils.files import open_for_writing  # noqa: E402

TRAIN_VARIANTS = ("stock", "pos_matmul", "pad_once", "ln_one_pass", "heads_major", "plain")
INFER_VARIANTS = ("stock", "split_qkv", "ln_one_pass", "split_ln", "heads_major", "plain", "fused_padded")
VARIANTS = (
    "stock",
    "pos_matmul",
    "pad_once",
    "split_qkv",
    "ln_one_pass",
    "split_ln",
    "heads_major",
    "plain",
    "fused",
    "fused_padded",
)
CASES = ("train_b16_bf16_bs64", "infer_b16_bf16_bs256")
PROFILED_STEPS = 5
# XLA's fusions by what they do (their names say it: loop_/input_ + the ops fused), after the
# library kernels (cuDNN attention, cuBLAS GEMMs).
FINE_KINDS = (
    ("attention (cuDNN)", re.compile(r"fmha|flash|cudnn|sdpa|attention", re.I)),
    ("matmul", re.compile(r"gemm|cublas|cutlass|nvjet|matmul|xmma|sm90_|triton_gemm|dot", re.I)),
    ("transpose", re.compile(r"transpose", re.I)),
    ("reduce (LayerNorm, bias gradients, softmax)", re.compile(r"reduce", re.I)),
    ("pad / slice / concatenate", re.compile(r"pad|slice|concatenate|dynamic_update", re.I)),
    ("convert (casts)", re.compile(r"convert", re.I)),
    ("copy", re.compile(r"copy|memcpy|memset", re.I)),
    ("other elementwise fusions", re.compile(r"fusion|loop_|input_", re.I)),
)


def fine_kind(name: str) -> str:
    for kind, pattern in FINE_KINDS:
        if pattern.search(name):
            return kind
    return "other"


# --- the heads-major attention --------------------------------------------------------------------
def heads_major_class():
    """`HeadsMajorAttention`, a subclass of keras_vit's public `MultiHeadSelfAttention` (made on first
    use: keras_vit and Keras are imported then, on the process's backend)."""
    import jax
    import jax.numpy as jnp
    import keras

    import keras_vit

    class HeadsMajorAttention(keras_vit.MultiHeadSelfAttention):
        """The same weights and values; q|k|v heads-major (`[3, B, H, N, D]`) and cuDNN on `BNTH`."""

        def call(self, tokens, training=None, return_attention_scores: bool = False):
            if return_attention_scores or self._runs_sublayers() or (training and self.dropout):
                return super().call(
                    tokens, training=training, return_attention_scores=return_attention_scores
                )
            length = tokens.shape[1]
            dtype = self.compute_dtype
            scale = jnp.asarray(1.0 / np.sqrt(self.head_dim), dtype)
            pairs = ((self.query_dense, scale), (self.key_dense, 1), (self.value_dense, 1))
            kernel = jnp.stack([jnp.asarray(d.kernel) * s for d, s in pairs], axis=1)  # (D, 3, H, hd)
            bias = jnp.stack([jnp.asarray(d.bias) * s for d, s in pairs], axis=0)  # (3, H, hd)
            qkv = (
                jnp.einsum("bnd,dshk->sbhnk", jnp.asarray(tokens, dtype), kernel) + bias[:, None, :, None, :]
            )
            query, key, value = qkv[0], qkv[1], qkv[2]  # (B, H, N, hd), q scaled
            half = keras.backend.standardize_dtype(dtype) in ("bfloat16", "float16")
            if jax.default_backend() == "gpu" and half and self.head_dim % 8 == 0 and self.head_dim <= 128:
                context = self._cudnn_bnth(query, key, value, length, bool(training))
            else:
                logits = jnp.einsum("bhnk,bhmk->bhnm", query, key).astype(jnp.float32)
                weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
                context = jnp.einsum("bhnm,bhmk->bhnk", weights, value)
            output = jnp.einsum("bhnk,hkd->bnd", context, jnp.asarray(self.output_dense.kernel))
            return output + jnp.asarray(self.output_dense.bias)

        @staticmethod
        def _cudnn_bnth(query, key, value, length: int, training: bool):
            from jax._src.cudnn.fused_attention_stablehlo import MaskType
            from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

            padding = (-length) % 128 if training else 0  # cuDNN's training kernel refuses 197 tokens
            lengths, mask_type = None, MaskType.NO_MASK
            if padding:
                query, key, value = (
                    jnp.pad(t, ((0, 0), (0, 0), (0, padding), (0, 0))) for t in (query, key, value)
                )
                lengths = jnp.full((query.shape[0],), length, jnp.int32)
                mask_type = MaskType.PADDING
            context = cudnn_attention(  # (query, key, value, bias, mask, q_seqlen, kv_seqlen)
                query,
                key,
                value,
                None,
                None,
                lengths,
                lengths,
                scale=1.0,
                mask_type=mask_type,
                qkv_layout="BNTH",
            )
            return context[:, :, :length] if padding else context

    return HeadsMajorAttention


# --- q, k and v by products of their own ------------------------------------------------------------
def split_projection_class():
    """`SplitProjectionAttention`, a subclass of keras_vit's public `MultiHeadSelfAttention` (made on
    first use, as `heads_major_class`)."""
    import jax
    from keras import ops

    import keras_vit
    from keras_vit.models.attention import choose_attention, fused_attention

    class SplitProjectionAttention(keras_vit.MultiHeadSelfAttention):
        """The same weights and values; q, k and v each `(batch, tokens, heads, head_dim)` from a matrix
        product of its own instead of cut out of one product of the concatenated kernels. Each product
        takes the tokens through an `optimization_barrier` output of its own: products that share an
        operand XLA merges into one (k and v at 384 px), which then cannot add the biases in cuBLASLt's
        epilogue, a pass of its own over k and v (`gpu_hlo.py`: 0.68 ms of a B/16 384 px call at batch
        64). The barrier costs nothing at run time (no copy)."""

        def call(self, tokens, training=None, return_attention_scores: bool = False):
            if return_attention_scores or self._runs_sublayers() or (training and self.dropout):
                return super().call(
                    tokens, training=training, return_attention_scores=return_attention_scores
                )
            batch, length = ops.shape(tokens)[0], ops.shape(tokens)[1]
            width, heads = self.hidden_size, self.num_heads
            scale = ops.cast(1.0 / np.sqrt(self.head_dim), self.compute_dtype)
            rows = ops.reshape(tokens, (-1, width))
            pairs = ((self.query_dense, scale), (self.key_dense, 1), (self.value_dense, 1))
            query, key, value = (
                ops.reshape(
                    ops.matmul(own_rows, ops.reshape(dense.kernel, (width, width)) * factor)
                    + ops.reshape(dense.bias, (width,)) * factor,
                    (batch, length, heads, self.head_dim),
                )
                for own_rows, (dense, factor) in zip(
                    jax.lax.optimization_barrier((rows, rows, rows)), pairs, strict=True
                )
            )
            implementation = choose_attention(
                self.attention_implementation, self.compute_dtype, bool(training), self.head_dim
            )
            if implementation == "plain":
                heads_first = [ops.transpose(t, (0, 2, 1, 3)) for t in (query, key, value)]
                context = ops.transpose(self._attend(*heads_first, training)[0], (0, 2, 1, 3))
            else:
                context = fused_attention(
                    query, key, value, padded=implementation == "fused_padded", training=bool(training)
                )
            output = ops.matmul(
                ops.reshape(context, (-1, width)), ops.reshape(self.output_dense.kernel, (width, width))
            )
            return ops.reshape(output + self.output_dense.bias, (batch, length, width))

    return SplitProjectionAttention


# --- the position embedding's gradient as a matrix product -----------------------------------------
def position_matmul_class():
    """`MatmulGradientPositionEmbedding`, a subclass of keras_vit's public `PositionEmbedding` (made on
    first use, as `heads_major_class`)."""
    import jax
    import jax.numpy as jnp
    from keras import ops

    import keras_vit

    @jax.custom_vjp
    def add_position(tokens, embedding):
        return tokens + embedding

    def forward(tokens, embedding):
        return tokens + embedding, None

    def backward(_, grad):
        # The embedding's gradient, the sum over the batch, as a matrix product. Autodiff's reduce over
        # the batch makes XLA's GPU layout assignment keep the whole residual stream batch-minor in
        # training, with transposes around every matrix product (2.55 ms of the 20.7 ms B/16 step measured
        # on the H200, 2.36 ms by `gpu_hlo.py`). Two rows of ones: XLA rewrites a one-row product into
        # that reduce again.
        batch = grad.shape[0]
        summed = jax.lax.dot_general(
            jnp.ones((2, batch), grad.dtype),
            grad.reshape(batch, -1),
            (((1,), (0,)), ((), ())),
            precision=jax.lax.Precision.HIGHEST,  # float32 stays float32 (no TF32)
            preferred_element_type=jnp.float32,
        )[0]
        return grad, summed.reshape((1, *grad.shape[1:])).astype(grad.dtype)

    add_position.defvjp(forward, backward)

    class MatmulGradientPositionEmbedding(keras_vit.PositionEmbedding):
        """The same values and gradients; the embedding's gradient by a matrix product over the batch."""

        def call(self, tokens):
            return add_position(tokens, ops.cast(self.embedding, tokens.dtype))

    return MatmulGradientPositionEmbedding


# --- tokens padded once for the attention, not in every block ---------------------------------------
def pad_once_classes(num_tokens: int):
    """`PadOncePositionEmbedding` and `PadOnceAttention` for a model of `num_tokens` tokens: where the count
    is odd (197), while training the position embedding appends one zero token and every attention masks it
    by sequence lengths, so cuDNN trains on an even count without padding q, k and v to 256 and cutting
    the context back in each block. The extra token's outputs reach nothing (token pooling reads the
    [class] token), so its gradients are zero: the same loss and gradients."""
    import jax
    import jax.numpy as jnp
    from keras import ops

    import keras_vit
    from keras_vit.models.attention import _cudnn_takes, compute_device

    class PadOncePositionEmbedding(position_matmul_class()):
        def call(self, tokens, training=None):
            tokens = super().call(tokens)
            return jnp.pad(tokens, ((0, 0), (0, 1), (0, 0))) if training and num_tokens % 2 else tokens

    class PadOnceAttention(keras_vit.MultiHeadSelfAttention):
        def call(self, tokens, training=None, return_attention_scores: bool = False):
            if not training or tokens.shape[1] != num_tokens + 1 or self._runs_sublayers() or self.dropout:
                return super().call(
                    tokens, training=training, return_attention_scores=return_attention_scores
                )
            batch, length, width = tokens.shape
            scale = ops.cast(1.0 / np.sqrt(self.head_dim), self.compute_dtype)
            pairs = ((self.query_dense, scale), (self.key_dense, 1), (self.value_dense, 1))
            kernel = ops.concatenate([ops.reshape(d.kernel, (width, width)) * s for d, s in pairs], axis=1)
            bias = ops.concatenate([ops.reshape(d.bias, (width,)) * s for d, s in pairs], axis=0)
            qkv = ops.matmul(ops.reshape(tokens, (-1, width)), kernel) + bias
            query, key, value = ops.unstack(
                ops.reshape(qkv, (batch, length, 3, self.num_heads, self.head_dim)), 3, 2
            )
            lengths = jnp.full((batch,), num_tokens, "int32")
            cudnn = _cudnn_takes(compute_device(), query.dtype, self.head_dim)
            context = jax.nn.dot_product_attention(
                query,
                key,
                value,
                scale=1.0,
                query_seq_lengths=lengths,
                key_value_seq_lengths=lengths,
                implementation="cudnn" if cudnn else "xla",
            )
            output = ops.matmul(
                ops.reshape(context, (-1, width)), ops.reshape(self.output_dense.kernel, (width, width))
            )
            return ops.reshape(output + self.output_dense.bias, (batch, length, width))

    return {"PositionEmbedding": PadOncePositionEmbedding, "MultiHeadSelfAttention": PadOnceAttention}


# --- LayerNorm statistics in one pass -----------------------------------------------------------------
def one_pass_layer_norm_class():
    """`OnePassLayerNormalization`, a subclass of Keras's `LayerNormalization` (made on first use)."""
    import jax
    import jax.numpy as jnp
    import keras

    class OnePassLayerNormalization(keras.layers.LayerNormalization):
        """The same normalisation in float32 with E[x] and E[x²] from one reduction (variance
        E[x²] - E[x]², at least 0), where Keras takes the mean and then the variance about it: two
        reductions over the tokens before the normalising pass. One-pass variance loses accuracy where a
        row's mean is large next to its spread; `--check` compares it in float32."""

        def call(self, inputs):
            axes = self.axis if isinstance(self.axis, (list, tuple)) else [self.axis]
            if self.rms_scaling or [axis % len(inputs.shape) for axis in axes] != [len(inputs.shape) - 1]:
                return super().call(inputs)
            x = jnp.asarray(inputs, jnp.float32)
            mean = jnp.mean(x, axis=-1, keepdims=True)
            variance = jnp.maximum(jnp.mean(jnp.square(x), axis=-1, keepdims=True) - jnp.square(mean), 0.0)
            scale = jax.lax.rsqrt(variance + self.epsilon)
            if self.scale:
                scale = scale * jnp.asarray(self.gamma, jnp.float32)
            shift = -mean * scale
            if self.center:
                shift = shift + jnp.asarray(self.beta, jnp.float32)
            return (x * scale + shift).astype(self.compute_dtype)

    return OnePassLayerNormalization


# variant -> a function of the model giving the layer classes to replace (keras_vit's public ones, or
# Keras's) -> replacements
VARIANT_CLASSES = {
    "heads_major": lambda model: {"MultiHeadSelfAttention": heads_major_class()},
    "split_qkv": lambda model: {"MultiHeadSelfAttention": split_projection_class()},
    "pos_matmul": lambda model: {"PositionEmbedding": position_matmul_class()},
    "pad_once": lambda model: pad_once_classes(model.get_layer("pos_embed").num_tokens),
    "ln_one_pass": lambda model: {"LayerNormalization": one_pass_layer_norm_class()},
    "split_ln": lambda model: {
        **VARIANT_CLASSES["split_qkv"](model),
        **VARIANT_CLASSES["ln_one_pass"](model),
    },
}


def _adopt(layer, cls) -> None:
    """`layer` becomes a `cls`; Keras's record of its `call` signature (made in `Layer.__init__`: which
    arguments `__call__` passes, `training` among them) is made again for the new `call`."""
    layer.__class__ = cls
    layer._call_signature = inspect.signature(layer.call)
    layer.call_signature_parameters = list(layer._call_signature.parameters)
    layer._call_has_training_arg = "training" in layer.call_signature_parameters
    layer._call_has_context_arg = {
        arg: arg in layer.call_signature_parameters for arg in layer._call_context_args
    }


def apply_variant(model, variant: str):
    """Swap the class of the model's layers that the variant replaces (in place); the model back."""
    if variant in VARIANT_CLASSES:
        import keras

        import keras_vit

        for name, cls in VARIANT_CLASSES[variant](model).items():
            replaced, swapped = getattr(keras_vit, name, None) or getattr(keras.layers, name), 0
            for layer in model._flatten_layers(include_self=False, recursive=True):
                if type(layer) is replaced:
                    _adopt(layer, cls)
                    swapped += 1
            if not swapped:
                raise RuntimeError(f"No {name} layer to swap.")
    return model


def attention_of(variant: str) -> str:
    return variant if variant in ("plain", "fused", "fused_padded") else "auto"


# --- timing -----------------------------------------------------------------------------------------
class Experiments:
    def __init__(self, args):
        self.args = args
        self.worker = KerasWorker("keras_vit", os.cpu_count(), 1, "jax")
        self.jax, self.keras = self.worker.jax, self.worker.keras
        self.start = time.monotonic()
        self.lines = open_for_writing(os.path.join(args.output, "gpu_experiments.jsonl"), "a")
        self.reference: dict[str, dict] = {}  # case -> stock weights, loss, logits
        self.write(
            {
                "event": "start",
                "tag": args.tag,
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
                "versions": self.worker.versions(),
                "argv": sys.argv[1:],
            }
        )

    def write(self, entry: dict) -> None:
        entry = {"tag": self.args.tag, "xla_flags": os.environ.get("XLA_FLAGS", ""), **entry}
        self.lines.write(json.dumps(entry) + "\n")
        self.lines.flush()
        state = entry.get("error") or entry.get("skipped")
        if "images_per_s" in entry:
            state = f"{entry['images_per_s']['median']:.1f} images/s, {entry['tflops']:.1f} TFLOP/s"
        elif "tflops" in entry:
            state = f"{entry['tflops']:.1f} TFLOP/s"
        if state:
            print(f"  {entry.get('case', '')} {entry.get('variant', '')}: {state}", flush=True)

    def left(self) -> float:
        return self.args.deadline - (time.monotonic() - self.start)

    def matmul(self) -> None:
        case = lookup_case("matmul_bf16_8192", self.args.tiny)
        runner = self.worker.runner(case, True)[0]
        runner(2)
        seconds = min(runner(10) for _ in range(3))
        self.write(
            {
                "case": "matmul_bf16_8192",
                "variant": "jax",
                "tflops": 10 * 2 * case.matmul_size**3 / seconds / 1e12,
            }
        )

    def measure(self, run, batch: int) -> tuple[dict, int]:
        call_s = run(1)
        calls = max(1, math.ceil(self.args.min_time / call_s))
        values = [calls * batch / run(calls) for _ in range(self.args.rounds)]
        return {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "all": values,
        }, calls

    def run_case(self, case_name: str, variant: str) -> None:
        case = lookup_case(case_name, self.args.tiny)
        entry = {
            "case": case_name,
            "variant": variant,
            "attention": attention_of(variant),
            "batch": case.batch,
        }
        if self.left() < self.args.reserve:
            self.write({**entry, "skipped": f"deadline ({self.left():.0f} s left)"})
            return
        try:
            started = time.perf_counter()
            if case.kind == "train":
                result = self._train(case, case_name, variant)
            else:
                result = self._infer(case, case_name, variant)
            result["wall_s"] = time.perf_counter() - started
        except Exception as error:  # recorded; the next variant goes on
            message = (str(error).strip().splitlines() or [""])[0][:400]
            self.write({**entry, "error": f"{type(error).__name__}: {message}"})
            return
        self.write({**entry, **result})

    def _weights(self, case_name: str, model) -> str:
        """Every variant of a case starts from the same weights: the first model's, each shifted by
        N(0, 0.02) noise (the new head is zeros, which would make every logit and first loss equal)."""
        reference = self.reference.get(case_name)
        if reference is None:
            reference = self.reference[case_name] = {"weights": randomised(model.get_weights())}
        model.set_weights(reference["weights"])
        return "randomised (shared by the variants)"

    def _train(self, case, case_name: str, variant: str) -> dict:
        keras, worker = self.keras, self.worker
        model = apply_variant(worker.build(case, attention_of(variant)), variant)
        weights = self._weights(case_name, model)
        model.compile(
            optimizer=keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=True,
        )
        images, labels = random_batch(case.batch, case.image_size)
        x, y = (keras.ops.convert_to_tensor(array) for array in (images, labels))

        def batches():
            while True:
                yield x, y

        start = time.perf_counter()  # the same fit as fit_runner's, one step: it compiles the step
        history = model.fit(batches(), epochs=1, steps_per_epoch=1, verbose=0, shuffle=False)
        first_loss = float(history.history["loss"][-1])  # the forward of the stock weights
        first_s = time.perf_counter() - start
        result = {"first_s": first_s, "first_loss": first_loss, "weights": weights}
        reference = self.reference[case_name]
        if variant == "stock" or "loss" not in reference:
            reference.setdefault("loss", first_loss)
        result["loss_vs_stock"] = abs(first_loss - reference["loss"]) / abs(reference["loss"])
        run = fit_runner(model.fit, x, y)
        result["images_per_s"], result["calls"] = self.measure(run, case.batch)
        result["tflops"] = result["images_per_s"]["median"] * case.flops_per_image / 1e12
        if self.args.profile and self.left() > 15:
            result["kernels"] = self.profile(lambda: run(PROFILED_STEPS))
        return result

    def _infer(self, case, case_name: str, variant: str) -> dict:

        jax = self.jax
        model = apply_variant(self.worker.build(case, attention_of(variant)), variant)
        weights = self._weights(case_name, model)
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]

        @jax.jit
        def forward(trainable, non_trainable, x):
            return model.stateless_call(trainable, non_trainable, x, training=False)[0]

        images, _ = random_batch(case.batch, case.image_size)
        inputs = jax.device_put(images)
        start = time.perf_counter()
        logits = np.asarray(forward(trainable, non_trainable, inputs)).astype("float32")
        result = {"first_s": time.perf_counter() - start, "weights": weights}
        reference = self.reference[case_name]
        reference.setdefault("logits", logits)
        scale = float(np.abs(reference["logits"]).max()) or 1.0
        result["logits_vs_stock"] = float(np.abs(logits - reference["logits"]).max()) / scale
        run = timed(lambda: np.asarray(forward(trainable, non_trainable, inputs)))
        result["images_per_s"], result["calls"] = self.measure(run, case.batch)
        result["tflops"] = result["images_per_s"]["median"] * case.flops_per_image / 1e12
        if self.args.profile and self.left() > 15:
            result["kernels"] = self.profile(lambda: run(PROFILED_STEPS))
        return result

    def profile(self, run) -> dict:
        from gpu_profile import kernel_times

        trace_dir = tempfile.mkdtemp(prefix="keras_vit_trace_")
        with self.jax.profiler.trace(trace_dir):
            run()
        kernels = kernel_times(trace_dir, PROFILED_STEPS)
        if "error" in kernels:
            return kernels
        kernels.pop("lines", None)
        # The finer split needs every kernel, not only the top ones: read the trace once more.
        kernels["by_fine_kind_ms_per_step"] = fine_split(trace_dir, kernels["lines_used"])
        return kernels


def fine_split(trace_dir: str, lines_used: list[str]) -> dict:
    import glob

    import jax

    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    data = jax.profiler.ProfileData.from_file(path)
    totals: collections.Counter = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if f"{plane.name} | {line.name}" in lines_used:
                for event in line.events:
                    totals[fine_kind(event.name)] += event.duration_ns
    return {kind: ns / PROFILED_STEPS / 1e6 for kind, ns in totals.most_common()}


def randomised(weights: list) -> list:
    rng = np.random.default_rng(0)
    return [w + rng.normal(0, 0.02, w.shape).astype(w.dtype) for w in weights]


# --- the CPU check ------------------------------------------------------------------------------
def check(args) -> int:
    """Each variant against the stock model on a CPU, float32, matmul precision "highest"."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    worker = KerasWorker("keras_vit", os.cpu_count(), 1, "jax")
    keras = worker.keras
    import dataclasses

    rows = []
    shapes = [("train_b16_bf16_bs64", 224, 2)] if not args.tiny else []
    shapes += [("train_b16_bf16_bs64", 32, 2), ("train_b16_bf16_bs64", 48, 2)]
    for case_name, image_size, batch in shapes:
        case = GPU_CASES[case_name]
        if image_size != 224:
            case = lookup_case(case_name, tiny=True)
        case = dataclasses.replace(case, precision="float32", batch=batch, image_size=image_size)
        images, labels = random_batch(batch, image_size)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        results = {}
        for variant in VARIANTS:
            model = apply_variant(worker.build(case, attention_of(variant)), variant)
            if variant == "stock":  # random weights everywhere (the new head is zeros), then shared
                weights = randomised(model.get_weights())
            model.set_weights(weights)
            trainable = [v.value for v in model.trainable_variables]
            non_trainable = [v.value for v in model.non_trainable_variables]

            def loss(trainable, x, y, model=model, non_trainable=non_trainable, loss_fn=loss_fn):
                logits, _ = model.stateless_call(trainable, non_trainable, x, training=True)
                return loss_fn(y, logits)

            logits = model.stateless_call(trainable, non_trainable, images, training=False)[0]
            grads = jax.grad(loss)(trainable, images, labels)
            results[variant] = (np.asarray(logits), [np.asarray(g) for g in grads])
        stock_logits, stock_grads = results["stock"]
        for variant in VARIANTS[1:]:
            logits, grads = results[variant]
            logit_error = float(np.abs(logits - stock_logits).max() / np.abs(stock_logits).max())
            # Over all gradients at once: some are zero in exact arithmetic (the key bias: softmax
            # ignores a constant per query), so their own scale is rounding noise.
            grad_scale = max(float(np.abs(g).max()) for g in stock_grads)
            grad_error = (
                max(float(np.abs(g - s).max()) for g, s in zip(grads, stock_grads, strict=True)) / grad_scale
            )
            rows.append(
                {
                    "variant": variant,
                    "model": case.arch,
                    "tokens": (image_size // 16) ** 2 + 1,
                    "logits_rel": logit_error,
                    "grads_rel": grad_error,
                }
            )
            print(
                f"{variant:<13} {case.arch:<9} {rows[-1]['tokens']:>4} tokens: logits {logit_error:.2e}, "
                f"gradients {grad_error:.2e}",
                flush=True,
            )
    worst = max(max(row["logits_rel"], row["grads_rel"]) for row in rows)
    print(f"largest relative difference: {worst:.2e} ({'ok' if worst < args.tolerance else 'TOO LARGE'})")
    if args.output:
        os.makedirs(args.output, exist_ok=True)
        with open_for_writing(os.path.join(args.output, "cpu_check.json"), "w") as file:
            json.dump({"rows": rows, "largest": worst, "tolerance": args.tolerance}, file, indent=1)
    return 0 if worst < args.tolerance else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", help="folder of gpu_experiments.jsonl (or, with --check, cpu_check.json)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=sorted(GPU_CASES))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, help="default: per case kind")
    parser.add_argument("--deadline", type=float, default=300, help="seconds; later variants are skipped")
    parser.add_argument("--reserve", type=float, default=30, help="seconds a variant needs to start")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=1.0)
    parser.add_argument("--profile", action="store_true", help="kernel times of every variant")
    parser.add_argument("--matmul", action="store_true", help="the chip's bf16 matmul rate first")
    parser.add_argument("--tag", default="", help="a name for this process's settings (e.g. its XLA flags)")
    parser.add_argument("--tiny", action="store_true", help="test-size models: a CPU rehearsal")
    parser.add_argument("--check", action="store_true", help="CPU: each variant against the stock model")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args(argv)
    if args.check:
        return check(args)
    if not args.output:
        parser.error("--output is needed")
    os.makedirs(args.output, exist_ok=True)
    experiments = Experiments(args)
    if args.matmul:
        experiments.matmul()
    # Variant by variant, each over the cases (stock first: the reference weights, loss and logits),
    # so that a deadline cuts the least informative pairs.
    order = ["stock", *(args.variants or [v for v in VARIANTS if v in TRAIN_VARIANTS + INFER_VARIANTS])]
    # A variant of one kind's list runs on that kind's cases only (`pos_matmul` changes no inference).
    for variant in dict.fromkeys(order):
        for case_name in args.cases:
            own = TRAIN_VARIANTS if GPU_CASES[case_name].kind == "train" else INFER_VARIANTS
            if variant in own or (args.variants and variant not in TRAIN_VARIANTS + INFER_VARIANTS):
                experiments.run_case(case_name, variant)
    experiments.lines.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
