"""The machine a benchmark ran on, as its results record it (shared by the benchmark scripts)."""

from __future__ import annotations

import subprocess


def lscpu(*fields: str) -> dict[str, str]:
    """`lscpu`'s `fields` (e.g. "Model name", "CPU(s)", "Flags"), those it printed."""
    output = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    pairs = (line.split(":", 1) for line in output.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs if key.strip() in fields}
