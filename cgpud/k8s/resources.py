"""What the device plugin advertises and allocates (docs/kubernetes.md). Pure:
the node as the daemon's `query` answer in, devices and decisions out.

- One device per memory unit per GPU, `aliyun.com/gpu-mem`, with gpushare's
  IDs `<GPU-UUID>-_-<j>`, j = 0 … units−1; each GPU counts its own memory
  (gpushare counts every GPU as GPU 0). The unit is the node's mode's (1 GiB,
  128 MiB on a `share` node: SPEC §3, `mode_unit`), or MiB or 128 MiB by flag;
  a GPU has floor(memory / unit) units.
- A GPU is healthy while the daemon answers and has it.
- `preferred`: which of the kubelet's available units to take — all from one
  GPU (or N/M from each of M GPUs), binpack (the GPU with the least free
  units that fits) or spread (the most).
- `allocation`: a container's units → the environment the node's hook and
  `cgpu-runtime` understand (ALIYUN_COM_GPU_MEM_IDX, _CONTAINER, _DEV (when
  its GPUs are of one size), _POD, NVIDIA_VISIBLE_DEVICES; CGPU_DISABLE on
  nodes that ask for no isolation),
  or AllocationError saying why — never a success with a bogus device.
"""
from __future__ import annotations

from dataclasses import dataclass

from cgpud.containers.request import SHARE_UNIT

RESOURCE = "aliyun.com/gpu-mem"
COUNT_RESOURCE = "aliyun.com/gpu-count"
SEP = "-_-"
MIB = 1 << 20
GIB = 1 << 30
UNITS = {"GiB": GIB, "MiB": MIB, "128MiB": 128 * MIB}
STRATEGIES = ("binpack", "spread")


def mode_unit(mode: str) -> int:
    """A node's unit in `mode` (SPEC §3): 128 MiB where it shares without isolation (`share`, as
    the seed's gpuMemoryUnit: 128MiB is for such nodes only), else 1 GiB; as the daemon reads its
    containers' units (containers.placement.unit_for), for every mode of the node's label."""
    return SHARE_UNIT if mode == "share" else GIB


CORE_ENV = "ALIYUN_COM_GPU_CORE_PERCENTAGE"  # a core_mem container's compute percentage (docs/scheduler.md)
CORE_STEP = 5


class AllocationError(ValueError):
    """A request that cannot be met; str() is the reason `kubectl describe pod` shows."""


def check_percentage(p: int) -> int:
    """A compute percentage as core_mem takes it (a multiple of 5 from 5 to 100), or AllocationError."""
    if not CORE_STEP <= p <= 100 or p % CORE_STEP:
        raise AllocationError(f"aliyun.com/gpu-core.percentage {p}: give a multiple of {CORE_STEP} from {CORE_STEP} "
                              "to 100")
    return p


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    memory: int  # bytes
    promised: int  # bytes promised to instances (SPEC §3), from the daemon
    healthy: bool = True  # in service (the daemon's health watch: docs/gpus.md, Health)

    def units(self, unit: int) -> int:
        return self.memory // unit

    def free_units(self, unit: int) -> int:
        return max(0, (self.memory - self.promised) // unit)


def gpus_from_query(snapshot: dict) -> list[Gpu]:
    out = []
    for g in snapshot.get("gpus", []):
        promised = sum(int(i["memsize"]) for i in g.get("instances", []) if i.get("promised", True))
        out.append(Gpu(int(g["index"]), str(g["uuid"]), int(g["memory"]), promised,
                       bool((g.get("health") or {}).get("healthy", True))))
    return out


def device_id(uuid: str, j: int) -> str:
    return f"{uuid}{SEP}{j}"


def devices(gpus: list[Gpu], unit: int) -> list[tuple[str, int]]:
    """(device ID, GPU index) for every unit of every GPU."""
    return [(device_id(g.uuid, j), g.index) for g in gpus for j in range(g.units(unit))]


def gpu_of(dev: str, gpus: list[Gpu], unit: int) -> Gpu:
    """The GPU of a device ID, or AllocationError (not ours, or no such unit)."""
    uuid, sep, j = dev.rpartition(SEP)
    by_uuid = {g.uuid: g for g in gpus}
    if not sep or uuid not in by_uuid or not j.isdigit() or int(j) >= by_uuid[uuid].units(unit):
        raise AllocationError(f"device {dev!r} is not one of this node's {RESOURCE} units")
    return by_uuid[uuid]


def preferred(available: list[str], must: list[str], size: int, gpus: list[Gpu], unit: int,
              strategy: str = "binpack", count: int = 1, only: list[int] | None = None) -> list[str]:
    """`size` units from `available` (keeping `must`), from `count` GPUs (size/count each), chosen
    by the strategy among all GPUs or those of `only`; AllocationError when no GPU (or not `count`
    GPUs) has room."""
    if strategy not in STRATEGIES:
        raise AllocationError(f"placement {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if count < 1 or size % count:
        raise AllocationError(f"{size} units over {count} GPUs is not a whole number per GPU")
    per = size // count
    on: dict[int, list[str]] = {}
    for dev in available:
        on.setdefault(gpu_of(dev, gpus, unit).index, []).append(dev)
    fits = [g for g in gpus if len(on.get(g.index, [])) >= per and g.free_units(unit) >= per
            and (only is None or g.index in only)]
    fits.sort(key=lambda g: (g.free_units(unit) if strategy == "binpack" else -g.free_units(unit), g.index))
    if len(fits) < count:
        have = ", ".join(f"GPU {g.index}: {g.free_units(unit)} free" for g in gpus) or "no GPUs"
        raise AllocationError(f"no {count} GPU(s) with {per} free {RESOURCE} units each ({have})")
    picked: list[str] = []
    for g in fits[:count]:
        mine = [d for d in must if gpu_of(d, gpus, unit).index == g.index]
        rest = [d for d in on[g.index] if d not in mine]
        picked += (mine + rest)[:per]
    return picked


def allocation(ids: list[str], gpus: list[Gpu], unit: int, *, disable_isolation: bool = False) -> dict[str, str]:
    """The environment of a container given these units (Allocate), or AllocationError."""
    if not ids:
        raise AllocationError(f"the container was given no {RESOURCE} units")
    if len(set(ids)) != len(ids):
        raise AllocationError("the same device ID was given twice")
    count: dict[int, int] = {}
    for dev in ids:
        g = gpu_of(dev, gpus, unit)
        count[g.index] = count.get(g.index, 0) + 1
    per = set(count.values())
    if len(per) != 1:
        raise AllocationError(f"units spread unevenly over GPUs {sorted(count)}: a container takes the same "
                              "number of units from each of its GPUs")
    return environment(sorted(count), per.pop(), gpus, unit, disable_isolation=disable_isolation)


def environment(indices: list[int], units: int, gpus: list[Gpu], unit: int, *,
                disable_isolation: bool = False) -> dict[str, str]:
    """The environment of a container of `units` units on each GPU of `indices`, or
    AllocationError when one of them has not that much unpromised memory."""
    by_index = {g.index: g for g in gpus}
    count = {i: units for i in indices}
    for i in count:
        if i not in by_index:
            raise AllocationError(f"no GPU {i} on this node (it has {len(gpus)})")
    for i in count:
        if by_index[i].free_units(unit) < units:
            raise AllocationError(f"GPU {i} has {by_index[i].free_units(unit)} {RESOURCE} units not promised to "
                                  f"other containers; this one asks {units} (something outside Kubernetes uses it)")
    idx = ",".join(str(i) for i in sorted(count))
    env = {
        "NVIDIA_VISIBLE_DEVICES": ",".join(by_index[i].uuid for i in sorted(count)),
        "ALIYUN_COM_GPU_MEM_IDX": idx,
        "ALIYUN_COM_GPU_MEM_CONTAINER": str(units),
        "ALIYUN_COM_GPU_MEM_POD": str(units * len(count)),
    }
    # gpushare's rule: the container gets CONTAINER/DEV of each GPU. DEV is one number, so it is
    # given only when every GPU of the container has as many units; GPUs of different sizes get
    # `units` whole units each instead (DEV = the smaller's units would give the larger GPU more
    # than the units its pods were counted for).
    devs = {by_index[i].units(unit) for i in count}
    if len(devs) == 1:
        env["ALIYUN_COM_GPU_MEM_DEV"] = str(devs.pop())
    if disable_isolation:
        env["CGPU_DISABLE"] = "true"
    return env


MPS_PIPE_DIR = "/var/run/nvidia-gpu/nvidia-mps"  # ack-mps-control's since 0.2.0 (docs/mps.md)
# the MPS server's and its clients' shared memory: a tmpfs of its own on the host (deploy/kubernetes/
# mps-control.yaml mounts it), at /dev/shm in the control daemon's pod and each client container, as
# NVIDIA's device plugin does with its <mps root>/shm
MPS_SHM_DIR = "/var/run/nvidia-gpu/nvidia-mps-shm"


def mps_environment(env: dict[str, str], gpus: list[Gpu], unit: int) -> dict[str, str]:
    """On an `mps` node, what makes a container (its `environment`) an MPS client held to its share:
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT per CUDA ordinal (its GPUs in index order, as
    NVIDIA_VISIBLE_DEVICES lists them) = its memsize on that GPU in MiB, the hook's rule (SPEC §2:
    units/DEV of the GPU, or whole units); CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = its memory share of
    the GPU, rounded up (the smallest over its GPUs: one value for the process); the pipe directory."""
    by_index = {g.index: g for g in gpus}
    idx = [int(i) for i in env["ALIYUN_COM_GPU_MEM_IDX"].split(",")]
    units = int(env["ALIYUN_COM_GPU_MEM_CONTAINER"])
    dev = int(env["ALIYUN_COM_GPU_MEM_DEV"]) if "ALIYUN_COM_GPU_MEM_DEV" in env else None
    limits, shares = [], []
    for k, i in enumerate(idx):
        g = by_index[i]
        memsize = g.memory * units // dev if dev else units * unit
        limits.append(f"{k}={max(1, memsize >> 20)}M")
        shares.append(max(1, min(100, -(-100 * memsize // g.memory))))
    return {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(limits),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(min(shares)), "CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE_DIR}
