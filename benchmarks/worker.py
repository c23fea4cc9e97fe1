"""One competitor's long-lived benchmark process, driven by `run.py` over stdin/stdout JSON lines.

    python benchmarks/worker.py --framework keras_vit|keras_hub|timm --threads N
        [--backend tensorflow|jax|torch] [--logical-cpus 2] [--tiny]

The framework is imported once, with its thread pools set to N (TensorFlow intra- and
inter-op pools; torch intra- and inter-op threads; JAX: see `KerasWorker`). Keras workers run
on `--backend` (`KERAS_BACKEND`, default tensorflow): `TensorFlowKerasWorker` on TensorFlow,
the backend-neutral `KerasWorker` on JAX and PyTorch (torch imported before keras, TensorFlow
never). The worker then answers one JSON request per line with one JSON reply per line,
`{"ok": true, ...}` or `{"ok": false, "error": ...}`:

* `{"op": "setup", "case": NAME, "jit": bool, "warmup": n, "max_call": s[, "attention": A]
  [, "variant": V]}` builds the case's model (random weights; keras_vit with
  `attention_implementation=A`; timm with V = "fused_adamw": `AdamW(..., fused=True)`) and
  inputs, runs `warmup` (>= 1) untimed calls (the first traces and compiles) and times one
  more: reply `first_s`, `call_s` (the last), `params`, `setup_s`. A call after the first
  that takes over `max_call` seconds ends the warm-up with `too_slow` (e.g. bfloat16 on a CPU
  without bfloat16 instructions): no rounds for it.
* `{"op": "measure", "case": NAME, "jit": bool, "calls": n[, "attention": A][, "variant": V]}`:
  `seconds` for n calls.
* `{"op": "first_call", "case": NAME}`: `seconds` to build the model and predict once.
* `{"op": "quit"}`.

What one call is: inference, Keras on TensorFlow: `tf.function(lambda x: model(x,
training=False))` on a fixed float32 batch (`jit_compile=jit`), result fetched with
`.numpy()`; on JAX, the same forward as `jax.jit(model.stateless_call)`; on torch, eager under
`torch.inference_mode()` (details in `KerasWorker`); timm: `model(x)` under
`torch.inference_mode()` (and `torch.autocast("cpu", torch.bfloat16)` for bfloat16).
Training, Keras: `model.compile(AdamW, sparse cross-entropy from logits, jit_compile=jit)`,
then on TensorFlow the compiled `model.train_function` (what `model.fit` runs per step) on an
endless tf.data stream of one fixed batch, on JAX and torch `model.fit` of a generator of one
fixed batch (the same step), loss fetched at the end; timm: zero_grad, forward (autocast for
bfloat16), `F.cross_entropy`, backward, `AdamW.step()`, the last call's loss fetched after the
last call (as Keras's `fit`: no host sync per step). Both AdamW with lr 1e-3, weight decay 0.05,
no clipping; timm's AdamW is torch's default (foreach: multi-tensor kernels on CUDA) or, with
the variant "fused_adamw", `fused=True` (one fused CUDA kernel). Matmul: `MATMUL_SIZE`² operands, eager
`tf.linalg.matmul` / `torch.matmul`, synchronised after the last call. Pipeline: a fresh
iterator over `keras_vit.data.tfdata.train_pipeline` per measurement, two untimed batches, then
`calls` timed batches. Bfloat16 in Keras is the `mixed_bfloat16` policy (float32 variables
and head); in torch, autocast.

On a GPU (the GPU mode, `gpu.py`: cases of `cases.GPU_CASES`, `--tiny` for their test-size
versions) the same calls run there: Keras places tensors on the GPU itself; timm's model and
batch are moved to CUDA, float32 matmuls may use TF32 (`torch.set_float32_matmul_precision
("high")`, JAX's default on a GPU), and every inference call's result is fetched to the host
(training: the last step's loss, after the last step). timm with `jit` is
`torch.compile(model)`. A "predict" case times Keras's `model.predict` of a NumPy batch (host
copies included); matmuls are `GPU_MATMUL_SIZE`² there, also in JAX.

The protocol has the original stdout to itself: file descriptor 1 is pointed at stderr, so
library prints cannot corrupt it. The worker dies with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

from cases import ARCHS, CHANNELS, IMAGE_SIZE, NUM_CLASSES, PREDICT_STEPS, Case, lookup_case

Runner = Callable[[int], float]  # calls -> seconds
LEARNING_RATE, WEIGHT_DECAY = 1e-3, 0.05
PIPELINE_FILES = 64  # JPEG files behind the pipeline benchmark, in two class folders
PIPELINE_UNTIMED_BATCHES = 2


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the orchestrator exits, however it exits."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def random_batch(batch: int, image_size: int = IMAGE_SIZE) -> tuple:
    """The same inputs in every worker: NHWC float32 images in [-1, 1] and int labels."""
    import numpy as np

    rng = np.random.default_rng(0)
    images = rng.uniform(-1.0, 1.0, (batch, image_size, image_size, CHANNELS)).astype("float32")
    labels = rng.integers(0, NUM_CLASSES, batch).astype("int32")
    return images, labels


def timed(step: Callable[[], object], finish: Callable[[object], object] = lambda result: result) -> Runner:
    """A runner that calls `step` `calls` times, then `finish`es the last result, and returns seconds."""

    def run(calls: int) -> float:
        start = time.perf_counter()
        result = None
        for _ in range(calls):
            result = step()
        finish(result)
        return time.perf_counter() - start

    return run


def fit_runner(fit: Callable, x, y) -> Runner:
    """A runner of `fit` (a model's `fit`) for `calls` steps of the one batch `(x, y)`, already a
    backend tensor; the last loss is fetched to the host, so every step has run."""

    def batches():
        while True:
            yield x, y

    def run(calls: int) -> float:
        start = time.perf_counter()
        history = fit(batches(), epochs=1, steps_per_epoch=calls, verbose=0, shuffle=False)
        float(history.history["loss"][-1])
        return time.perf_counter() - start

    return run


def set_torch_threads(torch, threads: int) -> None:
    """`threads` intra- and inter-op threads; the inter-op count only where it differs (PyTorch refuses to
    set it twice, as a second worker in one process would: `gpu_torch_profile.py`)."""
    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() != threads:
        torch.set_num_interop_threads(threads)


def torch_versions(torch) -> dict:
    """torch's version, and on CUDA the CUDA and cuDNN versions it was built with and the GPU."""
    versions = {"torch": torch.__version__}
    if torch.cuda.is_available():
        versions.update(
            torch_cuda=torch.version.cuda,
            torch_cudnn=torch.backends.cudnn.version(),
            torch_device=torch.cuda.get_device_name(0),
        )
    return versions


class KerasWorker:
    """keras_vit or keras_hub on the process's Keras backend, backend-neutral (JAX, PyTorch).

    Keras's backend is fixed once per process, before `import keras`: `KERAS_BACKEND` is set
    here from `--backend` (and by `run.py` in the worker's environment). Threads, per backend:

    * torch: imported first (before keras; never TensorFlow, which with torch 2.14 segfaults
      torch's compiler stack when imported before it), then `torch.set_num_threads(N)` and
      `torch.set_num_interop_threads(N)`, as in the timm worker.
    * JAX: XLA's CPU client sizes its Eigen intra-op pool by the CPUs the process may run on
      and has no thread-count option (`--xla_cpu_multi_thread_eigen=false` only drops it to
      one thread). So the worker uses all of its CPUs (N = the machine's by default), and with
      N below that it first pins itself to N of them (`os.sched_setaffinity`, before importing
      jax: the pool then has N threads).

    The timed step is each backend's fast path, the one Keras itself compiles for
    `predict_on_batch` / `train_on_batch`, with the batch already a backend tensor (as the
    TensorFlow worker's `tf.constant`) and the result fetched to the host every call:

    * inference, JAX: `jax.jit` of `model.stateless_call(trainable, non_trainable, x,
      training=False)`, the body of Keras's JAX `predict_step`, without the per-call NumPy to
      device copy and state bookkeeping of `predict_on_batch`; XLA compiles the whole forward.
    * inference, torch: `model(x, training=False)` under `torch.inference_mode()`, eagerly:
      what `predict_on_batch` runs (it uses `no_grad`; inference mode, as timm's worker, also
      skips version counters). With `jit_compile=True` (the GPU mode's `keras_vit_torch_compiled`)
      a ViT's forward pass runs through `torch.compile` (`ViT.compile`; Keras's step stays
      eager), in inference and training.
    * training: `model.compile(AdamW(1e-3, weight_decay=0.05), sparse cross-entropy from logits,
      jit_compile=jit)`, then `model.fit` of `calls` steps of the same device-resident batch (a
      generator; the loss fetched to the host at the end): on JAX one `jax.jit`-compiled step
      (forward, backward, AdamW) with donated state per batch, on torch eager forward,
      `loss.backward()` and the AdamW update (`torch._foreach_*` ops; keras_vit's `AdamW`, Keras's
      bit for bit with less host work, where it has one). Not `train_on_batch`: it
      copies the whole state back into the model's variables and fetches the logs every call,
      which on a GPU stalls the device (measured: 34.4 against 23.4 ms of kernels per ViT-B/16
      step, `benchmarks/gpu_profile.py`).

    JAX always runs with `jit` (XLA; eager JAX is not a mode anyone trains in); `jit` on torch
    (`torch.compile`) is refused.
    """

    def __init__(self, framework: str, threads: int, logical_cpus: int, backend: str):
        os.environ["KERAS_BACKEND"] = backend  # before `import keras`, wherever it happens
        self.framework, self.backend = framework, backend
        self.import_backend(threads, logical_cpus)
        import keras

        if keras.backend.backend() != backend:
            raise RuntimeError(f"Keras runs on {keras.backend.backend()}, not {backend}.")
        self.keras = keras
        if framework == "keras_hub":
            import keras_hub

            self.library = keras_hub
        else:
            import keras_vit

            self.library = keras_vit
        self.models: dict[tuple, object] = {}

    def import_backend(self, threads: int, logical_cpus: int) -> None:
        """Import the backend's framework with `threads` threads, before keras."""
        if logical_cpus > 1:
            raise ValueError("Logical CPUs (MirroredStrategy) are a TensorFlow setting.")
        if self.backend == "torch":
            import torch

            set_torch_threads(torch, threads)
            if torch.cuda.is_available():
                torch.set_float32_matmul_precision("high")  # TF32, as JAX's float32 default on a GPU
            self.torch = torch
        elif self.backend == "jax":
            cpus = sorted(os.sched_getaffinity(0))
            if threads < len(cpus):
                os.sched_setaffinity(0, cpus[:threads])
            import jax

            self.jax = jax
        else:
            raise ValueError(f"Unknown Keras backend {self.backend!r}.")

    def versions(self) -> dict:
        import numpy

        versions = {
            "keras": self.keras.__version__,
            self.framework: getattr(self.library, "__version__", "unknown"),
            "numpy": numpy.__version__,
        }
        if self.backend == "torch":
            versions.update(torch_versions(self.torch))
        elif self.backend == "jax":
            import jaxlib

            versions.update(jax=self.jax.__version__, jaxlib=jaxlib.__version__)
            versions["jax_devices"] = [str(device) for device in self.jax.devices()]
        return versions

    def build(self, case: Case, attention: str = "auto", image_dtype: str = "float32"):
        """The case's classifier with random weights, under the case's dtype policy.

        keras_vit: with `attention_implementation=attention` and `image_dtype` where not the
        defaults (so the CPU benchmark also runs older keras_vit versions, for before/after runs).
        """
        keras = self.keras
        arch, image_size = ARCHS[case.arch], case.image_size
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy("mixed_bfloat16" if case.precision == "bfloat16" else "float32")
        try:
            if self.framework == "keras_vit":
                dims = dict(
                    patch_size=arch.patch_size,
                    hidden_size=arch.hidden_size,
                    depth=arch.depth,
                    num_heads=arch.num_heads,
                    mlp_dim=arch.mlp_dim,
                )
                # The public catalog (survives keras_vit's restructure); older versions: the module's.
                catalog = getattr(self.library, "VARIANTS", None) or self.library.variants.VARIANTS
                config = catalog[arch.base or case.arch]
                if arch.base:
                    config = config.replace(**dims)
                actual = tuple(getattr(config, field) for field in dims)
                if actual != tuple(dims.values()):
                    raise ValueError(
                        f"benchmarks/cases.py has {case.arch} as {tuple(dims.values())}, keras_vit {actual}."
                    )
                options = {"attention_implementation": attention, "image_dtype": image_dtype}
                options = {key: value for key, value in options.items() if value not in ("auto", "float32")}
                return self.library.create_model(
                    config,
                    image_size=image_size,
                    num_classes=NUM_CLASSES,
                    classifier_activation=None,  # logits, as the other libraries' models and the loss
                    **options,
                )
            if attention != "auto" or image_dtype != "float32":
                raise ValueError("Attention implementations and uint8 inputs are keras_vit options.")
            backbone = self.library.models.ViTBackbone(
                image_shape=(image_size, image_size, CHANNELS),
                patch_size=arch.patch_size,
                num_layers=arch.depth,
                num_heads=arch.num_heads,
                hidden_dim=arch.hidden_size,
                mlp_dim=arch.mlp_dim,
            )
            # A float32 head with logits, as keras_vit's.
            return self.library.models.ViTImageClassifier(
                backbone=backbone, num_classes=NUM_CLASSES, activation=None, head_dtype="float32"
            )
        finally:
            keras.config.set_dtype_policy(previous)

    def _cached_model(self, case: Case, attention: str = "auto"):
        key = ("infer", case.arch, case.precision, case.image_size, attention)
        if key not in self.models:
            self.models[key] = self.build(case, attention)
        return self.models[key]

    def runner(
        self, case: Case, jit: bool, attention: str = "auto", variant: str = ""
    ) -> tuple[Runner, int | None]:
        """The case's timed runner and the model's parameter count (None without a model)."""
        if variant:
            raise ValueError(f"The Keras workers have no variant {variant!r}.")
        if self.backend == "jax" and case.kind == "matmul":
            return self._jax_matmul_runner(case), None
        if case.kind not in ("infer", "train", "predict"):
            raise ValueError(f"The {self.backend} Keras worker cannot run {case.kind!r} cases.")
        if self.backend == "jax" and not jit:
            raise ValueError("Keras on JAX is benchmarked compiled (jit), as it runs by default.")
        if self.backend == "torch" and jit and case.kind == "predict":
            raise ValueError("torch.compile (jit_compile=True on torch) is benchmarked in infer and train.")
        images, labels = random_batch(case.batch, case.image_size)
        if case.kind == "infer":
            return self._infer_runner(case, jit, images, attention)
        if case.kind == "predict":
            return self._predict_runner(case, images, attention)
        return self._train_runner(case, jit, images, labels, attention)

    def _jax_matmul_runner(self, case: Case) -> Runner:
        """`matmul_size`² product in the case's precision (float32: JAX's default precision, TF32 on
        a GPU), synchronised after the last call."""
        jax = self.jax
        dtype = "bfloat16" if case.precision == "bfloat16" else "float32"
        a, b = (jax.random.normal(jax.random.key(seed), (case.matmul_size,) * 2, dtype) for seed in (1, 2))
        product = jax.jit(jax.numpy.matmul)
        return timed(lambda: product(a, b), lambda result: result.block_until_ready())

    def _predict_runner(self, case: Case, images, attention: str) -> tuple[Runner, int]:
        """Keras's `model.predict` of a NumPy batch on the host, in `PREDICT_STEPS` batches: float32
        images, or uint8 pixels to a model built with `image_dtype="uint8"`."""
        import numpy as np

        if case.host_dtype == "uint8":
            images = np.random.default_rng(0).integers(0, 256, images.shape).astype("uint8")
        model = self.build(case, attention, image_dtype=case.host_dtype)
        batch_size = case.batch // PREDICT_STEPS
        return timed(lambda: model.predict(images, batch_size=batch_size, verbose=0)), model.count_params()

    def _infer_runner(self, case: Case, jit: bool, images, attention: str = "auto") -> tuple[Runner, int]:
        import numpy as np

        model = self._cached_model(case, attention)
        if self.backend == "jax":
            jax = self.jax
            trainable = [variable.value for variable in model.trainable_variables]
            non_trainable = [variable.value for variable in model.non_trainable_variables]

            @jax.jit
            def forward(trainable, non_trainable, x):
                return model.stateless_call(trainable, non_trainable, x, training=False)[0]

            inputs = jax.device_put(images)
            return timed(lambda: np.asarray(forward(trainable, non_trainable, inputs))), model.count_params()
        torch = self.torch
        inputs = self.keras.ops.convert_to_tensor(images)  # on Keras's torch device
        if jit:  # a model of its own: the forward pass through torch.compile (`ViT.compiled_forward`)
            model = self.build(case, attention)
            model.compile(jit_compile=True)

        def forward():
            with torch.inference_mode():
                return model(inputs, training=False).cpu().numpy()

        return timed(forward), model.count_params()

    def adamw(self):
        """The benchmark's AdamW (`LEARNING_RATE`, `WEIGHT_DECAY`): keras_vit's where the installed
        keras_vit has one (Keras's bit for bit, its PyTorch update leaner), else Keras's."""
        adamw = self.keras.optimizers.AdamW
        if self.framework == "keras_vit":
            with contextlib.suppress(ImportError):  # keras_vit before 0.2.0 has none
                from keras_vit.training.optimization import AdamW as adamw
        return adamw(learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY)

    def compiled_for_training(self, case: Case, jit: bool, attention: str = "auto"):
        """A fresh model, compiled with `adamw()` and the sparse cross-entropy from logits."""
        keras = self.keras
        model = self.build(case, attention)
        model.compile(
            optimizer=self.adamw(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit,
        )
        return model

    def _train_runner(
        self, case: Case, jit: bool, images, labels, attention: str = "auto"
    ) -> tuple[Runner, int]:
        model = self.compiled_for_training(case, jit, attention)
        x, y = (self.keras.ops.convert_to_tensor(array) for array in (images, labels))
        # keras_hub's Task.fit would map its (absent) preprocessor over the data with grain or
        # tf.data; Keras's own fit is the same training without it.
        fit = model.fit if self.framework == "keras_vit" else functools.partial(self.keras.Model.fit, model)
        return fit_runner(fit, x, y), model.count_params()

    def first_call(self, case: Case) -> float:
        images, _ = random_batch(case.batch)
        start = time.perf_counter()
        model = self.build(case)
        model.predict(images, verbose=0)
        return time.perf_counter() - start


class TensorFlowKerasWorker(KerasWorker):
    """keras_vit or keras_hub on TensorFlow; with `logical_cpus` > 1, under a MirroredStrategy.

    Threads: TensorFlow's intra- and inter-op pools. Inference: `tf.function` (`jit_compile=jit`)
    of `model(x, training=False)` on a `tf.constant` batch; training: the compiled
    `model.train_function` (what `fit` runs per step) on an endless tf.data stream of the batch;
    also the matmul and input-pipeline cases.
    """

    def import_backend(self, threads: int, logical_cpus: int) -> None:
        import tensorflow as tf

        if logical_cpus > 1:  # must precede every TensorFlow op
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * logical_cpus
            )
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        self.tf = tf
        self.strategy = (
            tf.distribute.MirroredStrategy([f"/cpu:{index}" for index in range(logical_cpus)])
            if logical_cpus > 1
            else None
        )

    def versions(self) -> dict:
        return {"tensorflow": self.tf.__version__, **super().versions()}

    def runner(
        self, case: Case, jit: bool, attention: str = "auto", variant: str = ""
    ) -> tuple[Runner, int | None]:
        """The case's timed runner and the model's parameter count (None without a model)."""
        if variant:
            raise ValueError(f"The Keras workers have no variant {variant!r}.")
        tf = self.tf
        if case.kind == "matmul":
            dtype = tf.bfloat16 if case.precision == "bfloat16" else tf.float32
            a, b = (
                tf.cast(tf.random.stateless_normal((case.matmul_size,) * 2, (seed, 0)), dtype)
                for seed in (1, 2)
            )
            return timed(lambda: tf.linalg.matmul(a, b), lambda result: result[0, 0].numpy()), None
        if case.kind == "pipeline":
            return self._pipeline_runner(case), None
        if case.kind == "gemms":
            return self._gemms_runner(case), None
        images, labels = random_batch(case.batch, case.image_size)
        if case.kind == "infer":
            return self._infer_runner(case, jit, images, attention)
        if case.kind == "train":
            return self._train_runner(case, jit, images, labels, attention)
        raise ValueError(f"{self.framework} worker cannot run {case.kind!r} cases with `setup`.")

    def _infer_runner(self, case: Case, jit: bool, images, attention: str = "auto") -> tuple[Runner, int]:
        model = self._cached_model(case, attention)
        forward = self.tf.function(lambda x: model(x, training=False), jit_compile=jit)
        inputs = self.tf.constant(images)
        return timed(lambda: forward(inputs).numpy()), model.count_params()

    def _train_runner(
        self, case: Case, jit: bool, images, labels, attention: str = "auto"
    ) -> tuple[Runner, int]:
        tf = self.tf
        scope = self.strategy.scope() if self.strategy is not None else contextlib.nullcontext()
        with scope:
            model = self.compiled_for_training(case, jit, attention)
            # Eagerly: inside the first trace each optimizer variable costs ~0.1 s to create.
            model.optimizer.build(model.trainable_variables)
        dataset = (
            tf.data.Dataset.from_tensor_slices((images, labels))
            .repeat()
            .batch(case.batch, drop_remainder=True)
        )
        if self.strategy is not None:  # the global batch is split across the replicas
            dataset = self.strategy.experimental_distribute_dataset(dataset)
        iterator = iter(dataset)
        model.make_train_function()
        return timed(lambda: float(model.train_function(iterator)["loss"])), model.count_params()

    def _gemms_runner(self, case: Case) -> Runner:
        """One call: every matrix product of the case's forward pass, in order, each layer with
        weights of its own (as in the model: no layer's weights are still in cache), eager."""
        tf, arch = self.tf, ARCHS[case.arch]
        width, heads, mlp = arch.hidden_size, arch.num_heads, arch.mlp_dim
        patches = (IMAGE_SIZE // arch.patch_size) ** 2
        rows = case.batch * (patches + 1)
        head_rows = (case.batch * heads, patches + 1, width // heads)

        def normal(*shape):
            return tf.random.stateless_normal(shape, (len(shape), sum(shape)))

        pixels = arch.patch_size**2 * CHANNELS
        embedding = normal(case.batch * patches, pixels), normal(pixels, width)
        tokens, hidden = normal(rows, width), normal(rows, mlp)
        query, key, value = normal(*head_rows), normal(*head_rows), normal(*head_rows)
        blocks = [
            [normal(width, 3 * width), normal(width, width), normal(width, mlp), normal(mlp, width)]
            for _ in range(arch.depth)
        ]
        pooled, head = normal(case.batch, width), normal(width, NUM_CLASSES)

        def forward():
            results = [tf.linalg.matmul(*embedding)]
            for qkv, output, fc1, fc2 in blocks:
                logits = tf.linalg.matmul(query, key, transpose_b=True)
                results += [
                    tf.linalg.matmul(tokens, qkv),
                    logits,
                    tf.linalg.matmul(logits, value),
                    tf.linalg.matmul(tokens, output),
                    tf.linalg.matmul(tokens, fc1),
                    tf.linalg.matmul(hidden, fc2),
                ]
            results.append(tf.linalg.matmul(pooled, head))
            return results

        return timed(forward, lambda results: [result[0, 0].numpy() for result in results])

    def _pipeline_runner(self, case: Case) -> Runner:
        if self.framework != "keras_vit":
            raise ValueError(
                "The pipeline case measures keras_vit.data.tfdata: run it in the keras_vit worker."
            )
        folder = tempfile.mkdtemp(prefix="keras_vit_bench_jpegs_")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        write_jpeg_folder(folder, PIPELINE_FILES)
        data = self.library.data
        source = data.from_directory(folder)

        def run(calls: int) -> float:
            pipeline = data.train_pipeline(source, image_size=IMAGE_SIZE, batch_size=case.batch, seed=0)
            iterator = iter(pipeline)
            for _ in range(PIPELINE_UNTIMED_BATCHES):
                next(iterator)
            start = time.perf_counter()
            for _ in range(calls):
                images, _ = next(iterator)
            images.numpy()
            seconds = time.perf_counter() - start
            del iterator  # stops the pipeline's background threads
            return seconds

        return run


class TimmWorker:
    """timm models (eager, or `torch.compile`d with `jit`) and torch matmuls, on CUDA if there is one."""

    def __init__(self, framework: str, threads: int, logical_cpus: int, backend: str = "torch"):
        import timm
        import torch

        if logical_cpus > 1:
            raise ValueError("logical CPUs are a TensorFlow setting; timm runs on one device.")
        set_torch_threads(torch, threads)
        self.torch, self.timm = torch, timm
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32, as JAX's float32 default on a GPU

    def versions(self) -> dict:
        import numpy
        import torchvision

        return {
            **torch_versions(self.torch),
            "torchvision": torchvision.__version__,
            "timm": self.timm.__version__,
            "numpy": numpy.__version__,
        }

    def autocast(self, precision: str):
        if precision == "bfloat16":
            return self.torch.autocast(self.device, dtype=self.torch.bfloat16)
        return contextlib.nullcontext()

    def build(self, arch_name: str, image_size: int = IMAGE_SIZE):
        arch = ARCHS[arch_name]
        options = {} if image_size == IMAGE_SIZE else {"img_size": image_size}
        if arch.base:  # a test-size arch: its dimensions on the timm model of its base
            options.update(
                patch_size=arch.patch_size,
                embed_dim=arch.hidden_size,
                depth=arch.depth,
                num_heads=arch.num_heads,
                mlp_ratio=arch.mlp_dim / arch.hidden_size,
            )
        model = self.timm.create_model(arch.timm_name, pretrained=False, num_classes=NUM_CLASSES, **options)
        return model.to(self.device)

    def runner(
        self, case: Case, jit: bool, attention: str = "auto", variant: str = ""
    ) -> tuple[Runner, int | None]:
        torch = self.torch
        if attention != "auto":
            raise ValueError("Attention implementations are a keras_vit option.")
        if variant not in ("", "fused_adamw"):
            raise ValueError(f"Unknown timm variant {variant!r}.")
        if variant and case.kind != "train":
            raise ValueError(f"The timm variant {variant!r} is a training set-up.")
        on_cuda = self.device == "cuda"
        if case.kind == "matmul":
            dtype = torch.bfloat16 if case.precision == "bfloat16" else torch.float32
            generator = torch.Generator().manual_seed(0)
            a, b = (
                torch.randn((case.matmul_size,) * 2, generator=generator).to(self.device, dtype)
                for _ in range(2)
            )
            finish = (lambda result: torch.cuda.synchronize()) if on_cuda else (lambda result: result)
            return timed(lambda: torch.matmul(a, b), finish), None
        images, labels = random_batch(case.batch, case.image_size)
        inputs = torch.from_numpy(images.transpose(0, 3, 1, 2).copy()).to(self.device)
        targets = torch.from_numpy(labels.astype("int64")).to(self.device)
        model = self.build(case.arch, case.image_size)
        params = sum(parameter.numel() for parameter in model.parameters())
        if case.kind == "infer":
            model.eval()
            call = torch.compile(model) if jit else model

            def forward():
                with torch.inference_mode(), self.autocast(case.precision):
                    logits = call(inputs)
                return logits.float().cpu() if on_cuda else logits  # fetched, as the Keras workers do

            return timed(forward), params
        if case.kind == "train":
            model.train()
            # torch's default on CUDA is the multi-tensor (foreach) AdamW; "fused_adamw" its fused kernel.
            fused = {"fused": True} if variant == "fused_adamw" else {}
            optimizer = torch.optim.AdamW(
                model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, **fused
            )
            call = torch.compile(model) if jit else model

            def step():
                optimizer.zero_grad(set_to_none=True)
                with self.autocast(case.precision):
                    logits = call(inputs)
                loss = torch.nn.functional.cross_entropy(logits.float(), targets)
                loss.backward()
                optimizer.step()
                return loss.detach()

            # No host sync per step (as Keras's fit): the last step's loss is fetched after the last step.
            return timed(step, lambda loss: loss.item()), params
        raise ValueError(f"The timm worker cannot run {case.kind!r} cases with `setup`.")

    def first_call(self, case: Case) -> float:
        images, _ = random_batch(case.batch)
        start = time.perf_counter()
        model = self.build(case.arch).eval()
        with self.torch.inference_mode():
            model(self.torch.from_numpy(images.transpose(0, 3, 1, 2).copy())).numpy()
        return time.perf_counter() - start


def write_jpeg_folder(folder: str, count: int) -> None:
    """`count` JPEG photos (random crops of scikit-learn's and scikit-image's bundled photos,
    shorter side 300-500 px like ImageNet's) in two class sub-folders of `folder`."""
    import numpy as np
    import skimage.data
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = list(load_sample_images().images)
    photos += [getattr(skimage.data, name)() for name in ("astronaut", "chelsea", "coffee", "rocket")]
    rng = np.random.default_rng(0)
    for index in range(count):
        photo = photos[index % len(photos)]
        height, width = photo.shape[:2]
        crop_h, crop_w = (int(side * rng.uniform(0.6, 1.0)) for side in (height, width))
        top, left = rng.integers(0, height - crop_h + 1), rng.integers(0, width - crop_w + 1)
        image = Image.fromarray(photo[top : top + crop_h, left : left + crop_w])
        scale = rng.uniform(300, 500) / min(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BICUBIC)
        class_folder = os.path.join(folder, f"class_{index % 2}")
        os.makedirs(class_folder, exist_ok=True)
        image.save(os.path.join(class_folder, f"{index:03d}.jpg"), quality=90)


FRAMEWORKS = ("keras_hub", "keras_vit", "timm")
KERAS_BACKENDS = ("tensorflow", "jax", "torch")


def start_worker(framework: str, threads: int, logical_cpus: int, backend: str):
    """The worker object of `framework` (on Keras `backend`): imports its libraries."""
    if framework == "timm":
        return TimmWorker(framework, threads, logical_cpus)
    worker = TensorFlowKerasWorker if backend == "tensorflow" else KerasWorker
    return worker(framework, threads, logical_cpus, backend)


def serve(worker, replies, tiny: bool = False) -> None:
    """Answer requests from stdin until `quit` or end of input."""
    # Cases doing the same work (e.g. single-device training, also the baseline of the mirrored
    # case) share one runner, keyed by what it runs.
    prepared: dict[tuple, dict] = {}
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "quit":
            break
        try:
            case = lookup_case(request["case"], tiny)
            attention, jit = request.get("attention", "auto"), bool(request.get("jit", False))
            variant = request.get("variant", "")
            key = (case.kind, case.arch, case.batch, case.precision, case.image_size, case.host_dtype)
            key += (case.matmul_size, attention, jit, variant)
            if op == "setup":
                start = time.perf_counter()
                if key in prepared:
                    reply = dict(prepared[key], call_s=prepared[key]["runner"](1))
                else:
                    runner, params = worker.runner(case, jit, attention, variant)
                    first_s = runner(1)  # tracing, XLA compilation
                    call_s = runner(1)
                    for _ in range(request["warmup"] - 1):
                        if call_s > request["max_call"]:
                            break  # no more of those
                        call_s = runner(1)
                    reply = {"runner": runner, "params": params, "first_s": first_s, "call_s": call_s}
                if reply["call_s"] > request["max_call"]:
                    reply["too_slow"] = True
                else:
                    prepared[key] = reply
                reply = {name: value for name, value in reply.items() if name != "runner"}
                reply["setup_s"] = time.perf_counter() - start
            elif op == "measure":
                reply = {"seconds": prepared[key]["runner"](int(request["calls"]))}
            elif op == "first_call":
                reply = {"seconds": worker.first_call(case)}
            else:
                raise ValueError(f"Unknown request {op!r}.")
            reply["ok"] = True
        except Exception as error:  # reported to the orchestrator, which goes on without this case
            message = (str(error).strip().splitlines() or [""])[0][:500]
            reply = {"ok": False, "error": f"{type(error).__name__}: {message}"}
            traceback.print_exc()
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description="A benchmark worker (started by benchmarks/run.py).")
    parser.add_argument("--framework", choices=FRAMEWORKS, required=True)
    parser.add_argument(
        "--backend", choices=KERAS_BACKENDS, default="tensorflow", help="Keras backend (Keras workers)"
    )
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--logical-cpus", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="test-size models (cases.tiny_case)")
    args = parser.parse_args()
    die_with_parent()
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # library prints go to stderr
    start = time.perf_counter()
    try:
        worker = start_worker(args.framework, args.threads, args.logical_cpus, args.backend)
        hello = {"ok": True, "pid": os.getpid(), "import_s": time.perf_counter() - start}
        hello["versions"] = worker.versions()
    except Exception as error:
        traceback.print_exc()
        hello = {"ok": False, "error": f"{type(error).__name__}: {error}"[:500]}
    replies.write(json.dumps(hello) + "\n")
    replies.flush()
    if hello["ok"]:
        serve(worker, replies, args.tiny)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    main()
