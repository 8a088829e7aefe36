"""A node's GPU mode on Kubernetes (SPEC §6, docs/kubernetes.md "A node's mode"). Pure.

The node's label `ack.node.gpu.schedule` selects the mode, as on ACK:

| label | mode | what the node advertises |
|---|---|---|
| `default` (or `exclusive`) | exclusive | `nvidia.com/gpu`: whole GPUs |
| `cgpu` | cgpu | `aliyun.com/gpu-mem`: memory isolation, compute shared by the GPU's policy |
| `core_mem` | core_mem | `aliyun.com/gpu-mem` and `aliyun.com/gpu-core.percentage` |
| `share` | share | `aliyun.com/gpu-mem`, no isolation (the pod reads its share from its environment) |
| `mps` | mps | `aliyun.com/gpu-mem`, NVIDIA MPS the isolation layer |
| `disabled` | disabled | nothing: the node is another driver's (e.g. DRA) |

Without the label the node keeps the device plugin's `--mode` (default cgpu), for clusters that
label nothing. Every resource a mode does not use is advertised as 0.

A label change while GPU pods run on the node does not take effect at once (their containers
were admitted under the old mode: changing what the node advertises or how it isolates would
cost them their isolation and the scheduler its account): the node keeps the old mode — the
mode in force is written on the Node (annotation MODE_IN_FORCE) so a restarted plugin keeps
it too — says so in an event and the condition CONDITION, and switches when its last GPU pod
ends. `decide` is that rule.
"""
from __future__ import annotations

from dataclasses import dataclass

LABEL = "ack.node.gpu.schedule"
PLACEMENT_LABEL = "ack.node.gpu.placement"
MODE_IN_FORCE = "cgpu.aliyun.com/gpu-schedule"  # annotation on the Node: the mode the node runs in now
CONDITION = "CgpuModePending"  # node condition: True while a label change waits for the node's GPU pods

MODES = ("exclusive", "cgpu", "core_mem", "share", "mps", "disabled")
LABEL_VALUES = {"default": "exclusive", "exclusive": "exclusive", "cgpu": "cgpu", "core_mem": "core_mem",
                "share": "share", "mps": "mps", "disabled": "disabled"}

MEM = "aliyun.com/gpu-mem"
WHOLE = "nvidia.com/gpu"
CORE = "aliyun.com/gpu-core.percentage"
GPU_RESOURCES = (MEM, WHOLE, CORE)  # a pod asking any of these is a GPU pod of the node
RESOURCES = {
    "exclusive": (WHOLE,),
    "cgpu": (MEM,),
    "core_mem": (MEM, CORE),
    "share": (MEM,),
    "mps": (MEM,),
    "disabled": (),
}


def advertises(mode: str, resource: str) -> bool:
    return resource in RESOURCES[mode]


def in_force(node: dict) -> str:
    """The mode a Node object says is in force (its annotation; cgpu, as before modes, without one)."""
    raw = (((node.get("metadata") or {}).get("annotations")) or {}).get(MODE_IN_FORCE)
    return raw if raw in MODES else "cgpu"


def wanted(labels: dict[str, str] | None, default: str) -> tuple[str, str | None]:
    """The mode the node's labels ask for, and a warning when the label's value is not a mode
    (then `default` is asked for: a typo must not take the node's GPUs away)."""
    raw = (labels or {}).get(LABEL)
    if raw is None:
        return default, None
    mode = LABEL_VALUES.get(raw)
    if mode is None:
        return default, (f"node label {LABEL}={raw!r} is not one of {', '.join(sorted(LABEL_VALUES))}: "
                         f"the node stays in mode {default}")
    return mode, None


def gpu_pod(pod: dict) -> bool:
    """A pod of the node that asks a GPU resource and has not ended (a pod being deleted still
    runs its containers until it is gone)."""
    if ((pod.get("status") or {}).get("phase")) in ("Succeeded", "Failed"):
        return False
    spec = pod.get("spec") or {}
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        res = c.get("resources") or {}
        asks = {**(res.get("requests") or {}), **(res.get("limits") or {})}
        if any(str(asks.get(r, "0")) not in ("0", "") for r in GPU_RESOURCES):
            return True
    return False


@dataclass(frozen=True)
class Decision:
    mode: str  # the mode in force
    wanted: str  # the mode the label asks for
    holders: tuple[str, ...]  # the GPU pods (namespace/name) and instances that keep the old mode

    @property
    def pending(self) -> bool:
        return self.mode != self.wanted

    def message(self) -> str:
        if not self.pending:
            return f"the node runs in mode {self.mode}, as its label {LABEL} asks"
        shown = ", ".join(self.holders[:5]) + (f" and {len(self.holders) - 5} more" if len(self.holders) > 5 else "")
        return (f"{LABEL} asks for mode {self.wanted}; the node stays in mode {self.mode} while {len(self.holders)} "
                f"GPU user(s) run on it ({shown}) and switches when the last ends")


def decide(current: str | None, want: str, holders: list[str]) -> Decision:
    """The mode in force: the wanted one when nothing holds a GPU of the node (or nothing was in
    force yet), else the current one."""
    if current is None or current not in MODES or current == want or not holders:
        return Decision(want, want, ())
    return Decision(current, want, tuple(sorted(holders)))
