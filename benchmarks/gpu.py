"""The GPU mode: keras_vit on JAX and PyTorch, keras_hub on JAX, timm eager and compiled, on one GPU.

    bash benchmarks/gpu/run_gpu.sh                  # on the GPU machine: one device call, < 10 min
    bash benchmarks/gpu/run_gpu.sh --rehearse       # on a CPU: test-size models, TensorFlow blocked
    python benchmarks/gpu.py --output DIR [--budget 450] [--tiny] [--part NAME] [--cases ...]
        [--competitors ...]
    python benchmarks/gpu.py --report DIR/gpu_results.json      # the markdown table again

What runs: `cases.GPU_CASES` for `cases.GPU_COMPETITORS`, in `cases.gpu_plan` order; `--part` one of
`cases.GPU_PARTS` (b16_train, s16_train, l16_train, b16_384, inference, attention), each sized for
one device call of under 8 minutes: every case of a part reaches every competitor. One `worker.py`
process per competitor's library and backend, started when its turn comes and closed after it
(keras_vit on JAX and its attention variants share one), so that no idle process holds GPU memory;
TensorFlow is never imported (the GPU machines have none). Each case: `--warmup` untimed calls
(tracing, XLA or inductor compilation), then `--rounds` measurements of at least `--min-time` s
each; images/s is their median. Calls and inputs are `worker.py`'s (inputs already on the GPU; the
result fetched to the host every call; training: the last step's loss after the last step, no host
sync per step, for Keras's `fit` and timm alike), except the "predict" cases, which time Keras's
`model.predict` of NumPy images (float32, or uint8 to a model built with `image_dtype="uint8"`).

Deadlines: the whole run stops after `--budget` seconds. Each competitor gets a share of the
time left when its turn comes (`SHARES`, what it did not use passes on), each case at most
`--case-timeout` s of set-up; a worker that overruns is killed and the rest of its cases is
recorded as skipped, so a run always ends with results for what fitted. Every finished case is
appended as one JSON line to `DIR/gpu_results.jsonl` at once; at the end `DIR/gpu_results.json`
holds them all with the GPU, versions, date, command, each step's TFLOP/s (FLOPs from
`cases.py`) as a share of the bf16 (and for float32 cases the TF32) matmul rate measured in the
same run, the ratios to timm, and per worker the count of ERROR lines in its log (Keras's
cuDNN try-and-fall-back would print them). The jsonl's first line (`"event": "start"`) holds the
GPU and the command, and one `"event": "worker"` line per worker its versions (torch's CUDA and
cuDNN, JAX's devices), so a run cut short still says where it ran.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from cases import GPU_CASES, GPU_COMPETITORS, GPU_PARTS, PART_BUDGET, gpu_plan, lookup_case
from machine import cpu_model
from run import Worker, WorkerError

from keras_vit.utils.files import open_for_writing, refuse_link

# Relative time shares of the competitors (of the time left when each one's turn comes).
SHARES = {
    "keras_vit_jax": 7,
    "keras_vit_jax_plain": 2,
    "keras_vit_jax_fused": 1.5,
    "keras_vit_jax_fused_padded": 2,
    "timm": 3,
    "timm_compiled": 7,
    "timm_compiled_fused": 4,  # the compiled model again: inductor's caches make it quicker
    "keras_hub_jax": 4,
    "keras_vit_torch": 3,
    "keras_vit_torch_compiled": 3,
}
LOG_TAIL_LINES = 40


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default=None, help="folder of the results (default: results/gpu-<date>)")
    parser.add_argument(
        "--budget", type=float, default=PART_BUDGET, help=f"seconds for the whole run (default {PART_BUDGET})"
    )
    parser.add_argument("--case-timeout", type=float, default=240, help="seconds for one case's set-up")
    parser.add_argument("--cases", nargs="+", choices=sorted(GPU_CASES), metavar="CASE", help="default: all")
    parser.add_argument(
        "--competitors", nargs="+", choices=list(GPU_COMPETITORS), metavar="NAME", help="default: all"
    )
    parser.add_argument(
        "--part",
        choices=list(GPU_PARTS),
        help="one part of the plan, sized for one device call (default: all)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds per measurement, at least")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per case (the first compiles)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--tiny", action="store_true", help="test-size models: a CPU rehearsal")
    parser.add_argument("--python", default=sys.executable, help="the workers' interpreter")
    parser.add_argument("--report", metavar="RESULTS_JSON", help="print the table of a finished run and exit")
    return parser.parse_args(argv)


def gpu_info() -> dict:
    """The GPU (nvidia-smi's name, memory, driver), or the CPU for a rehearsal without one."""
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,memory.total,driver_version"
        done = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip():
            name, memory, driver = (field.strip() for field in done.stdout.splitlines()[0].split(","))
            return {"gpu": name, "gpu_memory": memory, "driver": driver, "cpu": cpu_model()}
    return {"gpu": None, "cpu": cpu_model(), "note": "no GPU: a rehearsal"}


class GpuRun:
    """The plan, its workers and its results, written as they come."""

    def __init__(self, args: argparse.Namespace, machine: dict, command: str):
        self.args = args
        self.log_dir = tempfile.mkdtemp(prefix="keras_vit_gpu_logs_")
        self.lines = open_for_writing(os.path.join(args.output, "gpu_results.jsonl"), "a")
        self.event({"event": "start", "machine": machine, "command": command, "part": args.part})
        self.results: list[dict] = []
        self.versions: dict[str, dict] = {}
        self.logs: dict[str, str] = {}  # worker name -> log path
        self.worker: Worker | None = None
        self.worker_key: tuple | None = None

    def event(self, entry: dict) -> None:
        """A line of the jsonl that is not a result (where the run is, which versions)."""
        self.lines.write(json.dumps(entry) + "\n")
        self.lines.flush()

    def record(self, entry: dict) -> None:
        self.results.append(entry)
        self.lines.write(json.dumps(entry) + "\n")
        self.lines.flush()
        state = entry.get("error") or entry.get("skipped") or self.describe(entry)
        print(f"  {entry['case']:<28} {entry['competitor']:<27} {state}", flush=True)

    @staticmethod
    def describe(entry: dict) -> str:
        if "tflops" in entry and "images_per_s" not in entry:
            return f"{entry['tflops']['median']:.1f} TFLOP/s"
        return f"{entry['images_per_s']['median']:.1f} images/s (compile+first call {entry['first_s']:.1f} s)"

    def close_worker(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.worker, self.worker_key = None, None

    def worker_for(self, name: str, timeout: float) -> Worker:
        competitor = GPU_COMPETITORS[name]
        if self.worker_key != competitor.worker_key:
            self.close_worker()
            extra = ("--tiny",) if self.args.tiny else ()
            worker = Worker(
                self.args.python,
                competitor.framework,
                competitor.backend,
                self.args.threads,
                1,
                self.log_dir,
                extra_args=extra,
                hello_timeout=max(1.0, timeout),
            )
            self.worker, self.worker_key = worker, competitor.worker_key
            family = f"{competitor.framework}-{competitor.backend}"
            self.versions[family] = worker.hello["versions"]
            self.event({"event": "worker", "family": family, "versions": worker.hello["versions"]})
            self.logs.setdefault(family, worker.log_path)
            print(f"  started the {family} worker (import {worker.hello['import_s']:.1f} s)", flush=True)
        return self.worker

    def run_case(self, name: str, case_name: str, deadline: float) -> None:
        competitor, case = GPU_COMPETITORS[name], lookup_case(case_name, self.args.tiny)
        entry = {"competitor": name, "case": case_name, "kind": case.kind}
        left = deadline - time.monotonic()
        if left < 1:
            self.record({**entry, "skipped": "out of this competitor's time share"})
            return
        try:
            worker = self.worker_for(name, left)
            timeout = min(self.args.case_timeout, deadline - time.monotonic())
            reply = worker.request(
                max(1.0, timeout),
                op="setup",
                case=case_name,
                jit=competitor.jit,
                attention=competitor.attention,
                variant=competitor.variant,
                warmup=max(1, self.args.warmup),
                max_call=self.args.case_timeout,
            )
            if not reply["ok"]:
                self.record({**entry, "error": reply["error"]})
                return
            calls = max(1, math.ceil(self.args.min_time / reply["call_s"]))
            seconds = []
            for _ in range(self.args.rounds):
                left = deadline - time.monotonic()
                if left < 20 * calls * reply["call_s"] and seconds:
                    break  # keep what was measured rather than overrun
                measured = worker.request(
                    max(1.0, left),
                    op="measure",
                    case=case_name,
                    jit=competitor.jit,
                    attention=competitor.attention,
                    variant=competitor.variant,
                    calls=calls,
                )
                if not measured["ok"]:
                    raise WorkerError(measured["error"])
                seconds.append(measured["seconds"])
        except WorkerError as error:
            self.close_worker()  # dead or overrunning: the next case starts a fresh one
            self.record({**entry, "error": f"WorkerError: {error}"})
            return
        entry.update(params=reply["params"], first_s=reply["first_s"], calls=calls, seconds=seconds)
        if case.kind == "matmul":
            entry["tflops"] = spread([calls * 2 * case.matmul_size**3 / s / 1e12 for s in seconds])
        else:
            entry["images_per_s"] = spread([calls * case.batch / s for s in seconds])
            entry["tflops"] = spread(
                [value * case.flops_per_image / 1e12 for value in entry["images_per_s"]["all"]]
            )
        self.record(entry)

    def run(self) -> None:
        plan = gpu_plan(self.args.cases, self.args.competitors, self.args.part)
        end = time.monotonic() + self.args.budget
        order = list(dict.fromkeys(name for name, _ in plan))
        try:
            for index, name in enumerate(order):
                weights = [SHARES[other] for other in order[index:]]
                deadline = time.monotonic() + (end - time.monotonic()) * weights[0] / sum(weights)
                print(f"{name}: until +{deadline - end + self.args.budget:.0f} s of the budget", flush=True)
                for competitor, case_name in plan:
                    if competitor == name:
                        self.run_case(name, case_name, deadline)
        finally:
            self.close_worker()
            self.lines.close()


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def summarise(results: list[dict]) -> dict:
    """Matmul rates of the run, each model case's shares of them and its ratios to timm's."""
    rates = {}
    for tag in ("bf16", "tf32"):
        measured = [
            r["tflops"]["median"] for r in results if r["case"].startswith(f"matmul_{tag}") and "tflops" in r
        ]
        rates[tag] = max(measured, default=None)
    by_case: dict[str, dict[str, dict]] = {}
    for entry in results:
        by_case.setdefault(entry["case"], {})[entry["competitor"]] = entry
    for entry in results:
        if "images_per_s" not in entry:
            continue
        case = GPU_CASES[entry["case"]]
        if rates["bf16"]:
            entry["share_of_bf16_matmul"] = entry["tflops"]["median"] / rates["bf16"]
        if case.precision == "float32" and rates["tf32"]:
            entry["share_of_tf32_matmul"] = entry["tflops"]["median"] / rates["tf32"]
        for reference in ("timm", "timm_compiled", "timm_compiled_fused"):
            other = by_case[entry["case"]].get(reference, {})
            if "images_per_s" in other and reference != entry["competitor"]:
                entry[f"ratio_to_{reference}"] = (
                    entry["images_per_s"]["median"] / other["images_per_s"]["median"]
                )
    device = by_case.get("infer_b16_bf16_bs256", {}).get("keras_vit_jax", {}).get("images_per_s")
    for dtype in ("float32", "uint8"):
        entry = by_case.get(f"predict_b16_bf16_{dtype}", {}).get("keras_vit_jax", {})
        if device and "images_per_s" in entry:
            entry["ratio_to_device_resident"] = entry["images_per_s"]["median"] / device["median"]
    return {"matmul_tflops": rates}


def log_summary(path: str) -> dict:
    with open(path, errors="replace") as log:
        lines = log.read().splitlines()
    errors = [line for line in lines if "ERROR" in line]
    return {
        "error_lines": len(errors),
        "cudnn_fallback_errors": sum("Failed to apply cudnn" in line for line in errors),
        "first_errors": errors[:5],
        "tail": lines[-LOG_TAIL_LINES:],
    }


def table(record: dict) -> str:
    """Markdown: images/s per case and competitor, keras_vit JAX's ratios and matmul share."""
    names = [name for name in GPU_COMPETITORS if any(r["competitor"] == name for r in record["results"])]
    cells: dict[str, dict[str, str]] = {}
    for entry in record["results"]:
        if entry["kind"] == "matmul":
            continue
        if "images_per_s" in entry:
            text = f"{entry['images_per_s']['median']:,.0f}"
        else:
            text = "failed" if "error" in entry else "skipped"
        cells.setdefault(entry["case"], {})[entry["competitor"]] = text
    lines = [
        "| case | " + " | ".join(GPU_COMPETITORS[name].label for name in names) + " | keras_vit JAX / timm "
        "| / timm compiled | / timm compiled, fused AdamW | keras_vit JAX TFLOP/s (share of bf16 matmul) |",
        "|---|" + "---:|" * (len(names) + 4),
    ]
    for case_name, row in cells.items():
        ours = next(
            (r for r in record["results"] if r["case"] == case_name and r["competitor"] == "keras_vit_jax"),
            {},
        )
        ratios = [
            f"{ours[key]:.2f}×" if key in ours else "–"
            for key in ("ratio_to_timm", "ratio_to_timm_compiled", "ratio_to_timm_compiled_fused")
        ]
        share = (
            f"{ours['tflops']['median']:.0f} ({100 * ours['share_of_bf16_matmul']:.0f}%)"
            if "share_of_bf16_matmul" in ours
            else "–"
        )
        title = GPU_CASES[case_name].title
        lines.append(
            f"| {title} | "
            + " | ".join(row.get(name, "–") for name in names)
            + f" | {' | '.join(ratios)} | {share} |"
        )
    rates = record["summary"]["matmul_tflops"]
    lines.append("")
    lines.append(
        f"{record['machine'].get('gpu') or 'no GPU (rehearsal)'}, {record['date']}; measured matmul rates: "
        + ", ".join(f"{tag} {rate:.0f} TFLOP/s" for tag, rate in rates.items() if rate)
        + f". Command: `{record['command']}`."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        with open(args.report) as file:
            print(table(json.load(file)))
        return 0
    started = datetime.datetime.now(datetime.timezone.utc)
    args.output = args.output or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"gpu-{started:%Y%m%d-%H%M}"
    )
    os.makedirs(args.output, exist_ok=True)
    refuse_link(os.path.join(args.output, "gpu_results.json"))  # before the run, not after it
    machine = {**gpu_info(), "cpus": os.cpu_count(), "python": platform.python_version()}
    command = shlex.join(["python", "benchmarks/gpu.py", *(sys.argv[1:] if argv is None else argv)])
    print(
        f"{machine.get('gpu') or 'no GPU'}; budget {args.budget:.0f} s; results in {args.output}", flush=True
    )
    run = GpuRun(args, machine, command)
    run.run()
    record = {
        "machine": machine,
        "date": started.isoformat(timespec="seconds"),
        "duration_s": (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(),
        "command": command,
        "part": args.part,
        "settings": {
            key: getattr(args, key)
            for key in ("budget", "case_timeout", "rounds", "min_time", "warmup", "tiny")
        },
        "environment": {
            key: os.environ[key]
            for key in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION")
            if key in os.environ
        },
        "versions": run.versions,
        "flop_convention": "forward FLOPs per image from benchmarks/cases.py; training step = 3x forward",
        "results": run.results,
        "logs": {family: log_summary(path) for family, path in run.logs.items()},
    }
    record["summary"] = summarise(run.results)
    with open_for_writing(os.path.join(args.output, "gpu_results.json"), "w") as file:
        json.dump(record, file, indent=1)
    print()
    print(table(record))
    for family, log in record["logs"].items():
        errors, cudnn = log["error_lines"], log["cudnn_fallback_errors"]
        print(f"{family} log: {errors} ERROR lines, {cudnn} of them cuDNN fall-backs")
    print(f"\nresults: {args.output} ({record['duration_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
