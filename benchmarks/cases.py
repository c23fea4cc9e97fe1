"""What the benchmark suite measures: architectures, competitors, cases and the FLOP count.

Shared by `run.py` (the orchestrator) and `worker.py` (one process per competitor). Plain
Python only: the timm worker and the Keras worker on the torch backend must not import
TensorFlow (with torch 2.14, TensorFlow imported before torch's compiler stack segfaults), nor
the Keras workers on TensorFlow torch.

FLOP count of a plain ViT forward pass, per image (one multiply-add = 2 FLOPs), with patch
size P, C input channels, N = (H/P)(W/P) patches, T = N + 1 tokens, width D, MLP width M,
depth L and K classes:

    patch embedding   2 N (P² C) D
    per block         2 T D (3D)  [query, key, value]  + 2 T D D  [output projection]
                      + 2 T D M · 2  [MLP]  + 2 T² D  [Q Kᵀ]  + 2 T² D  [attention · V]
                      = 8 T D² + 4 T D M + 4 T² D
    head              2 D K

    forward = 2 N P² C D + L (8 T D² + 4 T D M + 4 T² D) + 2 D K

LayerNorm, softmax, GELU, biases and residual adds are left out (under 1% for ViT-B/16).
ViT-B/16 at 224 px: 35.1 GFLOP (17.6 GMACs, timm's figure). A training step (forward,
backward = input and weight gradients, AdamW update) is counted as 3 × forward, the usual
convention; the optimizer's elementwise work is left out.

`GPU_CASES` and `GPU_COMPETITORS` are the GPU mode's (`gpu.py`): larger batches, 384 px and
ViT-L/16, Keras on JAX and PyTorch only (no TensorFlow on the GPU machines), timm eager and
compiled; `tiny_case` shrinks any case to a test-size model for rehearsing on a CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

IMAGE_SIZE = 224
NUM_CLASSES = 1000
CHANNELS = 3
MATMUL_SIZE = 2048  # square float matmul whose rate is the "hardware" reference
TRAIN_FLOP_FACTOR = 3  # forward + backward (2 x forward) per training step


@dataclass(frozen=True)
class Arch:
    """A plain ViT's dimensions and the names of the same model in timm."""

    patch_size: int
    hidden_size: int
    depth: int
    num_heads: int
    mlp_dim: int
    timm_name: str
    label: str
    base: str | None = None  # a test-size arch: the keras_vit variant it is derived from


ARCHS: dict[str, Arch] = {
    "vit_ti16": Arch(16, 192, 12, 3, 768, "vit_tiny_patch16_224", "ViT-Ti/16"),
    "vit_s16": Arch(16, 384, 12, 6, 1536, "vit_small_patch16_224", "ViT-S/16"),
    "vit_b16": Arch(16, 768, 12, 12, 3072, "vit_base_patch16_224", "ViT-B/16"),
    "vit_l16": Arch(16, 1024, 24, 16, 4096, "vit_large_patch16_224", "ViT-L/16"),
    # Rehearsals (`gpu.py --tiny`): every path of the real cases on a model that runs in seconds.
    "vit_test": Arch(16, 64, 2, 2, 128, "vit_tiny_patch16_224", "ViT test size", base="vit_ti16"),
}


def forward_flops(arch: Arch, image_size: int = IMAGE_SIZE, num_classes: int = NUM_CLASSES) -> int:
    """FLOPs of one image's forward pass (formula in the module docstring)."""
    patches = (image_size // arch.patch_size) ** 2
    tokens = patches + 1
    width, mlp = arch.hidden_size, arch.mlp_dim
    embedding = 2 * patches * arch.patch_size**2 * CHANNELS * width
    block = 8 * tokens * width**2 + 4 * tokens * width * mlp + 4 * tokens**2 * width
    return embedding + arch.depth * block + 2 * width * num_classes


@dataclass(frozen=True)
class Competitor:
    """A contestant: which worker process runs it (`framework`, Keras backend, logical CPUs) and how."""

    name: str
    framework: str  # "keras_vit", "keras_hub" or "timm": the worker's library
    family: str  # competitors of one family are alternatives the same user could pick
    jit: bool = False  # Keras: XLA (`jit_compile=True`; on JAX always)
    logical_cpus: int = 1  # > 1: a separate worker with a MirroredStrategy over logical CPUs
    label: str = ""
    backend: str = "tensorflow"  # Keras workers: KERAS_BACKEND of the worker process
    attention: str = "auto"  # keras_vit: the model's attention_implementation
    variant: str = ""  # a worker-specific set-up, e.g. timm's "fused_adamw" (AdamW(..., fused=True))

    @property
    def worker_key(self) -> tuple:
        """Competitors with one key share a worker process. Each timm + torch.compile set-up gets a
        process of its own: on an H200 (2026-11-28) the second compiled set-up in one process ran
        5-16% slower than in a fresh one (B/16 fused AdamW 2,679 after foreach vs 3,088 first)."""
        separate = (self.jit, self.variant) if self.framework == "timm" and self.jit else ()
        return (self.framework, self.logical_cpus, self.backend, *separate)


COMPETITORS: dict[str, Competitor] = {
    c.name: c
    for c in (
        Competitor("keras_vit", "keras_vit", "keras_vit", label="keras_vit"),
        Competitor("keras_vit_xla", "keras_vit", "keras_vit", jit=True, label="keras_vit XLA"),
        # The same models on Keras's other backends: a family each, as the backend is chosen
        # once per process. JAX always compiles with XLA; the torch backend runs eagerly, as
        # Keras does by default (`jit_compile="auto"`).
        Competitor(
            "keras_vit_jax", "keras_vit", "keras_vit_jax", jit=True, label="keras_vit JAX", backend="jax"
        ),
        Competitor(
            "keras_vit_torch", "keras_vit", "keras_vit_torch", label="keras_vit PyTorch", backend="torch"
        ),
        Competitor("keras_hub", "keras_hub", "keras_hub", label="keras_hub"),
        Competitor("keras_hub_xla", "keras_hub", "keras_hub", jit=True, label="keras_hub XLA"),
        Competitor("timm", "timm", "timm", label="timm", backend="torch"),  # KERAS_BACKEND if imported
        Competitor(
            "keras_vit_mirrored",
            "keras_vit",
            "keras_vit_mirrored",
            logical_cpus=2,
            label="keras_vit MirroredStrategy (2 logical CPUs)",
        ),
    )
}
XLA_COMPETITORS = ("keras_vit_xla", "keras_hub_xla")
FAMILIES = ("keras_vit", "keras_vit_jax", "keras_vit_torch", "keras_hub", "timm")


@dataclass(frozen=True)
class Case:
    """One measurement: a kind of work on one architecture, batch and precision.

    kind: "matmul" (`matmul_size`² square matmul: the framework's achievable rate), "gemms"
    (a model's forward matrix products alone, each shape as the model runs it: the rate no
    implementation of that model and batch in the framework can beat), "infer" (forward pass),
    "train" (full step), "first_call" (build + first prediction in a fresh process), "pipeline"
    (`keras_vit.data.tfdata.train_pipeline` alone, no model), "predict" (Keras `model.predict` of
    `batch` images held on the host as `host_dtype` NumPy, in `PREDICT_STEPS` batches).
    `relative_to` names a case whose keras_vit training throughput this case is compared with.
    """

    name: str
    kind: str
    title: str  # short, for tables
    description: str
    competitors: tuple[str, ...]
    arch: str | None = None
    batch: int = 1
    precision: str = "float32"  # "float32" or "bfloat16" (Keras `mixed_bfloat16`, torch autocast)
    relative_to: str | None = None
    image_size: int = IMAGE_SIZE
    matmul_size: int = MATMUL_SIZE
    host_dtype: str | None = None  # "predict": the NumPy batch's dtype ("uint8": image_dtype="uint8")

    @property
    def flops_per_image(self) -> int | None:
        """Model FLOPs per image (forward, or a training step), None for other kinds."""
        if self.kind not in ("infer", "train", "gemms", "predict"):
            return None
        factor = TRAIN_FLOP_FACTOR if self.kind == "train" else 1
        return factor * forward_flops(ARCHS[self.arch], self.image_size)

    @property
    def gemms_case(self) -> str | None:
        """The "gemms" case of this inference case's model and batch (its ceiling), if float32."""
        if self.kind != "infer" or self.precision != "float32":
            return None
        return f"gemms_{self.arch.removeprefix('vit_')}_fp32_bs{self.batch}"

    @property
    def matmul_case(self) -> str:
        """The matmul case whose TensorFlow rate this case's GFLOP/s is a share of."""
        return "matmul_bf16" if self.precision == "bfloat16" else "matmul_fp32"


# Every competitor of the model cases, in the order report.py prints their columns.
MODEL_PEERS = (
    "keras_vit",
    "keras_vit_xla",
    "keras_vit_jax",
    "keras_vit_torch",
    "keras_hub",
    "keras_hub_xla",
    "timm",
)
_PRECISION_TAGS = {"float32": "fp32", "bfloat16": "bf16"}


def _model_case(kind: str, arch: str, batch: int, precision: str) -> Case:
    what = "inference" if kind == "infer" else "training step (forward, backward, AdamW)"
    name = f"{kind}_{arch.removeprefix('vit_')}_{_PRECISION_TAGS[precision]}_bs{batch}"
    precision_label = "mixed bfloat16" if precision == "bfloat16" else precision
    title = f"{ARCHS[arch].label} {what.split()[0]}, batch {batch}, {precision_label}"
    description = f"{ARCHS[arch].label} {IMAGE_SIZE} px {what}, batch {batch}, {precision_label}"
    return Case(name, kind, title, description, MODEL_PEERS, arch, batch, precision)


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case(
            "matmul_fp32",
            "matmul",
            f"{MATMUL_SIZE}³ matmul, float32",
            f"{MATMUL_SIZE}³ float32 matmul (TensorFlow in the keras_vit worker, PyTorch in timm's)",
            ("keras_vit", "timm"),
        ),
        Case(
            "matmul_bf16",
            "matmul",
            f"{MATMUL_SIZE}³ matmul, bfloat16",
            f"{MATMUL_SIZE}³ bfloat16 matmul (TensorFlow, in the keras_vit worker)",
            ("keras_vit",),
            precision="bfloat16",
        ),
        *(
            Case(
                f"gemms_b16_fp32_bs{batch}",
                "gemms",
                f"ViT-B/16 matrix products alone, batch {batch}, float32",
                f"ViT-B/16 {IMAGE_SIZE} px forward matrix products alone (patch embedding, per block "
                f"q|k|v, q·kᵀ, attention·v, output projection, MLP; head), batch {batch}, float32, "
                "eager TensorFlow: the ceiling of any TensorFlow ViT-B/16 at this batch",
                ("keras_vit",),
                "vit_b16",
                batch,
            )
            for batch in (1, 16)
        ),
        _model_case("infer", "vit_b16", 1, "float32"),
        _model_case("infer", "vit_b16", 16, "float32"),
        _model_case("infer", "vit_b16", 1, "bfloat16"),
        _model_case("infer", "vit_b16", 16, "bfloat16"),
        _model_case("infer", "vit_s16", 16, "float32"),
        _model_case("infer", "vit_ti16", 16, "float32"),
        Case(
            "first_call_b16_fp32_bs1",
            "first_call",
            "ViT-B/16 first call (fresh process: build + predict 1 image)",
            f"ViT-B/16 first-call latency: build (random weights) + first prediction of 1 image "
            f"at {IMAGE_SIZE} px, in a fresh process (Keras: model.predict)",
            ("keras_vit", "keras_vit_jax", "keras_vit_torch", "keras_hub", "timm"),
            "vit_b16",
        ),
        _model_case("train", "vit_s16", 32, "float32"),
        _model_case("train", "vit_ti16", 32, "float32"),  # small: smoke tests of the training path
        _model_case("train", "vit_s16", 32, "bfloat16"),
        Case(
            "train_s16_fp32_bs32_mirrored",
            "train",
            "ViT-S/16 training, batch 32, float32, MirroredStrategy (2 logical CPUs)",
            f"ViT-S/16 {IMAGE_SIZE} px training step, global batch 32, float32, under MirroredStrategy "
            "over 2 logical CPUs vs one device",
            ("keras_vit_mirrored", "keras_vit"),
            "vit_s16",
            32,
        ),
        Case(
            "pipeline_bs32",
            "pipeline",
            f"Input pipeline alone (JPEG files → {IMAGE_SIZE} px, augmented), batch 32",
            f"data.tfdata.train_pipeline alone: JPEG files decoded, inception crop, flip, resize to "
            f"{IMAGE_SIZE} px, normalise, batch 32 (no model)",
            ("keras_vit",),
            batch=32,
            relative_to="train_s16_fp32_bs32",
        ),
    )
}


# --- GPU mode (`gpu.py`) -------------------------------------------------------------------------
GPU_MATMUL_SIZE = 8192  # large enough to reach an H100's or H200's peak
PREDICT_STEPS = 4  # "predict" cases: Keras's `predict` of 4 batches per call


def _gpu_model_case(kind: str, arch: str, batch: int, precision: str, image_size: int = IMAGE_SIZE) -> Case:
    size = "" if image_size == IMAGE_SIZE else f"_{image_size}"
    what = "inference" if kind == "infer" else "training step (forward, backward, AdamW)"
    precision_label = "bf16" if precision == "bfloat16" else "fp32 (TF32)"
    title = f"{ARCHS[arch].label} {image_size} px {what.split()[0]} {precision_label}, batch {batch}"
    name = f"{kind}_{arch.removeprefix('vit_')}{size}_{_PRECISION_TAGS[precision]}_bs{batch}"
    return Case(
        name, kind, title, f"{title}: {what}", GPU_MODEL_PEERS, arch, batch, precision, image_size=image_size
    )


def _predict_case(host_dtype: str) -> Case:
    batch = 256 * PREDICT_STEPS
    title = f"ViT-B/16 model.predict of {host_dtype} NumPy images, bf16, {PREDICT_STEPS} batches of 256"
    description = f"{title}: host to device copies included" + (
        " (image_dtype='uint8': normalised in the model)" if host_dtype == "uint8" else ""
    )
    return Case(
        f"predict_b16_bf16_{host_dtype}",
        "predict",
        title,
        description,
        ("keras_vit_jax",),
        "vit_b16",
        batch,
        "bfloat16",
        host_dtype=host_dtype,
    )


GPU_MODEL_PEERS = (
    "keras_vit_jax",
    "keras_vit_torch",
    "keras_hub_jax",
    "timm",
    "timm_compiled",
    "timm_compiled_fused",
)
ATTENTION_PEERS = ("keras_vit_jax_plain", "keras_vit_jax_fused", "keras_vit_jax_fused_padded")
# In the order they run: what issue 26's targets need first.
GPU_CASES: dict[str, Case] = {
    c.name: c
    for c in (
        *(
            Case(
                f"matmul_{tag}_{GPU_MATMUL_SIZE}",
                "matmul",
                f"{GPU_MATMUL_SIZE}³ matmul, {tag}",
                f"{GPU_MATMUL_SIZE}³ {tag} matmul in each framework (JAX, PyTorch): the chip's rate",
                ("keras_vit_jax", "timm"),
                precision=precision,
                matmul_size=GPU_MATMUL_SIZE,
            )
            for tag, precision in (("bf16", "bfloat16"), ("tf32", "float32"))
        ),
        _gpu_model_case("train", "vit_b16", 64, "bfloat16"),
        _gpu_model_case("train", "vit_s16", 128, "bfloat16"),
        _gpu_model_case("infer", "vit_b16", 256, "bfloat16"),
        _predict_case("float32"),
        _predict_case("uint8"),
        _gpu_model_case("infer", "vit_b16", 64, "float32"),
        _gpu_model_case("train", "vit_b16", 32, "bfloat16", 384),
        _gpu_model_case("infer", "vit_b16", 64, "bfloat16", 384),
        _gpu_model_case("train", "vit_l16", 32, "bfloat16"),
    )
}
# The attention implementations against each other (keras_vit on JAX, forced instead of "auto").
ATTENTION_CASES = ("train_b16_bf16_bs64", "infer_b16_bf16_bs256", "train_b16_384_bf16_bs32")
GPU_COMPETITORS: dict[str, Competitor] = {
    c.name: c
    for c in (
        COMPETITORS["keras_vit_jax"],
        *(
            Competitor(
                f"keras_vit_jax_{attention}",
                "keras_vit",
                f"keras_vit_jax_{attention}",
                jit=True,
                label=f"keras_vit JAX, attention {attention}",
                backend="jax",
                attention=attention,
            )
            for attention in ("plain", "fused", "fused_padded")
        ),
        COMPETITORS["timm"],
        Competitor("timm_compiled", "timm", "timm", jit=True, label="timm + torch.compile", backend="torch"),
        # The fastest stock timm set-up for training: the compiled model and AdamW's fused CUDA kernel
        # (`torch.optim.AdamW(..., fused=True)`) instead of the default multi-tensor (foreach) one.
        # For inference it is timm_compiled (no optimizer): only training cases run it.
        Competitor(
            "timm_compiled_fused",
            "timm",
            "timm",
            jit=True,
            label="timm + torch.compile, fused AdamW",
            backend="torch",
            variant="fused_adamw",
        ),
        Competitor(
            "keras_hub_jax", "keras_hub", "keras_hub_jax", jit=True, label="keras_hub JAX", backend="jax"
        ),
        COMPETITORS["keras_vit_torch"],
        # jit_compile=True on torch: the ViT's forward pass through `torch.compile` (`ViT.compile`).
        Competitor(
            "keras_vit_torch_compiled",
            "keras_vit",
            "keras_vit_torch",
            jit=True,
            label="keras_vit PyTorch, jit_compile=True",
            backend="torch",
        ),
    )
}
TORCH_COMPILED_CASES = ("train_b16_bf16_bs64", "train_s16_bf16_bs128", "infer_b16_bf16_bs256")


# The GPU mode in parts, each one device call of under 8 minutes (`gpu.py --part NAME`, its default
# budget `PART_BUDGET` s): every part starts with the chip's bf16 matmul rate (and the TF32 rate
# where it has float32 cases), then gives each of its cases to every competitor that runs it
# (`None`: all of `GPU_MODEL_PEERS`). Sized from the compile times seen on an H200 (2026-11-28:
# 15-35 s per Keras-on-JAX case, 40-60 s per timm + torch.compile case).
GPU_PARTS: dict[str, tuple[tuple[str, ...], tuple[str, ...] | None]] = {
    "b16_train": (("matmul_bf16_8192", "train_b16_bf16_bs64"), None),
    "s16_train": (("matmul_bf16_8192", "train_s16_bf16_bs128"), None),
    "l16_train": (("matmul_bf16_8192", "train_l16_bf16_bs32"), None),
    "b16_384": (("matmul_bf16_8192", "train_b16_384_bf16_bs32", "infer_b16_384_bf16_bs64"), None),
    "inference": (
        (
            "matmul_bf16_8192",
            "matmul_tf32_8192",
            "infer_b16_bf16_bs256",
            "infer_b16_fp32_bs64",
            "predict_b16_bf16_float32",
            "predict_b16_bf16_uint8",
        ),
        None,
    ),
    # The attention policy's evidence and Keras's jit_compile=True on torch.
    "attention": (
        ("matmul_bf16_8192", *ATTENTION_CASES, *TORCH_COMPILED_CASES[:2]),
        ("keras_vit_jax", *ATTENTION_PEERS, "keras_vit_torch_compiled"),
    ),
}
PART_BUDGET = 450


def gpu_plan(
    cases: list[str] | None = None, competitors: list[str] | None = None, part: str | None = None
) -> list[tuple[str, str]]:
    """`(competitor, case)` pairs of the GPU mode, competitor by competitor (`GPU_COMPETITORS`'
    order), each competitor's cases in `GPU_CASES`' order; `part` keeps the pairs of one of
    `GPU_PARTS` (of those, `cases` and `competitors` narrow it further)."""
    if part is not None:
        part_cases, part_competitors = GPU_PARTS[part]
        pairs = gpu_plan(cases, competitors)
        if part_competitors is None:  # the model peers, not the attention or torch-compiled ones
            part_competitors = tuple(
                name for name in GPU_COMPETITORS if name not in (*ATTENTION_PEERS, "keras_vit_torch_compiled")
            )
        return [pair for pair in pairs if pair[1] in part_cases and pair[0] in part_competitors]
    plan = []
    for competitor in competitors or list(GPU_COMPETITORS):
        for name, case in GPU_CASES.items():
            if competitor in ATTENTION_PEERS:
                runs = name in ATTENTION_CASES
            elif competitor == "keras_vit_torch_compiled":
                runs = name in TORCH_COMPILED_CASES
            elif competitor == "timm_compiled_fused":
                runs = case.kind == "train"
            else:
                runs = competitor in case.competitors
            if runs and (cases is None or name in cases):
                plan.append((competitor, name))
    return plan


def tiny_case(case: Case) -> Case:
    """The same case on a test-size model and batch: what a CPU rehearsal of the GPU mode runs."""
    if case.kind == "matmul":
        return dataclasses.replace(case, matmul_size=256)
    image_size = 32 if case.image_size == IMAGE_SIZE else 48  # 5 or 10 tokens: different shapes
    batch = 2 * PREDICT_STEPS if case.kind == "predict" else 2
    return dataclasses.replace(case, arch="vit_test", batch=batch, image_size=image_size)


def lookup_case(name: str, tiny: bool = False) -> Case:
    """A case of the CPU suite or the GPU mode by name, test-size with `tiny`."""
    case = CASES.get(name) or GPU_CASES[name]
    return tiny_case(case) if tiny else case
