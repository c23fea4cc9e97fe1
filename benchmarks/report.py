"""Render the performance tables (markdown) from a `run.py` results file.

    python benchmarks/report.py benchmarks/results/<machine>.json            # print the tables
    python benchmarks/report.py benchmarks/results/<machine>.json --readme   # and put them in README.md

With `--readme [PATH]` the text between the lines `<!-- perf-table:start -->` and
`<!-- perf-table:end -->` of the README is replaced; the markers must be there, once each.
Every figure is a median over the run's kept rounds; ratios are medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from cases import CASES, COMPETITORS

START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
MODEL_COLUMNS = ("keras_vit", "keras_vit_xla", "keras_hub", "keras_hub_xla", "timm")


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
        for name in ("keras_vit", "keras_vit_xla")
        if "images_per_s" in record["competitors"].get(name, {})
    ]
    return max(candidates, key=lambda entry: entry["images_per_s"]["median"], default=None)


def model_table(cases: dict) -> list[str]:
    """Inference and training throughput (images/s) of every library, ratios, GFLOP/s."""
    rows = [
        "| Case (images/s) | "
        + " | ".join(COMPETITORS[name].label for name in MODEL_COLUMNS)
        + " | keras_vit ÷ keras_hub "
        "| keras_vit ÷ timm | keras_vit GFLOP/s (share of matmul) |",
        "|---|" + "---:|" * (len(MODEL_COLUMNS) + 3),
    ]
    for name, record in cases.items():
        case = CASES[name]
        if case.kind not in ("infer", "train") or "keras_hub" not in case.competitors:
            continue
        cells = [_cell(record["competitors"].get(column), "images_per_s") for column in MODEL_COLUMNS]
        best = _fastest_keras_vit(record)
        flops = "–"
        if best is not None and "gflops" in best:
            flops = f"{best['gflops']['median']:.0f}"
            if "matmul_share" in best:
                flops += f" ({100 * best['matmul_share']:.0f}%)"
        noisy = " †" if record.get("noisy") else ""
        cells += [_ratio(record, "keras_vit", "keras_hub"), _ratio(record, "keras_vit", "timm"), flops]
        rows.append(f"| {case.title}{noisy} | " + " | ".join(cells) + " |")
    return rows


def other_rows(cases: dict) -> list[str]:
    """Matmul rates, first-call latency, MirroredStrategy scaling and the input pipeline."""
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
        elif case.kind == "first_call":
            parts = [f"{competitor} {_cell(entry, 'seconds')} s" for competitor, entry in entries.items()]
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
    return rows


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
        "",
        *other_rows(results["cases"]),
        "",
        "Images/s and GFLOP/s are medians over the rounds; ratios are medians of per-round ratios, "
        "comparing each library's faster mode (with or without XLA) in each round. GFLOP/s counts "
        "the model's matmuls and convolution (`benchmarks/cases.py`; a training step is 3× the "
        "forward pass); the share is of TensorFlow's 2048³ matmul rate of the same precision, "
        "measured in the same run.",
    ]
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
        with open(args.readme, "w") as file:
            file.write(updated)
        print(f"updated {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
