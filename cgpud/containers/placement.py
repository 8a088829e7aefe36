"""Which GPUs a container gets when it names none: SPEC §3 and §6. Pure and synchronous.

    place(gpus, need, count, strategy=, mode=, weight=) -> [(gpu index, memsize bytes), …]

`gpus` is a snapshot of the node as plain data (`GpuState`, from a `Node` or
from the control socket's `query` answer); nothing here touches the node. The
answer is a plan: the caller registers it, and the model still refuses what
does not fit (the node may have changed in between).

- binpack (default): among the GPUs where the request fits, the one with the
  LEAST free memory, so whole GPUs stay free; spread: the MOST free memory, so
  replicas do not share a failure. Ties go to the lower index. A request for M
  GPUs takes the first M candidates in that order.
- "free memory" is the GPU's memory minus the memsizes promised to its
  instances (admitted with a memory request; not what processes hold right
  now, and not the memsizes of instances that asked for none, which may
  overcommit: SPEC §3), taken before this request.
- Admission keeps promises: a GPU is a candidate only when the request's
  memsize fits in its free memory. When fewer than M GPUs qualify: `PlacementError`, one line
  saying what was asked and what each GPU has.
- Modes (a node setting): `exclusive` (a GPU that holds any instance is not a
  candidate), `share` (sharing without isolation: up to max_inst instances,
  allocation unit 128 MiB), `cgpu` (isolation: at most 16 instances per GPU,
  whatever max_inst says), `mps` (placed as `cgpu`).
- Multi-GPU: N units over M GPUs is N/M units on each; N/M must be whole
  (`split`, `UnevenSplit`); all M GPUs are on this node.

The request and its sizing (`Request`, `Sizing`, `split`) are in
containers.request, which envspec fills in. The allocation unit is 1 GiB, or
128 MiB on a node in `share` mode (`unit_for`). See docs/containers.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

from cgpud.core.model import NoSpace

from cgpud.containers.request import GIB, SHARE_UNIT, Request, Sizing, mib, split

if TYPE_CHECKING:  # pragma: no cover
    from cgpud.core.model import Node

CGPU_MAX_SHARE = 16  # instances per GPU where the memory isolation module is the limit (seeds)

MODES = ("exclusive", "share", "cgpu", "core_mem", "mps")
STRATEGIES = ("binpack", "spread")
DEFAULT_MODE = "cgpu"
DEFAULT_STRATEGY = "binpack"


class PlacementError(NoSpace):
    """Nothing fits: ENOSPC on the control socket, like the model's NoSpace."""


def unit_for(mode: str) -> int:
    """The allocation unit in bytes: 128 MiB on a `share` node, else 1 GiB."""
    _check_mode(mode)
    return SHARE_UNIT if mode == "share" else GIB


@dataclass(frozen=True)
class GpuState:
    """What placement needs to know of one GPU."""

    index: int
    memory: int  # bytes, the device's total
    free: int  # bytes not promised to an instance: memory − Σ memsize
    instances: int
    max_inst: int
    uuid: str = ""
    failed: str = ""  # out of service, and why (a GPU's health: docs/gpus.md)


def out_of_service(health: dict | None) -> str:
    """Why a GPU is out of service, from its health (a GPU's `health`, query's "health"); "" in service."""
    h = health or {}
    return "" if h.get("healthy", True) else str(h.get("reason") or "failed")


def states_from_node(node: "Node") -> list[GpuState]:
    return [
        GpuState(g.index, g.info.memory, g.free_memory, len(g.instances), g.max_inst, g.info.uuid,
                 out_of_service(g.health))
        for g in node.gpus
    ]


def states_from_snapshot(snap: dict) -> list[GpuState]:
    """From `cgpud.control.views.snapshot(node)` / the `query` op's result."""
    out = []
    for g in snap["gpus"]:
        # (a daemon from before overcommit sends no "promised": every memsize was promised then)
        promised = sum(int(i["memsize"]) for i in g["instances"] if i.get("promised", True))
        out.append(
            GpuState(int(g["index"]), int(g["memory"]), int(g["memory"]) - promised, len(g["instances"]),
                     int(g["max_inst"]), str(g.get("uuid", "")), out_of_service(g.get("health")))
        )
    return out


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown node mode {mode!r}; one of {', '.join(MODES)}")


def instance_cap(gpu: GpuState, mode: str) -> int:
    """How many instances `gpu` may hold in `mode`."""
    _check_mode(mode)
    if mode == "exclusive":
        return 1
    if mode in ("cgpu", "core_mem", "mps"):
        return min(gpu.max_inst, CGPU_MAX_SHARE)
    return gpu.max_inst


def why_not(gpu: GpuState, need: int, mode: str, weight: int = 1) -> str | None:
    """None when a new instance of `need` bytes and `weight` may go on `gpu`;
    else the reason, a few words."""
    if gpu.failed:
        return f"out of service ({gpu.failed})"
    cap = instance_cap(gpu, mode)
    if gpu.instances >= cap:
        if mode == "exclusive":
            return "taken (exclusive mode: one instance per GPU)"
        if mode in ("cgpu", "mps") and cap < gpu.max_inst:
            return f"full: {gpu.instances} instances ({mode} mode: at most {CGPU_MAX_SHARE} per GPU)"
        return f"full: {gpu.instances} instances (max_inst {gpu.max_inst})"
    if weight > gpu.max_inst:
        return f"max_inst {gpu.max_inst} is below weight {weight}"
    if need > gpu.free:
        return f"needs {mib(need)}, has {mib(gpu.free)} free of {mib(gpu.memory)}"
    return None


def _bytes_on(need: Sizing | int, gpu: GpuState) -> int:
    return need.memsize(gpu.memory) if isinstance(need, Sizing) else need


def _validate(gpus: Sequence[GpuState], need: Sizing | int, count: int, strategy: str, mode: str, weight: int) -> None:
    _check_mode(mode)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    if not isinstance(need, Sizing) and (isinstance(need, bool) or not isinstance(need, int) or need < 0):
        raise ValueError(f"need is a Sizing or a number of bytes >= 0, not {need!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a whole number >= 1, not {count!r}")
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
        raise ValueError(f"weight must be a whole number >= 0, not {weight!r}")
    if len({g.index for g in gpus}) != len(gpus):
        raise ValueError("two GPU states with the same index")


def _asked(need: Sizing | int, count: int) -> str:
    what = str(need) if isinstance(need, Sizing) else mib(need)
    return f"{count} GPU{'s' if count > 1 else ''} with {what}{' each' if count > 1 else ''}"


def _report(gpus: Iterable[GpuState], need: Sizing | int, mode: str, weight: int) -> str:
    parts = []
    for g in sorted(gpus, key=lambda g: g.index):
        reason = why_not(g, _bytes_on(need, g), mode, weight)
        parts.append(f"GPU {g.index} " + (reason or f"fits ({mib(g.free)} free of {mib(g.memory)})"))
    return "; ".join(parts) if parts else "this node has no GPU"


def place(
    gpus: Sequence[GpuState],
    need: Sizing | int,
    count: int = 1,
    *,
    strategy: str = DEFAULT_STRATEGY,
    mode: str = DEFAULT_MODE,
    weight: int = 1,
) -> list[tuple[int, int]]:
    """Pick `count` distinct GPUs for instances of `need` (a Sizing, or bytes
    on every GPU) and `weight`; returns [(gpu index, memsize bytes)] in the
    order chosen. Raises PlacementError when fewer than `count` GPUs qualify."""
    _validate(gpus, need, count, strategy, mode, weight)
    fits = [g for g in gpus if why_not(g, _bytes_on(need, g), mode, weight) is None]
    if strategy == "binpack":
        fits.sort(key=lambda g: (g.free, g.index))
    else:
        fits.sort(key=lambda g: (-g.free, g.index))
    if len(fits) < count:
        raise PlacementError(
            f"no room for {_asked(need, count)} ({strategy}, {mode} mode): {_report(gpus, need, mode, weight)}"
        )
    return [(g.index, _bytes_on(need, g)) for g in fits[:count]]


def place_split(
    gpus: Sequence[GpuState],
    total: Sizing,
    count: int,
    *,
    strategy: str = DEFAULT_STRATEGY,
    mode: str = DEFAULT_MODE,
    weight: int = 1,
) -> list[tuple[int, int]]:
    """N units over M GPUs of this node: N/M on each (UnevenSplit unless whole)."""
    if count > len(gpus):
        raise PlacementError(f"{total} over {count} GPUs: this node has {len(gpus)}")
    return place(gpus, split(total, count), count, strategy=strategy, mode=mode, weight=weight)


def check_named(
    gpus: Sequence[GpuState],
    wanted: Sequence[tuple[int, int]],
    *,
    mode: str = DEFAULT_MODE,
    weight: int = 1,
) -> list[tuple[int, int]]:
    """The container named its GPUs: check each (gpu, memsize) by the same
    rules as `place` (mode, weight, no overcommit); returns `wanted`."""
    _check_mode(mode)
    by_index = {g.index: g for g in gpus}
    bad = []
    for idx, memsize in wanted:
        g = by_index.get(idx)
        reason = "is not on this node" if g is None else why_not(g, memsize, mode, weight)
        if reason:
            bad.append(f"GPU {idx} {reason}")
    if bad:
        asked = ", ".join(f"{mib(m)} on GPU {i}" for i, m in wanted)
        raise PlacementError(f"no room for {asked} ({mode} mode): " + "; ".join(bad))
    return list(wanted)


def resolve(
    request: "Request",
    gpus: Sequence[GpuState],
    *,
    strategy: str = DEFAULT_STRATEGY,
    mode: str = DEFAULT_MODE,
) -> list[tuple[int, int]]:
    """The instances a parsed container request (cgpud.containers.envspec.Request) gets on
    this node: the GPUs it named, checked, or the ones `place` picks.
    An unmanaged request gets none."""
    if not request.managed:
        return []
    if request.unit != unit_for(mode):
        raise ValueError(
            f"the request was read in units of {request.unit} bytes; a {mode} node allocates in {unit_for(mode)}"
        )
    if request.shares:
        return check_named(gpus, [(s.gpu, s.memsize) for s in request.shares], mode=mode, weight=request.weight)
    return place(gpus, request.sizing, request.count, strategy=strategy, mode=mode, weight=request.weight)
