"""keras_vit against keras_hub and timm on the same inputs, interleaved, on a shared machine.

    python benchmarks/run.py                 # every case, 5 rounds of >= 2 s per measurement
    python benchmarks/run.py --jit           # also keras_vit and keras_hub with XLA
    python benchmarks/run.py --cases infer_b16_fp32_bs16 train_s16_fp32_bs32 --rounds 7
    python benchmarks/run.py --cases infer_b16_fp32_bs16 train_s16_fp32_bs32 \
        --competitors keras_vit keras_vit_jax keras_vit_torch timm   # Keras's 3 backends vs timm
    python benchmarks/run.py --quick         # smoke test: 6 cases, 2 short rounds, to *-quick.json
    python benchmarks/report.py benchmarks/results/<machine>.json   # the markdown table

One long-lived worker process per competitor's library and Keras backend (`worker.py`: keras_vit
and keras_hub on TensorFlow, keras_vit on JAX (`keras_vit_jax`) and on PyTorch
(`keras_vit_torch`), each started with `KERAS_BACKEND` set, and timm; plus a keras_vit worker
with a MirroredStrategy over 2 logical CPUs for the mirrored case), each with the same thread
count, all started with random weights and identical inputs.
Every case is built and warmed up first (tracing, XLA compilation; one timed call sets how many
calls make a measurement of at least `--min-time` seconds). Then each round measures every
case's competitors one after another, in an order rotated from round to round (A B C, B C A,
C A B, ...), so slow drifts of the machine hit everyone alike. First-call latency (build +
first prediction) is measured in a fresh process per competitor and round.

The machine is shared, so around each measurement the orchestrator reads the busy CPU time of
the whole machine (/proc/stat) and the CPU time of the measured worker and of itself
(/proc/<pid>/stat): the rest is what other processes (idle workers included) took. A round in
which that exceeds `--max-other` of the machine's capacity (CPUs x wall time) in any
measurement of a case is discarded for that case; if every round is, all are kept and the case
is flagged noisy. Reported per competitor: images/s median, min, max over the kept rounds;
per pair, the median (min, max) of the per-round ratios, also between families (the faster of
keras_vit / keras_vit XLA against the faster of keras_hub / keras_hub XLA, and timm); achieved
GFLOP/s (formula in `cases.py`) and its share of the TensorFlow matmul rate of the same
precision measured in the same run. A competitor that fails (import error, XLA compile error,
crash, time-out) is reported with its error and the others go on.

Results go to `benchmarks/results/<machine>.json` (every measurement, the machine, versions,
date and command line); `report.py` renders the README's performance table from it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import select
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from cases import CASES, COMPETITORS, MATMUL_SIZE, XLA_COMPETITORS, Case, Competitor
from machine import busy_seconds, cpu_model, isa_flags

from keras_vit.utils.files import open_for_writing, refuse_link

HERE = os.path.dirname(os.path.abspath(__file__))
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# --quick: every kind of case and every worker, on the smallest models available.
QUICK_CASES = (
    "matmul_fp32",
    "infer_ti16_fp32_bs16",
    "first_call_b16_fp32_bs1",
    "train_s16_fp32_bs32",
    "train_s16_fp32_bs32_mirrored",
    "pipeline_bs32",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), metavar="CASE", help="default: all")
    parser.add_argument(
        "--competitors", nargs="+", choices=sorted(COMPETITORS), metavar="NAME", help="default: all"
    )
    parser.add_argument(
        "--jit", action="store_true", help="add keras_vit_xla and keras_hub_xla (jit_compile)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-time", type=float, default=2.0, help="seconds per measurement, at least")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per case and competitor")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every framework")
    parser.add_argument(
        "--max-other",
        type=float,
        default=0.05,
        help="discard rounds where other processes took more than this share of the CPUs",
    )
    parser.add_argument(
        "--max-call",
        type=float,
        default=60,
        help="a competitor whose calls after the first (tracing) take longer is not measured",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed for one setup")
    parser.add_argument("--python", default=sys.executable, help="interpreter of keras_vit and timm workers")
    parser.add_argument("--hub-python", default=None, help="interpreter with keras_hub (default: --python)")
    parser.add_argument("--machine", default=None, help="results file name (default: from the CPU model)")
    parser.add_argument("--output", default=None, help="results path (default: results/<machine>.json)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 2 rounds of 0.3 s, 1 warm-up, one case of each kind unless --cases",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.min_time, args.warmup = 2, 0.3, 1
        args.cases = args.cases or list(QUICK_CASES)
    if args.rounds < 1 or args.threads < 1 or args.min_time <= 0 or args.warmup < 0:
        parser.error("--rounds and --threads must be >= 1, --min-time > 0, --warmup >= 0")
    return args


def machine_info() -> dict:
    """CPU model, count, memory and the instruction-set flags that decide matmul speed."""
    with open("/proc/meminfo") as meminfo:
        memory_kb = int(meminfo.readline().split()[1])
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gb": round(memory_kb / 2**20, 1),
        "isa": isa_flags(),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def machine_slug() -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-")
    return f"{slug}-{os.cpu_count()}cpu"


def process_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class WorkerError(RuntimeError):
    """A worker died, timed out or answered something that is not a reply."""


class Worker:
    """A `worker.py` process and its JSON-lines conversation; stderr goes to a log file."""

    def __init__(
        self,
        python: str,
        framework: str,
        backend: str,
        threads: int,
        logical_cpus: int,
        log_dir: str,
        extra_args: tuple[str, ...] = (),
        hello_timeout: float = 600,
    ):
        name = f"{framework}-{backend}-{logical_cpus}cpu-{time.monotonic_ns()}.log"
        self.log_path = os.path.join(log_dir, name)
        self.log = open_for_writing(self.log_path, "w")
        # KERAS_BACKEND picks the Keras workers' backend before they import keras (timm's: torch).
        # TensorFlow's oneDNN kernels on unless the caller says otherwise: keras_vit's default (the
        # `keras-vit` command, `keras_vit.enable_onednn()`), and keras_hub's faster setting too.
        environment = {"TF_ENABLE_ONEDNN_OPTS": "1", **os.environ}
        environment.update(TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS=str(threads), KERAS_BACKEND=backend)
        command = [
            python,
            os.path.join(HERE, "worker.py"),
            "--framework",
            framework,
            "--threads",
            str(threads),
        ]
        command += ["--logical-cpus", str(logical_cpus)]
        if framework != "timm":
            command += ["--backend", backend]
        command += extra_args
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=environment,
        )
        self.pid = self.process.pid
        self.hello = self._read(timeout=hello_timeout)
        if not self.hello.get("ok"):
            self.close()
            raise WorkerError(self.hello.get("error", "the worker failed to start"))

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            self.close()
            raise WorkerError(f"no answer within {timeout:.0f} s (log: {self.log_path})")
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise WorkerError(f"the worker exited with code {code}: {self.log_tail()} (log: {self.log_path})")
        return json.loads(line)

    def request(self, timeout: float, **message) -> dict:
        """Send one request and wait for its reply; raises `WorkerError` if the worker is lost."""
        if self.process.poll() is not None:
            raise WorkerError(f"the worker is gone (code {self.process.returncode}, log: {self.log_path})")
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        return self._read(timeout)

    def log_tail(self) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as log:
            lines = [line.strip() for line in log if line.strip()]
        return " | ".join(lines[-3:])[-600:]

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError):  # the worker may have exited already
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.flush()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def metered(function, measured_pid: int) -> tuple[object, dict]:
    """Run `function()` and measure the CPU time of the rest of the machine meanwhile."""
    own = os.getpid()
    busy, mine, worker = busy_seconds(), process_seconds(own), process_seconds(measured_pid)
    start = time.perf_counter()
    result = function()
    wall = time.perf_counter() - start
    busy = busy_seconds() - busy
    ours = process_seconds(own) - mine + process_seconds(measured_pid) - worker
    other = max(0.0, busy - ours)
    return result, {"wall_s": wall, "other_cpu_s": other, "other_share": other / (wall * os.cpu_count())}


class Suite:
    """The workers, the setups and every measurement of one run."""

    def __init__(self, args: argparse.Namespace, log_dir: str):
        self.args, self.log_dir = args, log_dir
        self.workers: dict[tuple[str, int, str], Worker] = {}
        self.worker_errors: dict[tuple[str, int, str], str] = {}
        self.versions: dict[str, dict] = {}
        self.results: dict[str, dict] = {}

    def python_for(self, competitor: Competitor) -> str:
        if competitor.framework == "keras_hub" and self.args.hub_python:
            return self.args.hub_python
        return self.args.python

    def start(self, competitor: Competitor) -> Worker:
        """A fresh worker for `competitor` (not kept: the caller owns it)."""
        return Worker(
            self.python_for(competitor),
            competitor.framework,
            competitor.backend,
            self.args.threads,
            competitor.logical_cpus,
            self.log_dir,
        )

    def worker(self, competitor: Competitor) -> Worker:
        """The long-lived worker of `competitor`, started on first use."""
        key = competitor.worker_key
        if key in self.worker_errors:
            raise WorkerError(self.worker_errors[key])
        if key not in self.workers:
            try:
                self.workers[key] = worker = self.start(competitor)
            except WorkerError as error:
                self.worker_errors[key] = str(error)
                raise
            self.versions[competitor.family] = worker.hello["versions"]
            seconds = worker.hello["import_s"]
            what = competitor.framework
            if competitor.framework != "timm":
                what += f" ({competitor.backend})"
            print(f"  started the {what} worker (pid {worker.pid}, import {seconds:.1f} s)")
        return self.workers[key]

    def lose(self, competitor: Competitor, error: Exception) -> None:
        """Forget a worker that died or hung, so its other competitors fail fast."""
        key = competitor.worker_key
        worker = self.workers.pop(key, None)
        if worker is not None:
            worker.close()
            self.worker_errors[key] = f"worker lost earlier: {error}"

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()

    def setup(self, case: Case, names: list[str]) -> None:
        """Build and warm up every competitor of `case`; decide the calls per measurement."""
        record = self.results.setdefault(case.name, {"competitors": {}})
        for name in names:
            competitor = COMPETITORS[name]
            entry = record["competitors"].setdefault(name, {"rounds": []})
            if case.kind == "first_call":
                entry["calls"] = 1
                continue
            try:
                reply = self.worker(competitor).request(
                    self.args.timeout,
                    op="setup",
                    case=case.name,
                    jit=competitor.jit,
                    warmup=max(1, self.args.warmup),
                    max_call=self.args.max_call,
                )
            except WorkerError as error:
                self.lose(competitor, error)
                reply = {"ok": False, "error": str(error)}
            if not reply["ok"]:
                entry["failed"] = reply["error"]
                state = f"failed: {entry['failed']}"
            elif reply.get("too_slow"):
                entry.update({key: reply[key] for key in ("params", "setup_s", "first_s", "call_s")})
                entry["too_slow"] = True
                state = f"too slow: {reply['call_s']:.1f} s per call > --max-call, not measured"
            else:
                entry["calls"] = max(1, math.ceil(self.args.min_time / reply["call_s"]))
                entry.update({key: reply[key] for key in ("params", "setup_s", "first_s", "call_s")})
                state = f"{entry['calls']} calls/measurement (first call {reply['first_s']:.1f} s)"
            print(f"  {case.name:<30} {name:<18} {state}")

    def measure(self, case: Case, name: str) -> None:
        """One measurement of one competitor, appended to its rounds."""
        competitor = COMPETITORS[name]
        entry = self.results[case.name]["competitors"][name]
        try:
            if case.kind == "first_call":
                entry["rounds"].append(self._first_call(case, competitor))
                return
            worker = self.worker(competitor)
            timeout = max(600.0, 20 * entry["calls"] * entry["call_s"])
            reply, load = metered(
                lambda: worker.request(
                    timeout, op="measure", case=case.name, jit=competitor.jit, calls=entry["calls"]
                ),
                worker.pid,
            )
        except WorkerError as error:
            self.lose(competitor, error)
            entry["failed"] = str(error)
            return
        if not reply["ok"]:
            entry["failed"] = reply["error"]
            return
        entry["rounds"].append({"seconds": reply["seconds"], "calls": entry["calls"], **load})

    def _first_call(self, case: Case, competitor: Competitor) -> dict:
        """Start a fresh worker, build + predict once in it, and close it."""
        begin = time.perf_counter()
        worker = self.start(competitor)
        startup = time.perf_counter() - begin
        try:
            reply, load = metered(
                lambda: worker.request(self.args.timeout, op="first_call", case=case.name), worker.pid
            )
        finally:
            worker.close()
        if not reply["ok"]:
            raise WorkerError(reply["error"])
        return {
            "seconds": reply["seconds"],
            "import_s": worker.hello["import_s"],
            "startup_s": startup,
            **load,
        }


def median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def kept_rounds(record: dict, max_other: float) -> None:
    """Mark the rounds of a case in which no measurement saw more foreign load than `max_other`."""
    entries = [entry for entry in record["competitors"].values() if entry["rounds"]]
    count = min((len(entry["rounds"]) for entry in entries), default=0)
    noise = [max(entry["rounds"][r]["other_share"] for entry in entries) for r in range(count)]
    kept = [r for r in range(count) if noise[r] <= max_other]
    record.update(
        other_share_per_round=noise, noisy=not kept and count > 0, kept_rounds=kept or list(range(count))
    )


def speeds(case: Case, record: dict, rounds: list[int]) -> dict[str, list[float]]:
    """Per competitor, its speed in each of `rounds` (higher is faster): images/s, GFLOP/s for
    matmuls, 1/seconds for first-call latency."""
    result = {}
    for name, entry in record["competitors"].items():
        if len(entry["rounds"]) <= max(rounds, default=-1):
            continue
        measured = [entry["rounds"][r] for r in rounds]
        if case.kind == "first_call":
            result[name] = [1.0 / m["seconds"] for m in measured]
        elif case.kind == "matmul":
            result[name] = [m["calls"] * 2 * MATMUL_SIZE**3 / m["seconds"] / 1e9 for m in measured]
        else:
            result[name] = [m["calls"] * case.batch / m["seconds"] for m in measured]
    return result


def ratios(table: dict[str, list[float]], prefix: str = "") -> dict:
    """Median (min, max) over rounds of the per-round speed ratio of every ordered pair."""
    return {
        f"{prefix}{first}/{second}": {
            **median_range([a / b for a, b in zip(table[first], table[second], strict=True)]),
            "per_round": [a / b for a, b in zip(table[first], table[second], strict=True)],
        }
        for first in table
        for second in table
        if first != second
    }


def family_speeds(table: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per family, the faster member in each round (e.g. keras_vit or keras_vit XLA)."""
    families: dict[str, list[str]] = {}
    for name in table:
        families.setdefault(COMPETITORS[name].family, []).append(name)
    return {
        family: [max(values) for values in zip(*(table[name] for name in members), strict=True)]
        for family, members in families.items()
    }


def add_shares(record: dict, results: dict, reference_case: str | None, key: str) -> None:
    """Each competitor's GFLOP/s as a share of keras_vit's in `reference_case`, stored under `key`
    (nothing if that case did not run)."""
    reference = results.get(reference_case or "", {}).get("competitors", {}).get("keras_vit", {})
    if "gflops" not in reference:
        return
    for entry in record["competitors"].values():
        if "gflops" in entry:
            entry[key] = entry["gflops"]["median"] / reference["gflops"]["median"]


def summarise(results: dict, max_other: float) -> None:
    """Add kept rounds, medians, per-round ratios, GFLOP/s and matmul shares to every case."""
    for name, record in results.items():
        case = CASES[name]
        kept_rounds(record, max_other)
        table = speeds(case, record, record["kept_rounds"])
        for competitor, values in table.items():
            entry = record["competitors"][competitor]
            if case.kind == "first_call":
                entry["seconds"] = median_range([1.0 / value for value in values])
            elif case.kind == "matmul":
                entry["gflops"] = median_range(values)
            else:
                entry["images_per_s"] = median_range(values)
                if case.flops_per_image:
                    entry["gflops"] = median_range([value * case.flops_per_image / 1e9 for value in values])
        if case.kind != "matmul":
            families = family_speeds(table)
            record["ratios"] = ratios(table)
            if len(families) > 1 and len(families) < len(table):
                record["ratios"].update(ratios(families, prefix="family:"))
    for name, record in results.items():
        case = CASES[name]
        if case.flops_per_image:
            add_shares(record, results, case.matmul_case, "matmul_share")
        add_shares(record, results, case.gemms_case, "gemms_share")
        if case.relative_to in results:
            other = results[case.relative_to]
            rounds = [r for r in record["kept_rounds"] if r in other["kept_rounds"]] or record["kept_rounds"]
            mine = family_speeds(speeds(case, record, rounds)).get("keras_vit")
            theirs = family_speeds(speeds(CASES[case.relative_to], other, rounds)).get("keras_vit")
            if mine and theirs:
                per_round = [a / b for a, b in zip(mine, theirs, strict=True)]
                record["ratio_to_training"] = {**median_range(per_round), "per_round": per_round}


def describe(name: str, record: dict) -> list[str]:
    """Printable lines for one case's summary."""
    case = CASES[name]
    lines = [f"{name}: {case.description}"]
    for competitor, entry in record["competitors"].items():
        label = f"  {competitor:<19}"
        if "failed" in entry and not entry["rounds"]:
            lines.append(f"{label}FAILED: {entry['failed']}")
            continue
        if entry.get("too_slow"):
            lines.append(f"{label}too slow: {entry['call_s']:.1f} s per call (not measured)")
            continue
        if case.kind == "first_call" and "seconds" in entry:
            s = entry["seconds"]
            startup = statistics.median(m["startup_s"] for m in entry["rounds"])
            text = f"{s['median']:8.2f} s  (min {s['min']:.2f}, max {s['max']:.2f}); "
            text += f"process start + import {startup:.1f} s"
        elif case.kind == "matmul" and "gflops" in entry:
            g = entry["gflops"]
            framework = "PyTorch" if competitor == "timm" else "TensorFlow"
            text = f"{g['median']:8.1f} GFLOP/s (min {g['min']:.1f}, max {g['max']:.1f})  [{framework}]"
        elif "images_per_s" in entry:
            i = entry["images_per_s"]
            text = f"{i['median']:8.2f} images/s (min {i['min']:.2f}, max {i['max']:.2f})"
            if "gflops" in entry:
                text += f"  {entry['gflops']['median']:6.1f} GFLOP/s"
            if "matmul_share" in entry:
                text += f" = {100 * entry['matmul_share']:.0f}% of TF {case.matmul_case.split('_')[1]} matmul"
            if "gemms_share" in entry:
                text += f", {100 * entry['gemms_share']:.0f}% of its matrix products alone"
        else:
            text = "no measurement"
        if "failed" in entry:
            text += f"  (then failed: {entry['failed']})"
        lines.append(label + text)
    for key, value in record.get("ratios", {}).items():
        if key.split("/")[0].removeprefix("family:").startswith("keras_vit"):
            lines.append(
                f"  ratio {key:<38} {value['median']:.3f} (min {value['min']:.3f}, max {value['max']:.3f})"
            )
    if "ratio_to_training" in record:
        value = record["ratio_to_training"]
        lines.append(
            f"  pipeline / keras_vit training throughput ({case.relative_to}): {value['median']:.2f}x"
        )
    noise = ", ".join(f"{100 * share:.1f}%" for share in record.get("other_share_per_round", []))
    kept = len(record.get("kept_rounds", []))
    flag = "  NOISY: no quiet round, all kept" if record.get("noisy") else ""
    total = len(record.get("other_share_per_round", []))
    lines.append(f"  rounds kept {kept}/{total}; other processes' CPU share per round: {noise}{flag}")
    return lines


def selected(args: argparse.Namespace) -> list[tuple[Case, list[str]]]:
    """The cases to run, each with its competitors after --competitors and --jit."""
    plan = []
    for name in args.cases or list(CASES):
        case = CASES[name]
        names = [
            competitor
            for competitor in case.competitors
            if (args.jit or competitor not in XLA_COMPETITORS)
            and (args.competitors is None or competitor in args.competitors)
        ]
        if names:
            plan.append((case, names))
    if not plan:
        raise SystemExit("No competitor left in the selected cases: check --cases and --competitors.")
    return plan


def main(argv: list[str] | None = None) -> int:
    """Run the suite, print the results and write the JSON file; returns the exit status."""
    args = parse_args(argv)
    if args.list:
        for case in CASES.values():
            print(f"{case.name:<30} {case.description} [{', '.join(case.competitors)}]")
        return 0
    plan = selected(args)
    machine = args.machine or machine_slug()
    output = args.output or os.path.join(HERE, "results", f"{machine}{'-quick' if args.quick else ''}.json")
    refuse_link(output)  # before the run, not after it
    log_dir = tempfile.mkdtemp(prefix="keras_vit_bench_logs_")
    started = datetime.datetime.now(datetime.timezone.utc)
    print(
        f"{len(plan)} cases, {args.rounds} rounds, measurements >= {args.min_time} s, {args.threads} threads"
    )
    print(f"worker logs: {log_dir}")
    suite = Suite(args, log_dir)
    try:
        print("setup (build, warm-up, calibration):")
        for case, names in plan:
            suite.setup(case, names)
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}/{args.rounds}")
            for case, names in plan:
                entries = suite.results[case.name]["competitors"]
                live = [name for name in names if not {"failed", "too_slow"} & set(entries[name])]
                shift = round_index % len(live) if live else 0
                for name in live[shift:] + live[:shift]:
                    suite.measure(case, name)
    finally:
        suite.close()
    summarise(suite.results, args.max_other)
    print()
    for case, _ in plan:
        print("\n".join(describe(case.name, suite.results[case.name])))
    record = {
        "machine_name": machine,
        "machine": machine_info(),
        "date": started.isoformat(timespec="seconds"),
        "duration_s": (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(),
        "command": shlex.join(["python", "benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]),
        "settings": {
            key: getattr(args, key)
            for key in ("rounds", "min_time", "warmup", "threads", "max_other", "jit", "quick")
        },
        "tf_enable_onednn_opts": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1 (run.py's default)"),
        "versions": suite.versions,
        "flop_convention": "forward FLOPs per image from benchmarks/cases.py; training step = 3x forward",
        "cases": {
            case.name: {"description": case.description, **suite.results[case.name]} for case, _ in plan
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open_for_writing(output, "w") as file:
        json.dump(record, file, indent=1)
    print(f"\nresults: {output} ({record['duration_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
