"""Simulated GPUs: what `--gpus sim:…` or a file describes.

Specs (comma-separated groups, indices assigned in order):
  sim:T4            one Tesla T4 (15109 MiB)
  sim:4xT4          four of them
  sim:2xA10,1xT4    mixed
  sim:MyGPU:8192    a device named MyGPU with 8192 MiB
  sim:2xMyGPU:8192

A file (`file:PATH`, TOML):
  [[gpu]]
  model = "T4"          # or name = "…" and memory_mib = N
  count = 2

UUIDs are derived from the machine, the index and the name, so they are the
same at every start with the same spec.
"""
from __future__ import annotations

import re
import socket
import tomllib
import uuid

from cgpud.core.model import GpuInfo

MIB = 1 << 20
SIM_MAJOR = 243  # the char-device major reported for simulated GPUs (a local/experimental number)

# name, total MiB as nvidia-smi reports it
MODELS: dict[str, tuple[str, int]] = {
    "T4": ("Tesla T4", 15109),
    "V100": ("Tesla V100-SXM2-16GB", 16160),
    "V100-32G": ("Tesla V100-SXM2-32GB", 32510),
    "P4": ("Tesla P4", 7611),
    "A10": ("NVIDIA A10", 22731),
    "A100": ("NVIDIA A100-SXM4-40GB", 40960),
    "A100-80G": ("NVIDIA A100-SXM4-80GB", 81920),
    "L4": ("NVIDIA L4", 23034),
    "H100": ("NVIDIA H100 80GB HBM3", 81559),
}

_GROUP = re.compile(r"(?:(\d+)x)?([A-Za-z0-9_.+-]+)(?::(\d+))?\Z")
MAX_GPUS = 10  # inst_ctl addresses a GPU with one digit


class BadSpec(ValueError):
    pass


def _machine_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path) as f:
                value = f.read().strip()
            if value:
                return value
        except OSError:
            pass
    return socket.gethostname()


def sim_uuid(index: int, name: str, machine: str | None = None) -> str:
    u = uuid.uuid5(uuid.NAMESPACE_OID, f"cgpud-sim/{machine or _machine_id()}/{index}/{name}")
    return f"GPU-{u}"


def _build(groups: list[tuple[int, str, int]]) -> list[GpuInfo]:
    machine = _machine_id()
    out: list[GpuInfo] = []
    for count, name, mib in groups:
        for _ in range(count):
            i = len(out)
            out.append(GpuInfo(index=i, uuid=sim_uuid(i, name, machine), name=name, memory=mib * MIB, major=SIM_MAJOR))
    if not out:
        raise BadSpec("no GPUs described")
    if len(out) > MAX_GPUS:
        raise BadSpec(f"{len(out)} GPUs described; at most {MAX_GPUS} (inst_ctl names a GPU with one digit)")
    return out


def _group(count: int, model: str, mib: int | None, where: str) -> tuple[int, str, int]:
    if count < 1:
        raise BadSpec(f"{where}: a count must be at least 1")
    if mib is None:
        known = MODELS.get(model.upper()) or MODELS.get(model)
        if known is None:
            raise BadSpec(f"{where}: unknown model {model!r}; known: {', '.join(MODELS)}, or give NAME:MIB")
        return count, known[0], known[1]
    if not 1 <= mib <= 1 << 24:
        raise BadSpec(f"{where}: memory must be 1..{1 << 24} MiB")
    return count, model, mib


def parse_sim(body: str) -> list[GpuInfo]:
    groups = []
    for part in body.split(","):
        m = _GROUP.match(part.strip())
        if not m:
            raise BadSpec(f"sim:{body}: cannot read {part!r}; expected [COUNTx]MODEL or [COUNTx]NAME:MIB")
        count, model, mib = m.groups()
        groups.append(_group(int(count or 1), model, int(mib) if mib else None, f"sim:{body}"))
    return _build(groups)


def load_file(path: str) -> list[GpuInfo]:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise BadSpec(f"file:{path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise BadSpec(f"file:{path}: not valid TOML: {exc}") from None
    entries = doc.get("gpu")
    if not isinstance(entries, list) or not entries:
        raise BadSpec(f"file:{path}: expected one or more [[gpu]] tables")
    groups = []
    for n, e in enumerate(entries):
        where = f"file:{path} [[gpu]] #{n + 1}"
        if not isinstance(e, dict):
            raise BadSpec(f"{where}: not a table")
        count = e.get("count", 1)
        if not isinstance(count, int):
            raise BadSpec(f"{where}: count must be an integer")
        if "model" in e:
            groups.append(_group(count, str(e["model"]), None, where))
        elif "name" in e and isinstance(e.get("memory_mib"), int):
            groups.append(_group(count, str(e["name"]), e["memory_mib"], where))
        else:
            raise BadSpec(f"{where}: give model = \"T4\", or name = \"…\" and memory_mib = N")
    return _build(groups)
