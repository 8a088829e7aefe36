"""GPU inventories. One interface, several backends:

    discover(spec) -> list[GpuInfo]

`sim:…` and `file:…` specs give simulated GPUs (gpus/sim.py); `nvml` gives the
real ones (gpus/nvml.py; its errors are BadSpec too, one line each).
"""
from __future__ import annotations

from cgpud.core.model import GpuInfo
from cgpud.gpus.sim import BadSpec, parse_sim, load_file

__all__ = ["discover", "BadSpec", "GpuInfo"]


def discover(spec: str) -> list[GpuInfo]:
    spec = spec.strip()
    if spec.startswith("sim:"):
        return parse_sim(spec[4:])
    if spec.startswith("file:"):
        return load_file(spec[5:])
    if spec == "nvml":
        from cgpud.gpus.nvml import discover_nvml

        return discover_nvml()
    raise BadSpec(
        f"--gpus {spec!r}: expected sim:MODEL (sim:T4, sim:4xT4, sim:2xA10,1xV100, sim:NAME:MIB), file:PATH or nvml"
    )
