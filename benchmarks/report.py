"""Render the performance tables (markdown) from a `run.py` results file.

    python benchmarks/report.py benchmarks/results/<machine>.json            # print the tables
    python benchmarks/report.py benchmarks/results/<machine>.json --readme   # into docs/performance.md

With `--readme [PATH]` the text between the lines `<!-- perf-table:start -->` and
`<!-- perf-table:end -->` of docs/performance.md is replaced; the markers must be there, once each.
Every figure is a median over the run's kept rounds; ratios are medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from cases import CASES, COMPETITORS, MODEL_PEERS

from keras_vit.utils.files import open_for_writing

START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "performance.md")
KERAS_VIT_FAMILIES = ("keras_vit", "keras_vit_jax", "keras_vit_torch")  # TensorFlow, JAX, PyTorch
BACKENDS_NOTE = (
    "keras_vit and keras_vit XLA run on Keras's TensorFlow backend (graph, XLA); keras_vit JAX on "
    "its JAX backend (XLA: `jax.jit` of the forward pass, `fit`'s compiled step); "
    "keras_vit PyTorch on its torch backend, eager as Keras runs it by default (`fit`; "
    "inference under `torch.inference_mode()`): the same model code, inputs and thread count "
    "(`benchmarks/worker.py`). The GFLOP/s column is keras_vit's fastest column."
)


class MarkersError(ValueError):
    """The README lacks the perf-table markers (or has them twice, or out of order)."""


def _cell(entry: dict | None, key: str, digits: int = 2) -> str:
    if entry is None:
        return "–"
    if entry.get(key):
        return f"{entry[key]['median']:.{digits}f}"
    if entry.get("too_slow"):
        return f"too slow ({entry['call_s']:.0f} s/call)"
    return "failed" if "failed" in entry else "–"


def _ratio(record: dict, first: str, second: str) -> str:
    """The family ratio (each library's faster mode per round) if there is one, else the plain one."""
    ratios = record.get("ratios", {})
    value = ratios.get(f"family:{first}/{second}") or ratios.get(f"{first}/{second}")
    return f"{value['median']:.2f}×" if value else "–"


def _fastest_keras_vit(record: dict) -> dict | None:
    candidates = [
        record["competitors"][name]
        for name in MODEL_PEERS
        if name.startswith("keras_vit") and "images_per_s" in record["competitors"].get(name, {})
    ]
    return max(candidates, key=lambda entry: entry["images_per_s"]["median"], default=None)


def _model_cases(cases: dict) -> list[tuple[str, dict]]:
    """The inference and training cases of the libraries' table (not the mirrored one)."""
    return [
        (name, record)
        for name, record in cases.items()
        if CASES[name].kind in ("infer", "train") and "keras_vit_mirrored" not in CASES[name].competitors
    ]


def model_columns(cases: dict) -> list[str]:
    """The competitors that ran in at least one model case, in the table's order."""
    ran = {competitor for _, record in _model_cases(cases) for competitor in record["competitors"]}
    return [name for name in MODEL_PEERS if name in ran]


def _ratio_columns(columns: list[str]) -> list[tuple[str, str, str]]:
    """(header, first family, second family) of the ratio columns the competitors allow."""
    families = {COMPETITORS[name].family for name in columns}
    pairs = []
    if "keras_hub" in families:
        pairs.append(("keras_vit", "keras_hub"))
    if "timm" in families:
        pairs += [(family, "timm") for family in KERAS_VIT_FAMILIES]
    return [
        (f"{COMPETITORS[first].label} ÷ {COMPETITORS[second].label}", first, second)
        for first, second in pairs
        if first in families
    ]


def model_table(cases: dict) -> list[str]:
    """Inference and training throughput (images/s) of every library, ratios, GFLOP/s (and a
    blank line after them; nothing if no such case ran)."""
    columns = model_columns(cases)
    if not columns:
        return []
    ratio_columns = _ratio_columns(columns)
    headers = [COMPETITORS[name].label for name in columns] + [header for header, _, _ in ratio_columns]
    rows = [
        "| Case (images/s) | " + " | ".join(headers) + " | keras_vit GFLOP/s (share of matmul) |",
        "|---|" + "---:|" * (len(headers) + 1),
    ]
    for name, record in _model_cases(cases):
        case = CASES[name]
        cells = [_cell(record["competitors"].get(column), "images_per_s") for column in columns]
        best = _fastest_keras_vit(record)
        flops = "–"
        if best is not None and "gflops" in best:
            flops = f"{best['gflops']['median']:.0f}"
            if "matmul_share" in best:
                flops += f" ({100 * best['matmul_share']:.0f}%)"
        noisy = " †" if record.get("noisy") else ""
        cells += [_ratio(record, first, second) for _, first, second in ratio_columns]
        rows.append(f"| {case.title}{noisy} | " + " | ".join(cells + [flops]) + " |")
    return rows + [""]


def other_rows(cases: dict) -> list[str]:
    """Matmul rates, first-call latency, MirroredStrategy scaling and the input pipeline (and a
    blank line after them; nothing if none of them ran)."""
    rows = ["| Measurement | Result |", "|---|---|"]
    for name, record in cases.items():
        case = CASES[name]
        entries = record["competitors"]
        noisy = " †" if record.get("noisy") else ""
        if case.kind == "matmul":
            parts = [
                f"{'PyTorch' if competitor == 'timm' else 'TensorFlow'} {_cell(entry, 'gflops', 0)} GFLOP/s"
                for competitor, entry in entries.items()
            ]
        elif case.kind == "gemms":
            entry = entries.get("keras_vit")
            rate = f"TensorFlow {_cell(entry, 'gflops', 0)} GFLOP/s"
            parts = [f"{rate} = {_cell(entry, 'images_per_s')} images/s"]
        elif case.kind == "first_call":
            parts = [f"{competitor} {_cell(entry, 'seconds')} s" for competitor, entry in entries.items()]
            if {"keras_vit", "keras_hub"} <= set(entries):
                parts.append(f"keras_vit ÷ keras_hub {_ratio(record, 'keras_vit', 'keras_hub')} (speed)")
        elif case.kind == "pipeline":
            parts = [f"{_cell(entries.get('keras_vit'), 'images_per_s', 0)} images/s"]
            if "ratio_to_training" in record:
                parts.append(f"{record['ratio_to_training']['median']:.1f}× keras_vit's training throughput")
        elif "keras_vit_mirrored" in case.competitors:
            parts = [
                f"{_cell(entries.get('keras_vit_mirrored'), 'images_per_s')} images/s",
                f"{_ratio(record, 'keras_vit_mirrored', 'keras_vit')} the single-device step",
            ]
        else:
            continue
        rows.append(f"| {case.title}{noisy} | {', '.join(parts)} |")
    return rows + [""] if len(rows) > 2 else []  # no table without a row


def render(results: dict) -> str:
    """The markdown: a header naming the machine and command, then both tables."""
    machine, settings = results["machine"], results["settings"]
    isa = ", ".join(machine["isa"]) or "no AVX2"
    versions = {}
    for worker in results["versions"].values():
        versions.update(worker)
    version_text = ", ".join(f"{name} {version}" for name, version in sorted(versions.items()))
    lines = [
        f"Measured {results['date'][:10]} on {machine['cpu']} ({machine['cpus']} CPUs; {isa}), "
        f"{settings['threads']} threads per framework, random weights, {settings['rounds']} interleaved "
        f"rounds of at least {settings['min_time']} s per measurement ({version_text}). Reproduce with "
        f"`{results['command']}`, then `python benchmarks/report.py <results.json> --readme`.",
        "",
        *model_table(results["cases"]),
        *other_rows(results["cases"]),
        "Images/s and GFLOP/s are medians over the rounds; ratios are medians of per-round ratios, "
        "comparing each library's faster mode (with or without XLA) in each round. GFLOP/s counts "
        "the model's matmuls and convolution (`benchmarks/cases.py`; a training step is 3× the "
        "forward pass); the share is of TensorFlow's 2048³ matmul rate of the same precision, "
        "measured in the same run.",
    ]
    if set(model_columns(results["cases"])) - {
        "keras_vit",
        "keras_vit_xla",
        "keras_hub",
        "keras_hub_xla",
        "timm",
    }:
        lines.append(BACKENDS_NOTE)
    if any(record.get("noisy") for record in results["cases"].values()):
        lines.append(
            f"† No quiet round (other processes took over {100 * settings['max_other']:.0f}% of the CPUs "
            "in each): unreliable figures."
        )
    return "\n".join(lines) + "\n"


def replace_table(readme: str, table: str) -> str:
    """`readme` with the text between the perf-table markers replaced by `table`."""
    if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
        raise MarkersError(
            f"The README must contain the line {START} once, followed by {END} once: add them where the "
            "performance table belongs, then rerun."
        )
    head, rest = readme.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", help="a JSON file written by benchmarks/run.py")
    parser.add_argument(
        "--readme", nargs="?", const=README, default=None, help=f"update this README (default {README})"
    )
    args = parser.parse_args(argv)
    with open(args.results) as file:
        table = render(json.load(file))
    print(table)
    if args.readme:
        with open(args.readme) as file:
            readme = file.read()
        try:
            updated = replace_table(readme, table)
        except MarkersError as error:
            print(f"error: {args.readme}: {error}", file=sys.stderr)
            return 1
        with open_for_writing(args.readme, "w") as file:
            file.write(updated)
        print(f"updated {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
