"""The machine a benchmark ran on, as its results record it (shared by the benchmark scripts); the CPU's
model name is the package's (`keras_vit.utils.environment.cpu_model`, what run reports record)."""

from __future__ import annotations

import os
import subprocess

from keras_vit.utils.environment import cpu_model

__all__ = ["ISA_FLAGS", "busy_seconds", "cpu_model", "isa_flags", "lscpu"]

# The instruction-set flags that decide matmul speed on a CPU.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def lscpu(*fields: str) -> dict[str, str]:
    """`lscpu`'s `fields` (e.g. "Model name", "CPU(s)", "Flags"), those it printed ({} without lscpu)."""
    try:
        output = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return {}
    pairs = (line.split(":", 1) for line in output.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs if key.strip() in fields}


def isa_flags() -> list[str]:
    """Which of `ISA_FLAGS` this CPU has."""
    flags = lscpu("Flags").get("Flags", "").split()
    return [flag for flag in ISA_FLAGS if flag in flags]


def busy_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (all but idle and iowait)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
