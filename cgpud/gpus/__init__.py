"""GPU inventories. One interface, several backends:

    discover(spec) -> list[GpuInfo]

`sim:…` and `file:…` specs give simulated GPUs (gpus/sim.py); `nvml` gives the
real ones (a later backend behind the same call).
"""
from __future__ import annotations

from ..model import GpuInfo
from .sim import BadSpec, parse_sim, load_file

__all__ = ["discover", "BadSpec", "GpuInfo"]


def discover(spec: str) -> list[GpuInfo]:
    spec = spec.strip()
    if spec.startswith("sim:"):
        return parse_sim(spec[4:])
    if spec.startswith("file:"):
        return load_file(spec[5:])
    if spec == "nvml":
        raise BadSpec("--gpus nvml: the NVML backend is not part of this version yet; use sim:MODEL")
    raise BadSpec(
        f"--gpus {spec!r}: expected sim:MODEL (sim:T4, sim:4xT4, sim:2xA10,1xV100, sim:NAME:MIB) or file:PATH"
    )
