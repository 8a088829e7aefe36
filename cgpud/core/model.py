"""The node, its GPUs and their instances: SPEC §1–§4. Pure and synchronous.

Every invariant of SPEC §4 is enforced here and only here. A change that would
break one raises a typed error and changes nothing:

- InvalidValue: malformed or out of range (EINVAL on the tree);
- Busy:        would break an invariant (EBUSY);
- NoSpace:     no room for a new instance or its memory (ENOSPC);
- Exists:      the name is already on that GPU (EEXIST);
- NotFound:    no such GPU or instance (ENOENT);
- OutOfMemory: an allocation past the instance's memsize.

Per GPU, after any sequence of operations:
  len(instances) <= max_inst;  sum(weight) <= max_inst;  free_weight >= 0;
  each memsize <= device memory;  sum(memsize of promised instances) <= device
  memory;  each instance's used memory <= its memsize;  sum(used) <= device memory.

Memsizes may overcommit, as on the real cgpu_km (SPEC §3): an instance made
through `inst_ctl` or without a memory request promises nothing, and the sum
of memsizes may pass the device. An instance made by admission with a memory
request (a container's ALIYUN_COM_GPU_MEM_CONTAINER, `cgpu run --mem`) is
`promised`: the promised memsizes of a GPU never pass its memory.
"""
from __future__ import annotations

import errno
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

POLICIES = range(0, 6)
MAX_INST = (1, 25)
DEFAULT_MAX_INST = 16
PRIO_RATIO = (20, 99)
DEFAULT_PRIO_RATIO = 80
NAME_LEN = 12
NAME_RE = re.compile(r"[0-9A-Za-z_.-]{%d}\Z" % NAME_LEN)
MEMSIZE_MAX_DIGITS = 14  # "≤ 15 bytes" on the tree, the newline included


class ModelError(Exception):
    pass


class InvalidValue(ModelError):
    pass


class Busy(ModelError):
    pass


class NoSpace(ModelError):
    pass


class Exists(ModelError):
    pass


class NotFound(ModelError):
    pass


class OutOfMemory(ModelError):
    pass


# The one errno table: each typed error as the errno the tree and the control
# socket answer with.
ERRNOS = {
    InvalidValue: errno.EINVAL,
    Busy: errno.EBUSY,
    NoSpace: errno.ENOSPC,
    Exists: errno.EEXIST,
    NotFound: errno.ENOENT,
    OutOfMemory: errno.ENOMEM,
}


def errno_of(exc: ModelError) -> int:
    return next(code for cls, code in ERRNOS.items() if isinstance(exc, cls))


@dataclass(frozen=True)
class GpuInfo:
    """What the inventory says of one device."""

    index: int
    uuid: str
    name: str
    memory: int  # bytes
    major: int = 0
    minor: int | None = None  # a real GPU's device file is /dev/nvidia<minor> (None: simulated)


@dataclass
class Instance:
    name: str
    gpu: int
    id: int
    memsize: int
    weight: int
    highprio: bool = False
    # Made by admission with a memory request: its memsize is promised, and the
    # promised memsizes of a GPU never pass the device (SPEC §3).
    promised: bool = False
    procs: dict[int, int] = field(default_factory=dict)  # pid -> bytes held
    # What its in-container library (libcgpu) says its processes hold, on real GPUs: NVML's view
    # (procs) and the library's are compared, and the larger counts (docs/isolation.md).
    library_used: int = 0
    # Where its processes are, for the scheduler: {"kind": "cgroup2"|"cgroup1-freezer", "path": …}
    # or {"kind": "pgid", "pgid": N}; None while nothing is attached.
    target: dict | None = None

    @property
    def used(self) -> int:
        return max(sum(self.procs.values()), self.library_used)

    def settings(self) -> dict:
        """What the instance is, as saved and as shown to clients."""
        return {"name": self.name, "id": self.id, "memsize": self.memsize, "weight": self.weight,
                "highprio": self.highprio, "promised": self.promised}

    @property
    def free(self) -> int:
        return max(0, self.memsize - self.used)


@dataclass
class Gpu:
    info: GpuInfo
    policy: int = 0
    max_inst: int = DEFAULT_MAX_INST
    prio_ratio: int = DEFAULT_PRIO_RATIO
    instances: dict[str, Instance] = field(default_factory=dict)
    health: dict = field(default_factory=dict)  # the health watch's view (gpus/health.py), never saved

    @property
    def index(self) -> int:
        return self.info.index

    @property
    def weight_sum(self) -> int:
        return sum(i.weight for i in self.instances.values())

    @property
    def free_weight(self) -> int:
        return self.max_inst - self.weight_sum

    @property
    def memsize_sum(self) -> int:
        return sum(i.memsize for i in self.instances.values())

    @property
    def promised_sum(self) -> int:
        return sum(i.memsize for i in self.instances.values() if i.promised)

    @property
    def free_memory(self) -> int:
        """Memory not promised to any instance: what admission may still give."""
        return self.info.memory - self.promised_sum

    @property
    def used(self) -> int:
        """What the processes of all its instances hold."""
        return sum(i.used for i in self.instances.values())


def quoted(value: object, limit: int = 40) -> str:
    """A value for an error message, cut short: input is echoed, never at length."""
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidValue(f"instance names are {NAME_LEN} characters of [0-9A-Za-z_.-]: {quoted(name)}")
    return name


def _int_in(value: int, lo: int, hi: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidValue(f"{what} must be an integer")
    if not lo <= value <= hi:
        raise InvalidValue(f"{what} {quoted(value)} is out of range {lo}..{hi}")
    return value


class Node:
    """The whole state of one node. `version` moves whenever an instance
    directory appears or goes (the tree uses it to drop stale entries)."""

    def __init__(self, gpus: Sequence[GpuInfo]) -> None:
        if [g.index for g in gpus] != list(range(len(gpus))):
            raise ValueError("GPU indices must be 0..n-1 in order")
        self.gpus: list[Gpu] = [Gpu(info) for info in gpus]
        self.default_memsize = 0
        self.version = 0

    # ---- lookups -----------------------------------------------------------

    def gpu(self, index: int) -> Gpu:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.gpus):
            raise NotFound(f"no GPU {index}")
        return self.gpus[index]

    def instance(self, gpu: int, name: str) -> Instance:
        try:
            return self.gpu(gpu).instances[name]
        except KeyError:
            raise NotFound(f"no instance {name} on GPU {gpu}") from None

    def instances(self) -> Iterable[Instance]:
        for g in self.gpus:
            yield from g.instances.values()

    def instances_named(self, name: str) -> list[Instance]:
        return [g.instances[name] for g in self.gpus if name in g.instances]

    def _next_id(self) -> int:
        used = {i.id for i in self.instances()}
        n = 1
        while n in used:
            n += 1
        return n

    # ---- instances ---------------------------------------------------------

    def create_instance(
        self,
        gpu: int,
        name: str,
        *,
        memsize: int | None = None,
        weight: int = 1,
        highprio: bool = False,
        promise: bool = False,
    ) -> Instance:
        """Add an instance of `name` on GPU `gpu`.

        memsize None: `default_memsize`, where 0 means the whole device. A
        memsize past the device: InvalidValue. `promise` (admission with a
        memory request): NoSpace unless it fits in what is not promised yet.
        The weight granted is min(weight, free_weight): 0 when none is free.
        """
        check_name(name)
        g = self.gpu(gpu)
        if name in g.instances:
            raise Exists(f"{name} is already on GPU {gpu}")
        if len(g.instances) >= g.max_inst:
            raise NoSpace(f"GPU {gpu} already holds max_inst={g.max_inst} instances")
        if memsize is None:
            memsize = self.default_memsize or g.info.memory
        _int_in(memsize, 0, 10**MEMSIZE_MAX_DIGITS - 1, "memsize")
        if memsize > g.info.memory:  # (a default_memsize sized for a larger GPU, too)
            raise NoSpace(f"GPU {gpu} has {g.info.memory} bytes; {name} asks {memsize}")
        if promise and memsize > g.free_memory:
            raise NoSpace(
                f"GPU {gpu} has {g.free_memory} bytes not promised to instances; {name} asks {memsize}"
            )
        _int_in(weight, 0, g.max_inst, "weight")
        inst = Instance(
            name=name,
            gpu=gpu,
            id=self._next_id(),
            memsize=memsize,
            weight=min(weight, g.free_weight),
            highprio=bool(highprio),
            promised=bool(promise),
        )
        g.instances[name] = inst
        self.version += 1
        return inst

    def destroy(self, name: str) -> list[Instance]:
        """Remove every instance of `name`, on all GPUs."""
        check_name(name)
        gone = [g.instances.pop(name) for g in self.gpus if name in g.instances]
        if not gone:
            raise NotFound(f"no instance named {name}")
        self.version += 1
        return gone

    def attach(self, name: str, target: dict | None) -> None:
        """Say where the processes of every instance of `name` are."""
        insts = self.instances_named(check_name(name))
        if not insts:
            raise NotFound(f"no instance named {name}")
        if target is not None and (not isinstance(target, dict) or not isinstance(target.get("kind"), str)):
            raise InvalidValue("a target is a mapping with a 'kind'")
        for inst in insts:
            inst.target = dict(target) if target is not None else None
        self.version += 1

    # ---- settings ----------------------------------------------------------

    def set_default_memsize(self, value: int) -> None:
        self.default_memsize = _int_in(value, 0, 10**MEMSIZE_MAX_DIGITS - 1, "default_memsize")

    def set_policy(self, gpu: int, value: int) -> None:
        self.gpu(gpu).policy = _int_in(value, POLICIES.start, POLICIES.stop - 1, "policy")

    def set_max_inst(self, gpu: int, value: int) -> None:
        g = self.gpu(gpu)
        _int_in(value, *MAX_INST, "max_inst")
        if value < len(g.instances):
            raise Busy(f"GPU {gpu} holds {len(g.instances)} instances; max_inst cannot go below that")
        if value < g.weight_sum:
            raise Busy(f"GPU {gpu} has weights summing to {g.weight_sum}; max_inst cannot go below that")
        g.max_inst = value

    def set_prio_ratio(self, gpu: int, value: int) -> None:
        self.gpu(gpu).prio_ratio = _int_in(value, *PRIO_RATIO, "prio_ratio")

    def set_weight(self, gpu: int, name: str, value: int) -> None:
        g = self.gpu(gpu)
        inst = self.instance(gpu, name)
        _int_in(value, 0, g.max_inst, "weight")
        if g.weight_sum - inst.weight + value > g.max_inst:
            raise Busy(f"GPU {gpu} has free_weight {g.free_weight}; weight {value} does not fit")
        inst.weight = value

    def set_highprio(self, gpu: int, name: str, value: bool | int) -> None:
        inst = self.instance(gpu, name)
        inst.highprio = bool(_int_in(int(value) if isinstance(value, bool) else value, 0, 1, "highprio"))

    def set_memsize(self, gpu: int, name: str, value: int) -> None:
        g = self.gpu(gpu)
        inst = self.instance(gpu, name)
        _int_in(value, 0, 10**MEMSIZE_MAX_DIGITS - 1, "memsize")
        if value > g.info.memory:
            raise InvalidValue(f"memsize {value} is more than GPU {gpu}'s {g.info.memory} bytes")
        if inst.promised and g.promised_sum - inst.memsize + value > g.info.memory:
            raise Busy(f"GPU {gpu} has {g.free_memory + inst.memsize} bytes not promised to others for {name}; "
                       f"{value} does not fit")
        if value < inst.used:
            raise Busy(f"{name} holds {inst.used} bytes on GPU {gpu}; memsize cannot go below that")
        inst.memsize = value

    # ---- memory held by processes (simulated GPUs) -------------------------

    def alloc(self, gpu: int, name: str, pid: int, nbytes: int) -> None:
        inst = self.instance(gpu, name)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidValue("allocation size must be a non-negative integer")
        if inst.used + nbytes > inst.memsize:
            raise OutOfMemory(
                f"{name} on GPU {gpu}: {nbytes} bytes asked, {inst.free} free of memsize {inst.memsize}"
            )
        g = self.gpu(gpu)
        if g.used + nbytes > g.info.memory:  # memsizes overcommit; the device does not
            raise OutOfMemory(
                f"{name} on GPU {gpu}: {nbytes} bytes asked, but the device has {g.info.memory - g.used} bytes "
                f"left of {g.info.memory} (its instances' memsizes overcommit it)"
            )
        inst.procs[pid] = inst.procs.get(pid, 0) + nbytes

    def free(self, gpu: int, name: str, pid: int, nbytes: int | None = None) -> None:
        """Return `nbytes` (all, when None) of what `pid` holds."""
        inst = self.instance(gpu, name)
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
            raise InvalidValue("the size freed must be a non-negative integer")
        held = inst.procs.get(pid, 0)
        if nbytes is None or nbytes >= held:
            inst.procs.pop(pid, None)
        else:
            inst.procs[pid] = held - nbytes

    def drop_process(self, pid: int) -> None:
        """A process is gone: everything it held is returned."""
        for inst in self.instances():
            inst.procs.pop(pid, None)

    # ---- state -------------------------------------------------------------

    def to_state(self) -> dict:
        """Everything that must survive a restart (process memory does not:
        the processes do not survive the GPU context either)."""
        return {
            "default_memsize": self.default_memsize,
            "gpus": [
                {
                    "uuid": g.info.uuid,
                    "policy": g.policy,
                    "max_inst": g.max_inst,
                    "prio_ratio": g.prio_ratio,
                    "instances": [
                        {**i.settings(), **({"target": i.target} if i.target is not None else {})}
                        for i in g.instances.values()
                    ],
                }
                for g in self.gpus
            ],
        }

    def load_state(self, state: dict) -> None:
        """Replace settings and instances with `state` (from `to_state`).

        Validates everything first; raises InvalidValue and changes nothing
        when the state is inconsistent or names other GPUs.
        """
        trial = Node([g.info for g in self.gpus])
        try:
            trial._apply(state)
        except (KeyError, TypeError, AttributeError) as exc:
            raise InvalidValue(f"malformed state: missing or wrong field {exc}") from None
        except ModelError as exc:
            raise InvalidValue(str(exc)) from None
        for g in trial.gpus:  # memory held by live processes is not part of the state
            for name, inst in g.instances.items():
                old = self.gpus[g.index].instances.get(name)
                if old is not None:
                    inst.procs = old.procs
        self.gpus = trial.gpus
        self.default_memsize = trial.default_memsize
        self.version += 1

    def _apply(self, state: dict) -> None:
        self.set_default_memsize(state["default_memsize"])
        gstates = state["gpus"]
        have = [g.info.uuid for g in self.gpus]
        want = [gs["uuid"] for gs in gstates]
        if have != want:
            raise InvalidValue(f"state is for GPUs {want}, this node has {have}")
        ids: set[int] = set()
        for g, gs in zip(self.gpus, gstates):
            self.set_policy(g.index, gs["policy"])
            self.set_prio_ratio(g.index, gs["prio_ratio"])
            g.max_inst = _int_in(gs["max_inst"], *MAX_INST, "max_inst")
            for s in gs["instances"]:
                inst_id = _int_in(s["id"], 1, 10**9, "id")
                if inst_id in ids:
                    raise InvalidValue(f"instance id {inst_id} appears twice")
                ids.add(inst_id)
                # (a state from before overcommit has no "promised": every memsize was reserved then)
                inst = self.create_instance(
                    g.index, s["name"], memsize=s["memsize"], weight=0, highprio=bool(s["highprio"]),
                    promise=bool(s.get("promised", True)),
                )
                inst.id = inst_id
                target = s.get("target")
                if target is not None:
                    if not isinstance(target, dict) or not isinstance(target.get("kind"), str):
                        raise InvalidValue(f"instance {s['name']}: malformed target")
                    inst.target = dict(target)
                self.set_weight(g.index, s["name"], s["weight"])
