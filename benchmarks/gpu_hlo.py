"""keras_vit's JAX steps compiled for a GPU without one: the kernels XLA would run, and an estimate.

    python benchmarks/gpu_hlo.py --output DIR [--cases ...] [--variants ...] [--target FILE]
        [--xla-gemm] [--keep-hlo]

XLA compiles for a GPU it does not have from a description of it (a `GpuTargetConfigProto`:
`gpu/h200.txtpb`, the H200 of the 2026-11-28 runs, from the specs in openxla/xla's
`xla/backends/gpu/target_config/specs/`), through `jax.experimental.topologies`. Each (case, variant)
is built as `gpu_experiments.py` builds it (the GPU mode's case, `mixed_bfloat16`, AdamW; a variant
swapped in from outside keras_vit) and compiled as it runs there: training is Keras's JAX `train_step`
under `jax.jit` with the state donated (what `fit` runs), inference `jax.jit` of `stateless_call`.
keras_vit is told it computes on a GPU (`attention.compute_device`), so it takes cuDNN's attention.

The compiled module's top-level kernels (fusions and library calls) are then sorted by kind, with the
bytes each reads and writes and the FLOPs of matrix products and attention. The estimate takes the
longer of bytes / `BANDWIDTH` and FLOPs / the kind's rate, the rates measured on the H200 on
2026-11-28 (`h200.py`). It ignores launch gaps, caches and kernel quality
(XLA's reductions ran at about half that bandwidth): a tool to compare variants and find the memory
passes a step makes, not a measurement (`results/gpu-hlo-20261129/README.md` compares it with the
profile).

There is no autotuner without a GPU, so by default matrix products go to cuBLAS
(`--xla_gpu_enable_triton_gemm=false`), as the H200's autotuner chose for most of them (`nvjet`);
`--xla-gemm` leaves XLA's untuned Triton products instead. Unknown cases and variants, a missing
target and, with `--keep-hlo`, a module file already in the folder are refused before anything is
compiled or written (`tests/test_benchmark_tools.py`). Needs JAX with its CUDA plugin (`pip install
"jax[cuda13]"`; jax 0.11.2 as on the H200, which needs Python 3.12) and no GPU: the plugin's check of
the driver's versions is skipped (`JAX_SKIP_CUDA_CONSTRAINTS_CHECK`).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys
import time
from collections.abc import Iterator

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cases import GPU_CASES  # noqa: E402
from gpu_experiments import VARIANTS as KNOWN_VARIANTS  # noqa: E402
from h200 import ATTENTION_BACKWARD_FLOPS, ATTENTION_RATE, BANDWIDTH, MATMUL_RATE  # noqa: E402

from keras_vit.utils.files import open_for_writing  # noqa: E402

CASES = ("train_b16_bf16_bs64", "infer_b16_bf16_bs256")
# gpu_experiments.py's variants but heads_major, whose cuDNN branch asks JAX for this machine's backend
VARIANTS = {
    "train": ("stock", "pos_matmul", "pad_once", "split_qkv", "plain"),
    "infer": ("stock", "split_qkv", "plain", "fused_padded"),
}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4}
DTYPE_BYTES |= {"f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
NOT_KERNELS = {"parameter", "bitcast", "get-tuple-element", "tuple", "constant", "after-all", "opt-barrier"}


# --- reading a compiled HLO module --------------------------------------------------------------------
def _dims(array_type: str) -> list[int]:
    match = ARRAY.search(array_type)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def _bytes(type_text: str, workspace: bool = True) -> int:
    """Bytes of an array type or of every array in a tuple type; without `workspace`, less the `s8`
    arrays (cuBLAS's scratch, which a product returns beside its result)."""
    total = 0
    for dtype, dims in ARRAY.findall(type_text):
        if dtype == "s8" and not workspace:
            continue
        count = 1
        for d in dims.split(","):
            count *= int(d) if d else 1
        total += count * DTYPE_BYTES.get(dtype, 0)
    return total


def _closing(text: str, start: int) -> int:
    depth = 0
    for index in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[index], 0)
        if depth == 0:
            return index
    raise ValueError(f"unbalanced parentheses: {text[:80]}")


def instructions(lines: list[str]) -> Iterator[tuple[str, str, str, list[str], str]]:
    """(name, type, opcode, operand names, attributes) of each instruction line."""
    for line in lines:
        line = line.strip().removeprefix("ROOT ")
        if not line.startswith("%") or " = " not in line:
            continue
        name, rest = line.split(" = ", 1)
        if rest.startswith("("):
            end = _closing(rest, 0)
            type_text, rest = rest[: end + 1], rest[end + 2 :]
        else:
            type_text, rest = rest.split(" ", 1)
        opening = rest.index("(")
        end = _closing(rest, opening)
        operands = re.findall(r"%([\w.\-]+)", rest[opening : end + 1])
        yield name[1:], type_text, rest[:opening], operands, rest[end + 1 :]


def computations(text: str) -> dict[str, list[str]]:
    """Each computation's instruction lines; the entry computation under "ENTRY"."""
    result, current = {}, None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if header:
            current = "ENTRY" if header.group(1) else header.group(2)
            result[current] = []
        elif line.startswith("}"):
            current = None
        elif current:
            result[current].append(line)
    return result


def _contracted(lhs_type: str, dimensions: list[int]) -> int:
    size, dims = 1, _dims(lhs_type)
    for d in dimensions:
        size *= dims[d]
    return size


def _product_flops(type_text: str, lhs_type: str, contracting: list[int]) -> int:
    output = 1
    for d in _dims(type_text):
        output *= d
    return 2 * output * _contracted(lhs_type, contracting)


def _cublas_flops(type_text: str, lhs_type: str, attributes: str) -> int:
    contracting = re.search(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]', attributes).group(1)
    return _product_flops(type_text, lhs_type, [int(d) for d in re.findall(r"\d+", contracting)])


def _fused_product(lines: list[str]) -> tuple[int, int] | None:
    """(FLOPs, bytes of its operands and output) of the matrix products inside a fused computation:
    XLA's Triton products (`dot`), or cuBLAS's called on slices of a buffer (XLA's dynamic-slice
    fusions: the slices are views, so the bytes are the product's own); None without one."""
    types, flops, moved, found = {}, 0, 0, False
    for name, type_text, opcode, operands, attributes in instructions(lines):
        types[name] = type_text
        if opcode == "dot":
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attributes).group(1)
            dims = [int(d) for d in contracting.split(",") if d]
            flops += _product_flops(type_text, types[operands[0]], dims)
            found = True
        elif opcode == "custom-call" and "__cublas" in attributes:
            flops += _cublas_flops(type_text, types[operands[0]], attributes)
            moved += _bytes(type_text, False) + sum(_bytes(types[o]) for o in operands)
            found = True
    return (flops, moved) if found else None


def kind_of(name: str, opcode: str, attributes: str) -> str:
    if opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', attributes).group(1)
        if "fmha" in target:
            return "attention (cuDNN)"
        return "matmul" if "cublas" in target else f"custom call {target}"
    if opcode == "fusion":
        for kind, words in (
            ("transposes", ("transpose",)),
            ("reductions", ("reduce",)),
            ("pad/slice/concatenate", ("pad", "slice", "concatenate")),
            ("casts", ("convert",)),
        ):
            if any(word in name for word in words):
                return kind
        return "other elementwise"
    return "transposes" if opcode in ("copy", "transpose") else opcode


def kernels(text: str) -> list[dict]:
    """The entry computation's kernels: kind, bytes read and written, FLOPs, estimated microseconds."""
    bodies = computations(text)
    types: dict[str, str] = {}
    rows = []
    for name, type_text, opcode, operands, attributes in instructions(bodies["ENTRY"]):
        types[name] = type_text
        if opcode in NOT_KERNELS or opcode.endswith("-done"):
            continue
        kind = kind_of(name, opcode, attributes)
        moved = _bytes(type_text, False) + sum(_bytes(types.get(operand, "")) for operand in operands)
        flops, rate = 0, MATMUL_RATE["f32" if type_text.lstrip("(").startswith("f32") else "bf16"]
        callee = re.search(r"calls=%([\w.\-]+)", attributes)
        fused = _fused_product(bodies.get(callee.group(1), [])) if opcode == "fusion" and callee else None
        if fused:
            kind, (flops, inner_bytes) = "matmul", fused
            moved = inner_bytes or moved
        elif kind == "matmul":
            flops = _cublas_flops(type_text, types[operands[0]], attributes)
        elif kind == "attention (cuDNN)":
            batch, tokens, heads, head_dim = _dims(types[operands[0]])  # q: (B, T, N, H)
            flops = 4 * batch * heads * tokens * tokens * head_dim
            flops = int(flops * (ATTENTION_BACKWARD_FLOPS if "Backward" in attributes else 1))
            rate = ATTENTION_RATE
        seconds = max(moved / BANDWIDTH, flops / rate)
        rows.append(
            {
                "name": name,
                "kind": kind,
                "type": type_text,
                "bytes": moved,
                "flops": flops,
                "us": 1e6 * seconds,
            }
        )
    return rows


def summarise(rows: list[dict], top: int = 15) -> dict:
    by_kind = collections.defaultdict(lambda: {"kernels": 0, "GB": 0.0, "GFLOP": 0.0, "ms": 0.0})
    groups = collections.defaultdict(lambda: {"kernels": 0, "ms": 0.0})
    for row in rows:
        entry = by_kind[row["kind"]]
        entry["kernels"] += 1
        entry["GB"] += row["bytes"] / 1e9
        entry["GFLOP"] += row["flops"] / 1e9
        entry["ms"] += row["us"] / 1e3
        if row["kind"] != "matmul":  # the same fusion in every block, by its name without the number
            group = groups[(row["kind"], re.sub(r"[.\d]+$", "", row["name"]), row["type"][:90])]
            group["kernels"] += 1
            group["ms"] += row["us"] / 1e3
    ordered = sorted(by_kind.items(), key=lambda item: -item[1]["ms"])
    largest = sorted(groups.items(), key=lambda item: -item[1]["ms"])[:top]
    return {
        "kernels": len(rows),
        "estimate_ms": sum(row["us"] for row in rows) / 1e3,
        "by_kind": {kind: {k: round(v, 4) for k, v in entry.items()} for kind, entry in ordered},
        "largest_non_matmul": [
            {
                "kind": kind,
                "fusion": name,
                "type": type_text,
                "kernels": g["kernels"],
                "ms": round(g["ms"], 4),
            }
            for (kind, name, type_text), g in largest
        ],
    }


# --- compiling keras_vit's steps for the target ---------------------------------------------------------
class Compiler:
    """keras_vit's JAX steps compiled for the GPU a `GpuTargetConfigProto` file describes."""

    def __init__(self, target: str):
        import jax
        from jax.experimental import topologies

        with open(target) as file:
            config = file.read()
        topology = topologies.get_topology_desc(platform="cuda", target_config=config, topology="1x1x1")
        mesh = topologies.make_mesh(topology, (1,), ("devices",))
        self.jax, self.sharding = jax, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.device = topology.devices[0].device_kind

        import keras_vit.models.attention

        keras_vit.models.attention.compute_device = lambda: "gpu"  # the target's, not this machine's
        from worker import KerasWorker

        self.worker = KerasWorker("keras_vit", os.cpu_count(), 1, "jax")

    def abstract(self, tree):
        spec = self.jax.ShapeDtypeStruct
        return self.jax.tree.map(lambda a: spec(a.shape, a.dtype, sharding=self.sharding), tree)

    def compile(self, case_name: str, variant: str) -> str:
        """The case's step with the variant, compiled for the target: the module's HLO text."""
        from cases import lookup_case
        from gpu_experiments import apply_variant, attention_of

        jax, keras = self.jax, self.worker.keras
        case = lookup_case(case_name, False)
        model = apply_variant(self.worker.build(case, attention_of(variant)), variant)
        images = jax.ShapeDtypeStruct(
            (case.batch, case.image_size, case.image_size, 3), "float32", sharding=self.sharding
        )
        if case.kind == "train":
            model.compile(
                optimizer=keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=0.05),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=True,
            )
            model.optimizer.build(model.trainable_variables)
            shape = (2, case.image_size, case.image_size, 3)  # builds the metrics' variables
            model._symbolic_build(data_batch=(np.zeros(shape, "float32"), np.zeros((2,), "int32")))
            state = [
                [v.value for v in variables]
                for variables in (
                    model.trainable_variables,
                    model.non_trainable_variables,
                    model.optimizer.variables,
                    model.metrics_variables,
                )
            ]
            labels = jax.ShapeDtypeStruct((case.batch,), "int32", sharding=self.sharding)
            traced = jax.jit(model.train_step, donate_argnums=0).trace(self.abstract(state), (images, labels))
        else:

            def forward(trainable, non_trainable, x):
                return model.stateless_call(trainable, non_trainable, x, training=False)[0]

            weights = [
                [v.value for v in vs] for vs in (model.trainable_variables, model.non_trainable_variables)
            ]
            traced = jax.jit(forward).trace(*self.abstract(weights), images)
        return traced.lower(lowering_platforms=("cuda",)).compile().as_text()


def report(lines: list[dict]) -> None:
    stock = {line["case"]: line["estimate_ms"] for line in lines if line["variant"] == "stock"}
    kinds = list(dict.fromkeys(kind for line in lines for kind in line["by_kind"]))
    print("| case | variant | kernels | estimate ms | vs stock | " + " | ".join(kinds) + " |")
    print("|---|---|---:|---:|---:|" + "---:|" * len(kinds))
    for line in lines:
        ratio = line["estimate_ms"] / stock[line["case"]] if line["case"] in stock else float("nan")
        cells = [f"{line['by_kind'].get(kind, {}).get('ms', 0):.2f}" for kind in kinds]
        print(
            f"| {line['case']} | {line['variant']} | {line['kernels']} | {line['estimate_ms']:.2f} | "
            f"{ratio:.3f} | " + " | ".join(cells) + " |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output", required=True, help="folder of gpu_hlo.jsonl (and the HLO with --keep-hlo)"
    )
    compilable = sorted(name for name, case in GPU_CASES.items() if case.kind in VARIANTS)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=compilable)
    parser.add_argument(
        "--variants", nargs="+", choices=KNOWN_VARIANTS, help="default: VARIANTS of the case's kind"
    )
    parser.add_argument(
        "--target", default=os.path.join(HERE, "gpu", "h200.txtpb"), help="GpuTargetConfigProto"
    )
    parser.add_argument("--xla-gemm", action="store_true", help="XLA's untuned Triton products, not cuBLAS")
    parser.add_argument("--keep-hlo", action="store_true", help="also write each compiled module (gzip)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.target):
        parser.error(f"--target {args.target}: no such file (a GpuTargetConfigProto, as gpu/h200.txtpb)")
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to ask
    if not args.xla_gemm:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false"
        ).strip()
    compilations = [(c, v) for c in args.cases for v in args.variants or VARIANTS[GPU_CASES[c].kind]]
    if args.keep_hlo:  # nothing of the user's is written over: refused before any compilation
        kept = [f"{case_name}-{variant}.hlo.gz" for case_name, variant in compilations]
        present = [name for name in kept if os.path.lexists(os.path.join(args.output, name))]
        if present:
            parser.error(f"{', '.join(present)} already in {args.output}: give --output a new folder")
    os.makedirs(args.output, exist_ok=True)
    compiler = Compiler(args.target)
    lines = []
    with open_for_writing(os.path.join(args.output, "gpu_hlo.jsonl"), "a") as out:
        for case_name, variant in compilations:
            started = time.perf_counter()
            text = compiler.compile(case_name, variant)
            line = {
                "case": case_name,
                "variant": variant,
                "device": compiler.device,
                "target": os.path.basename(args.target),
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
                "versions": compiler.worker.versions(),
                "compile_s": round(time.perf_counter() - started, 1),
                **summarise(kernels(text)),
            }
            out.write(json.dumps(line) + "\n")
            out.flush()
            lines.append(line)
            print(
                f"  {case_name} {variant}: {line['kernels']} kernels, "
                f"estimate {line['estimate_ms']:.2f} ms "
                f"(compiled in {line['compile_s']} s)",
                flush=True,
            )
            if args.keep_hlo:
                with gzip.open(os.path.join(args.output, f"{case_name}-{variant}.hlo.gz"), "xt") as hlo:
                    hlo.write(text)
    report(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
