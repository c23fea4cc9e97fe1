"""The tables of an issue-36 run (`gpu/run_issue36.sh`): one markdown summary of a results folder.

    python benchmarks/issue36_report.py DIR [DIR ...] > DIR/summary.md

Reads each DIR's `gpu_experiments.jsonl` (keras_vit on JAX: the stock model and the experimental
variants, kernel profiles), `gpu_results.jsonl` (`gpu.py`: timm eager, compiled with foreach and
fused AdamW, keras_vit on the torch backend) and `input_probe.jsonl`; several DIRs (several device
calls on one machine) are read as one run. Only what was measured is printed: a pair that did
not run is "–", one that failed or was skipped says so.
"""

from __future__ import annotations

import json
import os
import sys

COMPETITORS = (
    ("keras_vit_jax", "keras_vit JAX"),
    ("timm", "timm eager"),
    ("timm_compiled", "timm + compile (foreach AdamW)"),
    ("timm_compiled_fused", "timm + compile (fused AdamW)"),
    ("keras_vit_torch", "keras_vit PyTorch"),
)


def read_lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as file:
        return [json.loads(line) for line in file if line.strip()]


def cell(entry: dict | None, digits: int = 0) -> str:
    if entry is None:
        return "–"
    if "images_per_s" in entry:
        value = entry["images_per_s"]
        value = value["median"] if isinstance(value, dict) else value
        return f"{value:,.{digits}f}"
    if "error" in entry:
        return "failed"
    return "skipped"


def images(entry: dict | None) -> float | None:
    if entry and "images_per_s" in entry:
        value = entry["images_per_s"]
        return value["median"] if isinstance(value, dict) else value
    return None


def report(folders: list[str]) -> str:
    experiments, results, probe = [], [], []
    for call, folder in enumerate(folders, 1):  # each entry remembers its device call
        experiments += [
            {**e, "call": call} for e in read_lines(os.path.join(folder, "gpu_experiments.jsonl"))
        ]
        results += [{**e, "call": call} for e in read_lines(os.path.join(folder, "gpu_results.jsonl"))]
        probe += [{**e, "call": call} for e in read_lines(os.path.join(folder, "input_probe.jsonl"))]
    out = []
    starts = [e for e in results if e.get("event") == "start"]
    machine = starts[0]["machine"] if starts else {}
    gpu, memory, driver = (machine.get(key, "?") for key in ("gpu", "gpu_memory", "driver"))
    out.append(f"GPU: {gpu} ({memory}, driver {driver})")
    for entry in [e for e in experiments if e.get("event") == "start"][:1]:
        out.append(f"keras_vit JAX process: {json.dumps(entry['versions'])}")
    for entry in results:
        if entry.get("event") == "worker":
            out.append(f"{entry['family']} worker: {json.dumps(entry['versions'])}")
    out.append("")

    # Matmul rates.
    rates = {}
    for entry in experiments:
        if entry.get("case", "").startswith("matmul") and "tflops" in entry and not entry.get("tag"):
            rates["JAX bf16"] = entry["tflops"]
    for entry in results:
        if entry.get("case", "").startswith("matmul") and "tflops" in entry:
            tag = "bf16" if "bf16" in entry["case"] else "TF32"
            rates[f"torch {tag}"] = entry["tflops"]["median"]
    out.append(
        "Measured 8192³ matmul rates: "
        + ", ".join(f"{name} {value:.0f} TFLOP/s" for name, value in rates.items())
    )
    bf16 = max([v for k, v in rates.items() if "bf16" in k], default=None)
    out.append("")

    # Competitors: every measurement of a pair, in call order ("a [call] / b [call]"); the ratios of
    # keras_vit JAX to timm compiled only between measurements of the same call.
    stock = [
        e
        for e in experiments
        if e.get("variant") == "stock" and e.get("tag") in ("", None, "repeat") and "case" in e
    ]
    by_pair: dict[tuple[str, str], list[dict]] = {}
    for entry in stock:
        by_pair.setdefault((entry["case"], "keras_vit_jax"), []).append(entry)
    for entry in results:
        if "competitor" in entry and not entry["case"].startswith("matmul"):
            by_pair.setdefault((entry["case"], entry["competitor"]), []).append(entry)
    cases = [case for case in dict.fromkeys(case for case, _ in by_pair) if not case.startswith("matmul")]
    out.append(
        "| case | "
        + " | ".join(label for _, label in COMPETITORS)
        + " | JAX ÷ compiled fused | JAX ÷ compiled foreach |"
    )
    out.append("|---|" + "---:|" * (len(COMPETITORS) + 2))
    for case in cases:
        row = []
        for name, _ in COMPETITORS:
            entries = by_pair.get((case, name), [])
            measured = [e for e in entries if images(e)]
            shown = measured or entries[:1]
            row.append(" / ".join(f"{cell(e)} [{e['call']}]" for e in shown) if shown else "–")
        ratios = []
        for reference in ("timm_compiled_fused", "timm_compiled"):
            pairs = [
                f"{images(ours) / images(theirs):.2f}× [{ours['call']}]"
                for ours in by_pair.get((case, "keras_vit_jax"), [])
                for theirs in by_pair.get((case, reference), [])
                if images(ours) and images(theirs) and ours["call"] == theirs["call"]
            ]
            ratios.append(" / ".join(pairs) or "–")
        out.append(f"| {case} | " + " | ".join(row) + " | " + " | ".join(ratios) + " |")
    out.append("")
    out.append("[n]: the device call (results folder, in the order given) of the measurement.")
    out.append("")

    # Variants, each against the first untagged stock measurement of its case.
    first_stock: dict[str, dict] = {}
    for entry in stock:
        if not entry.get("tag"):
            first_stock.setdefault(entry["case"], entry)
    out.append(
        "| case | variant | tag (XLA flags) | images/s | TFLOP/s | share of bf16 matmul | vs stock | "
        "kernels ms/step | first step loss / logits vs stock |"
    )
    out.append("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for entry in experiments:
        if "variant" not in entry or entry.get("case", "").startswith("matmul"):
            continue
        reference = images(first_stock.get(entry["case"]))
        value = images(entry)
        share = f"{entry['tflops'] / bf16:.0%}" if value and bf16 else "–"
        versus = f"{value / reference:.3f}×" if value and reference else "–"
        kernels = entry.get("kernels", {}).get("total_ms_per_step")
        difference = entry.get("loss_vs_stock", entry.get("logits_vs_stock"))
        state = cell(entry, 1) if value else (entry.get("error") or entry.get("skipped") or "–")[:120]
        out.append(
            f"| {entry['case']} | {entry['variant']} | {entry.get('tag') or ''} | {state} | "
            + (f"{entry['tflops']:.0f}" if value else "–")
            + f" | {share} | {versus} | "
            + (f"{kernels:.2f}" if kernels else "–")
            + " | "
            + (
                f"{difference:.1e}"
                if difference is not None and "weights" in entry
                else "not compared (zero head)"
                if difference is not None
                else "–"
            )
            + " |"
        )
    out.append("")

    # Profiles.
    for entry in experiments:
        kernels = entry.get("kernels")
        if not kernels or "by_fine_kind_ms_per_step" not in kernels:
            continue
        wall = images(entry)
        title = f"{entry['case']} {entry['variant']} {entry.get('tag') or ''}".strip()
        if wall and "batch" in entry:
            title += f": {1e3 * entry['batch'] / wall:.2f} ms per step (or call) wall"
        out.append(f"Kernels per step, {title} (sum {kernels['total_ms_per_step']:.2f} ms):")
        out.append("")
        out.append("| kind | ms/step | share |")
        out.append("|---|---:|---:|")
        total = kernels["total_ms_per_step"]
        for kind, ms in kernels["by_fine_kind_ms_per_step"].items():
            out.append(f"| {kind} | {ms:.2f} | {ms / total:.0%} |")
        out.append("")
        out.append(
            "Top kernels: "
            + "; ".join(
                f"{row['name'][:60]} {row['ms_per_step']:.2f} ms"
                for row in kernels.get("top_kernels", [])[:12]
            )
        )
        out.append("")

    # Input probe.
    rows = [e for e in probe if "pipeline" in e]
    if rows:
        workers = sorted({e["workers"] for e in rows})
        out.append("| pipeline | " + " | ".join(f"{w} workers" for w in workers) + " |")
        out.append("|---|" + "---:|" * len(workers) + "")
        for pipeline in dict.fromkeys(e["pipeline"] for e in rows):
            cells = []
            for w in workers:
                entries = [e for e in rows if e["pipeline"] == pipeline and e["workers"] == w]
                entry = next((e for e in entries if images(e)), entries[0] if entries else None)
                cells.append(cell(entry))
            out.append(f"| {pipeline} | " + " | ".join(cells) + " |")
        for entry in probe[:1]:
            if entry.get("event") == "start":
                out.append("")
                out.append(
                    f"{entry['images']} JPEGs, mean {entry['mean_jpeg_bytes'] / 1e3:.0f} kB; "
                    f"versions {json.dumps(entry['versions'])}"
                )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    print(report(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
