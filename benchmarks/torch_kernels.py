"""keras_vit's PyTorch-backend steps as the kernels a GPU would launch, beside timm eager's: recorded on
the CPU, estimated for the H200.

    python benchmarks/torch_kernels.py --output DIR [--cases train_b16_bf16_bs64 infer_b16_bf16_bs256]
        [--competitors keras_vit timm] [--tiny]

Why: on an H200 (2026-11-28) keras_vit's eager PyTorch path trained ViT-B/16 at 0.56x timm eager and
inferred at 0.74x (issue 36's target: 0.8x). Inference at batch 256 was not host-bound, so its gap was in
the kernels; the direct calls, the bias in the product's epilogue and the LayerNorm without a float32
copy came after that run, and no GPU has been lent since. This counts, without a GPU, the kernels each
step launches and the memory and FLOPs they move, so the two steps can be compared kernel by kernel.

How: each competitor's timed step, as the benchmark builds it (`worker.py`'s runners: Keras `fit` of the
device-resident batch with AdamW, timm's step with autocast; the forward pass without gradients, logits
fetched), runs on the CPU under a `TorchDispatchMode` that records every ATen operation that would
launch a kernel on a GPU. A composite operation is followed into the operations it is made of; a view,
or a conversion that returns its input, launches nothing. The CPU is made to take the GPU's paths:
flash attention (PyTorch's CPU flash kernel stands in for the CUDA one; `can_use_flash_attention`
answers as on a GPU) and timm's AdamW with `foreach` (its default on CUDA). A step is the difference
between one call of 2 steps and one of 1, so `fit`'s per-call work cancels out.

Each kernel's bytes are its tensors read (each input once; not the destination of a copy or fill) and
written (new outputs and mutated inputs), its FLOPs those of products (`torch.utils.flop_counter`) and
attention (backward 2.5x the forward). A multi-tensor (`_foreach_*`, fused AdamW) operation launches
one kernel per `FOREACH_TENSORS[lists]` tensors or 320 chunks of 65,536 elements, as PyTorch's
`multi_tensor_apply`. The estimate per kernel is the longest of bytes / bandwidth, FLOPs / rate
(`h200.py`: the H200's measured rates, shared with `gpu_hlo.py`) and `KERNEL_FLOOR_S`. It ignores the
host: an eager step is only as fast as Python launches its kernels (`torch_overhead.py` measures
that), and caches and kernel quality. An estimate to compare two steps and find the passes over memory
one makes and the other does not, not a measurement.

Writes DIR/torch_kernels.jsonl (one line per (case, competitor): kernels by kind, the largest groups of
non-product kernels) and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["KERAS_BACKEND"] = "torch"
import torch  # noqa: E402  - before TensorFlow could ever be imported (keras_vit never does on torch)
from cases import GPU_CASES, lookup_case  # noqa: E402
from h200 import ATTENTION_BACKWARD_FLOPS, ATTENTION_RATE, BANDWIDTH, MATMUL_RATE  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402
from torch.utils.flop_counter import flop_registry  # noqa: E402
from worker import KerasWorker, TimmWorker  # noqa: E402

from keras_vit.utils.files import open_for_writing  # noqa: E402

COMPETITORS = {"keras_vit": KerasWorker, "timm": TimmWorker}
CASES = ("train_b16_bf16_bs64", "infer_b16_bf16_bs256")
KERNEL_FLOOR_S = 2e-6  # the shortest kernel on an H200: launch and tail (the 2026-11-28 profiles)
FOREACH_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}  # tensors per launch by lists (multi_tensor_apply)
FOREACH_CHUNK, FOREACH_BLOCKS = 65536, 320
NOT_KERNELS = re.compile(r"^(empty|new_empty|_empty|empty_strided|_fused_sdp_choice|set_|resize_|detach_)")
WRITE_ONLY = re.compile(
    r"^(copy_|fill_|zero_|normal_|uniform_|bernoulli_|random_|_foreach_copy_|_foreach_zero_)"
)
KINDS = (  # (kind, pattern on the operation's name), the first that matches
    ("matmul", re.compile(r"^(mm|addmm|bmm|baddbmm|_?convolution(_backward)?|cudnn_convolution)$")),
    ("attention", re.compile(r"attention")),
    ("layer norm", re.compile(r"layer_norm")),
    ("optimizer (multi-tensor)", re.compile(r"^_foreach_|^_fused_adam")),
    ("read to host", re.compile(r"^_local_scalar_dense$")),
    (
        "reductions",
        re.compile(r"^(sum|mean|amax|amin|max|min|var|std|norm|linalg_vector_norm|prod|any|all)$"),
    ),
    ("random", re.compile(r"^(bernoulli|uniform|normal|random|native_dropout)")),
    (
        "copies",
        re.compile(r"^(clone|cat|stack|constant_pad_nd|index|select_backward|slice_backward|copy_|_to_copy)"),
    ),
)


def _tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def _nbytes(tensor: torch.Tensor) -> int:
    """What a kernel reads or writes of `tensor`: its elements, at most its storage (a broadcast)."""
    return min(tensor.numel() * tensor.element_size(), tensor.untyped_storage().nbytes())


def _mutated(func, args, kwargs) -> list[torch.Tensor]:
    """The inputs the operation writes (its schema's `a!`), a list argument's tensors included."""
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name, args[position] if position < len(args) else None)
        written += _tensors(value)
    return written


def _flops(func, args, kwargs, out) -> tuple[int, str]:
    """FLOPs of a product or attention, and the kind of rate they run at ("bf16", "f32", "attention")."""
    name = func.overloadpacket.__name__
    if "attention" in name:
        four_d = [t for t in _tensors(args) if t.dim() == 4]
        backward = name.endswith("_backward")
        query, key = four_d[1:3] if backward else four_d[:2]  # the backward's first is the output's gradient
        batch, heads, tokens, head_dim = query.shape
        flops = 4 * batch * heads * tokens * key.shape[2] * head_dim
        return int(flops * (ATTENTION_BACKWARD_FLOPS if backward else 1)), "attention"
    counter = flop_registry.get(func.overloadpacket)
    if counter is None:
        return 0, "bf16"
    flops = counter(*args, **kwargs, out_val=out)
    outputs = _tensors(out)
    return int(flops), ("f32" if outputs and outputs[0].dtype == torch.float32 else "bf16")


def kind_of(name: str, args, out) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            if kind == "copies" and name in ("_to_copy", "copy_"):
                source = _tensors(args)[-1]
                target = _tensors(out)[0] if _tensors(out) else _tensors(args)[0]
                return "casts" if source.dtype != target.dtype else kind
            return kind
    return "elementwise"


def _launches(name: str, args, lists: int) -> int:
    """Kernels an operation launches: a multi-tensor one over `lists` lists (PyTorch's
    `multi_tensor_apply`) one per `FOREACH_TENSORS[lists]` tensors or `FOREACH_BLOCKS` chunks of
    `FOREACH_CHUNK` elements, whichever is more; any other one."""
    if not name.startswith(("_foreach_", "_fused_adam")):
        return 1
    tensors = _tensors(args[0])
    depth = min(max(lists, 1), max(FOREACH_TENSORS))
    chunks = sum(math.ceil(tensor.numel() / FOREACH_CHUNK) for tensor in tensors)
    return max(math.ceil(len(tensors) / FOREACH_TENSORS[depth]), math.ceil(chunks / FOREACH_BLOCKS))


class KernelRecorder(TorchDispatchMode):
    """Records the ATen operations run under it that launch a kernel: per group (kind, operation, its
    tensors' dtypes and shapes) the calls, launches, bytes, FLOPs and estimated microseconds."""

    def __init__(self):
        super().__init__()
        self.groups: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # what it is made of, recorded
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        self.record(func, name, args, kwargs, out)
        return out

    def record(self, func, name: str, args, kwargs, out) -> None:
        if NOT_KERNELS.search(name):
            return
        inputs, outputs, mutated = _tensors((args, kwargs)), _tensors(out), _mutated(func, args, kwargs)
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        new_outputs = [t for t in outputs if t.untyped_storage().data_ptr() not in storages]
        if not mutated and not new_outputs:
            return  # a view, or a conversion to what the input already is
        written_only = {id(t) for t in mutated} if WRITE_ONLY.search(name) else set()
        read = {id(t): t for t in inputs if id(t) not in written_only}
        moved = sum(map(_nbytes, read.values())) + sum(map(_nbytes, new_outputs + mutated))
        flops, rate_kind = _flops(func, args, kwargs, out)
        rate = ATTENTION_RATE if rate_kind == "attention" else MATMUL_RATE[rate_kind]
        lists = sum(isinstance(a, (list, tuple)) and bool(_tensors(a)) for a in args)
        launches = _launches(name, args, lists + (0 if mutated else 1))  # + the outputs' list
        seconds = max(moved / BANDWIDTH, flops / rate, launches * KERNEL_FLOOR_S)
        shapes = ",".join(f"{str(t.dtype)[6:]}{list(t.shape)}" for t in (inputs or outputs)[:3])
        group = self.groups[(kind_of(name, args, out), name, shapes)]
        group.update(calls=1, launches=launches, bytes=moved, flops=flops, us=1e6 * seconds)


@contextlib.contextmanager
def cuda_paths():
    """The CPU on CUDA's paths: keras_vit's flash-attention branch where CUDA's flash attention takes the
    heads (`eager_torch._fused_attention` asks `can_use_flash_attention`, which is False off CUDA), and
    torch's AdamW with `foreach` (CUDA's default; a CPU's is a loop of single-tensor operations)."""
    import torch.backends.cuda as cuda_backends

    can_use_flash, adamw = cuda_backends.can_use_flash_attention, torch.optim.AdamW

    class ForeachAdamW(adamw):
        def __init__(self, params, *rest, **options):
            if not options.get("fused"):
                options.setdefault("foreach", True)
            super().__init__(params, *rest, **options)

    def flash_takes(params, debug: bool = False) -> bool:  # its dtype and head-width checks on CUDA
        query = params.query
        return (
            query.dtype in (torch.float16, torch.bfloat16)
            and query.shape[-1] % 8 == 0
            and query.shape[-1] <= 256
        )

    cuda_backends.can_use_flash_attention = flash_takes
    torch.optim.AdamW = ForeachAdamW
    try:
        yield
    finally:
        cuda_backends.can_use_flash_attention, torch.optim.AdamW = can_use_flash, adamw


def per_step(runner) -> dict[tuple, collections.Counter]:
    """The kernels of one step: a call of 2 steps recorded, less a call of 1."""
    runner(1)  # the first call: weights built, optimizer state made
    recordings = []
    for steps in (1, 2):
        recorder = KernelRecorder()
        with recorder:
            runner(steps)
        recordings.append(recorder.groups)
    one, two = recordings
    step = {}
    for key in set(one) | set(two):
        difference = collections.Counter(two.get(key, {}))
        difference.subtract(one.get(key, {}))
        if difference["calls"]:
            step[key] = difference
    return step


def summarise(step: dict[tuple, collections.Counter], top: int = 15) -> dict:
    by_kind = collections.defaultdict(collections.Counter)
    for (kind, _, _), group in step.items():
        by_kind[kind].update(group)
    largest = sorted(
        ((key, group) for key, group in step.items() if key[0] != "matmul"), key=lambda item: -item[1]["us"]
    )[:top]
    return {
        "kernels": sum(group["launches"] for group in step.values()),
        "estimate_ms": round(sum(group["us"] for group in step.values()) / 1e3, 3),
        "by_kind": {
            kind: {
                "kernels": group["launches"],
                "bytes": group["bytes"],
                "flops": group["flops"],
                "ms": round(group["us"] / 1e3, 3),
            }
            for kind, group in sorted(by_kind.items(), key=lambda item: -item[1]["us"])
        },
        "largest_non_matmul": [
            {"kind": kind, "op": name, "tensors": shapes, "calls": g["calls"], "ms": round(g["us"] / 1e3, 3)}
            for (kind, name, shapes), g in largest
        ],
    }


def report(lines: list[dict]) -> None:
    kinds = sorted({kind for line in lines for kind in line["by_kind"]})
    print("| case | competitor | kernels | estimate ms | " + " | ".join(kinds) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(kinds))
    for line in lines:
        cells = [f"{line['by_kind'].get(kind, {}).get('ms', 0):.2f}" for kind in kinds]
        print(
            f"| {line['case']} | {line['competitor']} | {line['kernels']} | {line['estimate_ms']:.2f} | "
            + " | ".join(cells)
            + " |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    model_cases = sorted(name for name, case in GPU_CASES.items() if case.kind in ("train", "infer"))
    parser.add_argument("--cases", nargs="+", choices=model_cases, default=list(CASES))
    parser.add_argument("--competitors", nargs="+", choices=sorted(COMPETITORS), default=list(COMPETITORS))
    parser.add_argument("--tiny", action="store_true", help="test-size model and batch: a rehearsal")
    args = parser.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    threads = len(os.sched_getaffinity(0))
    lines, workers = [], {}
    with cuda_paths():
        for case_name in args.cases:
            case = lookup_case(case_name, args.tiny)
            for competitor in args.competitors:
                if competitor not in workers:
                    workers[competitor] = COMPETITORS[competitor](competitor, threads, 1, "torch")
                runner, _ = workers[competitor].runner(case, False)
                line = {"case": case.name, "competitor": competitor, "torch": torch.__version__}
                line |= summarise(per_step(runner))
                with open_for_writing(os.path.join(args.output, "torch_kernels.jsonl"), "a") as file:
                    file.write(json.dumps(line) + "\n")
                lines.append(line)
                print(
                    json.dumps({key: line[key] for key in ("case", "competitor", "kernels", "estimate_ms")})
                )
    report(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
