"""A container's environment, read as SPEC §2 says. Pure and synchronous.

    parse_env(env, gpus, max_inst=16, unit=GIB) -> Request

`env` is the container's environment (config.json `process.env` as a dict);
`gpus` the node's GPUs (GpuInfo: index, uuid, memory); `max_inst` the GPUs'
max_inst (one number, or one per GPU in the order of `gpus`); `unit` the
node's allocation unit (1 GiB, or 128 MiB on a `share` node: placement.unit_for).

A bad value raises EnvError, whose message is one line: `VARIABLE=value: why`.
Nothing here looks at what is free on the node: fitting among the other
instances is placement's and the model's job (placement.resolve, then the
`register` op). Every rule and decision is in docs/containers.md.

Which GPUs (a GPU is *named* by the first that applies):
  ALIYUN_COM_GPU_VISIBLE_DEVICES  indices or UUIDs: these GPUs are shared;
  ALIYUN_COM_GPU_MEM_IDX          (gpushare device plugin) index or indices: the same;
  NVIDIA_VISIBLE_DEVICES          `all`, indices or UUIDs: these GPUs are shared;
  none of them                    the daemon picks ALIYUN_COM_GPU_COUNT (default 1)
                                  GPUs: Request.count, Request.sizing.
When ALIYUN_COM_GPU_VISIBLE_DEVICES (or _MEM_IDX) and NVIDIA_VISIBLE_DEVICES
are both set, the ALIYUN GPUs must be among the NVIDIA ones: those are shared,
the other NVIDIA GPUs are passed through whole.
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

from cgpud.core.model import MAX_INST, DEFAULT_MAX_INST, GpuInfo
from cgpud.containers.request import GIB, Request, Share, Sizing, UnevenSplit, mib, split, unit_name

MEM_CONTAINER = "ALIYUN_COM_GPU_MEM_CONTAINER"
MEM_DEV = "ALIYUN_COM_GPU_MEM_DEV"
VISIBLE = "ALIYUN_COM_GPU_VISIBLE_DEVICES"
WEIGHT = "ALIYUN_COM_GPU_SCHD_WEIGHT"
HIGH_PRIO = "ALIYUN_COM_GPU_HIGH_PRIO"
DISABLE = "CGPU_DISABLE"
MEM_IDX = "ALIYUN_COM_GPU_MEM_IDX"
MEM_POD = "ALIYUN_COM_GPU_MEM_POD"
COUNT = "ALIYUN_COM_GPU_COUNT"  # [ours] mirrors the aliyun.com/gpu-count label
NVIDIA = "NVIDIA_VISIBLE_DEVICES"
CORE = "ALIYUN_COM_GPU_CORE_PERCENTAGE"  # [ours: ACK's core_mem] the compute percentage (docs/scheduler.md)
CORE_STEP = 5  # core_mem: percentages are multiples of 5: 20 slots of policy 3 (CORE_SLOTS)
CORE_SLOTS = 100 // CORE_STEP

VARIABLES = (MEM_CONTAINER, MEM_DEV, VISIBLE, WEIGHT, HIGH_PRIO, DISABLE, MEM_IDX, MEM_POD, COUNT, NVIDIA, CORE)

MAX_DIGITS = 15
_WHOLE = re.compile(r"[0-9]+\Z")
_NEGATIVE = re.compile(r"-[0-9]+\Z")
_SHOW_MAX = 60


def _show(value: str) -> str:
    """A value as it goes into a one-line message: control characters
    escaped, long values cut."""
    text = value if value.isprintable() else repr(value)[1:-1]
    return text if len(text) <= _SHOW_MAX else text[: _SHOW_MAX - 1] + "…"


class EnvError(ValueError):
    """A bad value in a container's environment. str() is one line:
    `VARIABLE=value: why`."""

    def __init__(self, variable: str, value: str, reason: str) -> None:
        self.variable = variable
        self.value = value
        self.reason = reason
        super().__init__(f"{variable}={_show(value)}: {reason}")


def _get(env: Mapping[str, str], name: str) -> str | None:
    """The value, or None when unset or empty (an empty value counts as unset)."""
    v = env.get(name)
    if v is None or v.strip() == "":
        return None
    return v


def _whole(name: str, raw: str, text: str, what: str, *, minimum: int = 0) -> int:
    t = text.strip()
    if _NEGATIVE.match(t):
        raise EnvError(name, raw, f"{_show(t)} is negative; {what}")
    if not _WHOLE.match(t):
        raise EnvError(name, raw, f"{_show(t) or 'an empty entry'} is not a whole number; {what}")
    if len(t.lstrip("0")) > MAX_DIGITS:
        raise EnvError(name, raw, f"{_show(t)} is too large; {what}")
    n = int(t)
    if n < minimum:
        raise EnvError(name, raw, f"{n} is below {minimum}; {what}")
    return n


def _list(name: str, raw: str) -> list[str]:
    items = [p.strip() for p in raw.split(",")]
    if any(p == "" for p in items):
        raise EnvError(name, raw, "an empty entry in the comma-separated list")
    return items


def _disabled(env: Mapping[str, str]) -> bool | None:
    """True for true/1, False for false/0/unset, None for anything else."""
    v = _get(env, DISABLE)
    if v is None:
        return False
    v = v.strip().lower()
    if v in ("true", "1"):
        return True
    if v in ("false", "0"):
        return False
    return None


class _Node:
    def __init__(self, gpus: Sequence[GpuInfo], max_inst: int | Sequence[int]) -> None:
        if len({g.index for g in gpus}) != len(gpus):
            raise ValueError("two GPUs with the same index")
        self.gpus = list(gpus)
        if isinstance(max_inst, int):
            self.max_inst = {g.index: max_inst for g in gpus}
        else:
            if len(max_inst) != len(gpus):
                raise ValueError(f"max_inst has {len(max_inst)} values for {len(gpus)} GPUs")
            self.max_inst = {g.index: m for g, m in zip(gpus, max_inst)}
        self.by_index = {g.index: g for g in gpus}
        self.by_uuid = {g.uuid.lower(): g for g in gpus}

    def resolve(self, name: str, raw: str, *, uuids: bool = True) -> list[int]:
        """A comma list of indices (or UUIDs) -> GPU indices, in order, distinct."""
        out: list[int] = []
        for item in _list(name, raw):
            if _WHOLE.match(item):
                idx = _whole(name, raw, item, "GPUs are named by index")
                if idx not in self.by_index:
                    raise EnvError(name, raw, f"no GPU {idx} on this node (indices 0..{len(self.gpus) - 1})")
            elif uuids and item.lower().startswith("gpu-"):
                g = self.by_uuid.get(item.lower())
                if g is None:
                    raise EnvError(name, raw, f"no GPU with UUID {_show(item)} on this node")
                idx = g.index
            elif _NEGATIVE.match(item):
                raise EnvError(name, raw, f"{item} is negative; GPUs are named by index 0..{len(self.gpus) - 1}"
                               + (" or UUID" if uuids else ""))
            else:
                raise EnvError(name, raw, f"{_show(item)} is not a GPU index" + (" or UUID (GPU-…)" if uuids else ""))
            if idx in out:
                raise EnvError(name, raw, f"GPU {idx} is named twice")
            out.append(idx)
        return out


def _nvidia(node: _Node, env: Mapping[str, str]) -> list[int] | None:
    """GPUs NVIDIA_VISIBLE_DEVICES names: None when it names nothing (unset,
    empty, `void`), [] for `none`, every GPU for `all`."""
    raw = _get(env, NVIDIA)
    if raw is None or raw.strip().lower() == "void":
        return None
    v = raw.strip().lower()
    if v == "none":
        return []
    if v == "all":
        return [g.index for g in node.gpus]
    return node.resolve(NVIDIA, raw)


def _named(node: _Node, env: Mapping[str, str]) -> tuple[list[int] | None, str | None, list[int] | None]:
    """(shared GPUs or None when nothing names any, the variable that named them,
    the NVIDIA_VISIBLE_DEVICES GPUs or None)."""
    aliyun = None
    raw_vis = _get(env, VISIBLE)
    if raw_vis is not None:
        aliyun = node.resolve(VISIBLE, raw_vis)
    raw_idx = _get(env, MEM_IDX)
    idx = None
    if raw_idx is not None:
        if raw_idx.strip() == "-1":
            raise EnvError(
                MEM_IDX, raw_idx,
                "the device plugin found no GPU with room for this pod"
                + (f" ({NVIDIA}={_show(env[NVIDIA])})" if _get(env, NVIDIA) else ""),
            )
        idx = node.resolve(MEM_IDX, raw_idx, uuids=False)
        if aliyun is not None and set(idx) != set(aliyun):
            raise EnvError(MEM_IDX, raw_idx, f"names other GPUs than {VISIBLE}={_show(raw_vis)}")
    nvidia = _nvidia(node, env)
    if aliyun is not None or idx is not None:
        shared, by = (aliyun, VISIBLE) if aliyun is not None else (idx, MEM_IDX)
        if nvidia is not None:
            outside = [g for g in shared if g not in nvidia]
            if outside:
                raw = raw_vis if by == VISIBLE else raw_idx
                raise EnvError(
                    by, raw or "",
                    f"GPU {outside[0]} is not among the container's {NVIDIA}={_show(env[NVIDIA])}",
                )
        return shared, by, nvidia
    if nvidia is not None:
        if not nvidia:
            raise EnvError(NVIDIA, env[NVIDIA], f"gives the container no GPU, yet {MEM_CONTAINER} asks for GPU memory")
        return nvidia, NVIDIA, nvidia
    return None, None, None


def parse_env(
    env: Mapping[str, str],
    gpus: Sequence[GpuInfo],
    *,
    max_inst: int | Sequence[int] = DEFAULT_MAX_INST,
    unit: int = GIB,
) -> Request:
    """Read a container's environment against this node's GPUs (SPEC §2)."""
    if isinstance(unit, bool) or not isinstance(unit, int) or unit < 1:
        raise ValueError(f"unit must be a number of bytes >= 1, not {unit!r}")
    node = _Node(gpus, max_inst)
    units_word = unit_name(unit)

    # ---- managed at all? ----------------------------------------------------
    disabled = _disabled(env)
    if disabled:
        return Request(managed=False, reason=f"{DISABLE}={_show(env[DISABLE].strip())}", unit=unit)
    raw_mem = _get(env, MEM_CONTAINER)
    if raw_mem is None:
        return Request(managed=False, reason=f"{MEM_CONTAINER} is not set", unit=unit)
    what = f"give whole {units_word} per GPU, e.g. 6 or 3,4,5,6"
    values = [_whole(MEM_CONTAINER, raw_mem, p, what) for p in _list(MEM_CONTAINER, raw_mem)]
    if not any(values):
        return Request(managed=False, reason=f"{MEM_CONTAINER}={_show(raw_mem.strip())}: no GPU memory asked", unit=unit)
    if disabled is None:
        raise EnvError(DISABLE, env[DISABLE], "expected true, 1, false or 0")
    if not node.gpus:
        raise EnvError(MEM_CONTAINER, raw_mem, "this node has no GPU")

    # ---- sizes ---------------------------------------------------------------
    raw_dev = _get(env, MEM_DEV)
    dev = None
    if raw_dev is not None:
        dev = _whole(MEM_DEV, raw_dev, raw_dev, f"give the device's total in whole {units_word}, as you count it")
        if dev == 0:
            raise EnvError(MEM_DEV, raw_dev, "the device's total cannot be 0")

    # ---- weight, priority, pod ----------------------------------------------
    raw_w = _get(env, WEIGHT)
    weight = 1
    if raw_w is not None:
        weight = _whole(WEIGHT, raw_w, raw_w, "give a weight 1..max_inst")
        if weight < 1:
            raise EnvError(WEIGHT, raw_w, "below 1; give a weight 1..max_inst")
        if weight > MAX_INST[1]:
            raise EnvError(WEIGHT, raw_w, f"above {MAX_INST[1]}, the largest max_inst there can be")
    raw_core = _get(env, CORE)
    percentage = None
    if raw_core is not None:
        percentage = _whole(CORE, raw_core, raw_core, f"give a multiple of {CORE_STEP} from {CORE_STEP} to 100")
        if not CORE_STEP <= percentage <= 100 or percentage % CORE_STEP:
            raise EnvError(CORE, raw_core, f"give a multiple of {CORE_STEP} from {CORE_STEP} to 100")
        if raw_w is not None:
            raise EnvError(WEIGHT, raw_w, f"a container with {CORE} has its compute fixed by it; give one of the two")
    raw_hp = _get(env, HIGH_PRIO)
    highprio = False
    if raw_hp is not None:
        if raw_hp.strip() not in ("0", "1"):
            raise EnvError(HIGH_PRIO, raw_hp, "expected 1 (high priority) or 0")
        highprio = raw_hp.strip() == "1"
    raw_pod = _get(env, MEM_POD)
    pod = None
    if raw_pod is not None:
        pod = _whole(MEM_POD, raw_pod, raw_pod, f"the pod's total in whole {units_word}")
    raw_count = _get(env, COUNT)
    count = None
    if raw_count is not None:
        count = _whole(COUNT, raw_count, raw_count, "give how many GPUs the daemon should pick", minimum=1)

    # ---- which GPUs ------------------------------------------------------------
    shared, by, nvidia = _named(node, env)
    common = dict(managed=True, unit=unit, weight=weight, policy2=weight > 1, highprio=highprio, pod_units=pod,
                  percentage=percentage)

    def too_big(v: int, memory: int | None) -> str | None:
        if dev is not None:
            return f"{v} {units_word} is more than {MEM_DEV}={dev}, the whole device" if v > dev else None
        if memory is not None and v * unit > memory:
            return f"{v} {units_word} is more than the {mib(memory)} of"
        return None

    if shared is None:
        # The daemon picks.
        if len(values) > 1:
            raise EnvError(MEM_CONTAINER, raw_mem,
                           f"a list of per-GPU values needs GPUs named by {VISIBLE} or {NVIDIA}; "
                           f"without them give one value")
        m = count or 1
        if m > len(node.gpus):
            raise EnvError(COUNT, raw_count or "", f"this node has {len(node.gpus)} GPUs; all of them must be on it")
        try:
            per = split(Sizing(values[0], unit, dev), m)
        except UnevenSplit:
            raise EnvError(MEM_CONTAINER, raw_mem,
                           f"{values[0]} {units_word} over {COUNT}={m} GPUs is not whole per GPU; "
                           f"ask a multiple of {m}") from None
        biggest = max((g.memory for g in node.gpus), default=0)
        reason = too_big(per.units, biggest)
        if reason:
            raise EnvError(MEM_CONTAINER, raw_mem, (reason + " the largest GPU here") if dev is None else reason)
        smallest = min(g.memory for g in node.gpus)
        if per.memsize(smallest) == 0:
            raise EnvError(MEM_DEV, raw_dev or "", f"{per} of a {mib(smallest)} GPU is 0 bytes")
        if weight > max(node.max_inst.values(), default=0):
            raise EnvError(WEIGHT, raw_w or "", f"above max_inst of every GPU ({max(node.max_inst.values())} at most)")
        return Request(count=m, sizing=per, **common)

    if count is not None and count != len(shared):
        raise EnvError(COUNT, raw_count or "", f"{by} names {len(shared)} GPU{'s' if len(shared) > 1 else ''}; the count disagrees")
    if len(values) > len(shared):
        raise EnvError(MEM_CONTAINER, raw_mem,
                       f"{len(values)} values for the {len(shared)} GPU{'s' if len(shared) > 1 else ''} named by {by}")
    values = values + [values[-1]] * (len(shared) - len(values))  # the last value repeats
    shares = []
    for idx, v in zip(shared, values):
        if v == 0:
            continue
        info = node.by_index[idx]
        reason = too_big(v, info.memory)
        if reason:
            raise EnvError(MEM_CONTAINER, raw_mem, reason if dev is not None else f"{reason} GPU {idx}")
        if weight > node.max_inst[idx]:
            raise EnvError(WEIGHT, raw_w or "", f"above max_inst {node.max_inst[idx]} of GPU {idx}")
        memsize = Sizing(v, unit, dev).memsize(info.memory)
        if memsize == 0:
            raise EnvError(MEM_DEV, raw_dev or "", f"{v}/{dev} of GPU {idx}'s {mib(info.memory)} is 0 bytes")
        shares.append(Share(idx, memsize, v))
    # `values` has a non-zero entry and no more entries than GPUs, so `shares` is not empty.
    managed = {s.gpu for s in shares}
    passthrough = sorted((set(nvidia or []) | set(shared)) - managed)
    return Request(shares=tuple(shares), passthrough=tuple(passthrough), **common)
