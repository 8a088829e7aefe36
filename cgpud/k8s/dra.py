"""What the DRA driver publishes and prepares (docs/kubernetes.md, DRA mode). Pure:
the daemon's `query` answer and the API server's objects in, objects and
decisions out; the plugin (cgpud.k8s.draplugin) does the I/O.

- `resource_slices`: the node's ResourceSlices (resource.k8s.io/v1): one
  device per GPU, `gpu-<index>`, with attributes uuid, model, index,
  memoryUnit (bytes) and kind, and the capacity `memory`: the GPU's whole
  units in bytes, shared by several claims (allowMultipleAllocations,
  KEP-5075) in steps of the node's unit (requestPolicy: 1 GiB, 128 MiB on a
  `share` node). One slice per node; `aliyun.com/gpu-mem: N` reaches it as a
  capacity request (cgpud.k8s.webhook), of any size one GPU holds
  (docs/decisions.md: the layout).
- `plan`: an allocated ResourceClaim → per request, the GPUs and bytes on each,
  and the weight and high priority of its DeviceClass's opaque configuration
  (`GpuConfig`, source FromClass: the cluster admin's; the claim's own, FromClaim,
  is refused: SPEC §2), or DraError saying why.
- `environment`: a request's share → the environment the node's hook and
  `cgpu-runtime` read (ALIYUN_COM_GPU_MEM_IDX, _CONTAINER in the node's
  units GPU by GPU, _POD, NVIDIA_VISIBLE_DEVICES, ALIYUN_COM_GPU_SCHD_WEIGHT,
  ALIYUN_COM_GPU_HIGH_PRIO), as the device plugin's Allocate gives it.
- `cdi_spec`: a claim's CDI spec (one CDI device per request, each carrying
  its environment), what the kubelet hands the runtime by name.
- `node_views`: the cluster's slices and claims → `kubectl inspect cgpu`'s nodes.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

from cgpud.containers import allotted, envspec
from cgpud.control.callers import TENANT_DIR
from cgpud.core.model import MAX_INST

DRIVER = "cgpu.aliyun.com"
CONFIG_API_VERSION = "cgpu.aliyun.com/v1"
CONFIG_KIND = "GpuConfig"
CDI_VENDOR_CLASS = "cgpu.aliyun.com/gpu"
CDI_VERSION = "0.6.0"
CAPACITY = "memory"
# A CDI edit replaces the pod's value of each variable it names: a request's names every variable of the
# contract (empty where unused), so the pod adds none, and its claim (containers.allotted.DRA_CLAIM).
UNSET = {v: "" for v in envspec.VARIABLES}
SOURCE_CLASS = "FromClass"  # an allocation's config from the DeviceClass (the cluster admin's), not FromClaim


class DraError(ValueError):
    """A claim that cannot be prepared; str() is the one line the kubelet puts on the pod."""


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    model: str
    memory: int  # bytes
    taint: tuple[str, str] | None = None  # out of service: (key, value) of its devices' NoSchedule taint

    def units(self, unit: int) -> int:
        return self.memory // unit


# A GPU out of service (the daemon's health watch, docs/gpus.md Health): its devices are tainted
# NoSchedule, as NVIDIA's DRA driver does (gpu.nvidia.com/xid, gpu-lost): no new claim is allocated there.
TAINT_XID, TAINT_LOST, TAINT_ECC = "cgpu.aliyun.com/xid", "cgpu.aliyun.com/gpu-lost", "cgpu.aliyun.com/ecc"


def health_taint(health: dict | None) -> tuple[str, str] | None:
    h = health or {}
    if h.get("healthy", True):
        return None
    if h.get("lost"):
        return TAINT_LOST, "true"
    if "ECC" in str(h.get("reason", "")) and not str(h.get("reason", "")).startswith("Xid"):
        return TAINT_ECC, "double-bit"
    return TAINT_XID, str(int(h.get("last_xid") or 0))


def gpus_from_query(snapshot: dict) -> list[Gpu]:
    return [Gpu(int(g["index"]), str(g["uuid"]), str(g.get("name", "")), int(g["memory"]),
                health_taint(g.get("health")))
            for g in snapshot.get("gpus", [])]


def _taints(g: Gpu) -> dict:
    return {"taints": [{"key": g.taint[0], "value": g.taint[1], "effect": "NoSchedule"}]} if g.taint else {}


KIND_GPU, KIND_UNIT = "gpu", "memory-unit"  # the attribute `kind` (memory units: slices of before 1.3, read only)
PER_SLICE = 128  # devices per slice (ResourceSliceMaxDevices)


def device_name(index: int, unit: int | None = None) -> str:
    return f"gpu-{index}" if unit is None else f"gpu-{index}-unit-{unit}"


def parse_device(name: str) -> tuple[int, bool] | None:
    """(GPU index, a memory unit?) of one of our device names, else None."""
    m = re.fullmatch(r"gpu-(\d+)(-unit-\d+)?", name or "")
    return (int(m[1]), bool(m[2])) if m else None


NAME_MAX = 253  # a ResourceSlice's name is a DNS subdomain


def slice_name(node: str, k: int = 0) -> str:
    """`<node>-cgpu.aliyun.com-<k>`; a node name too long for that (node names may have 253
    characters themselves) is cut and told apart from others cut alike by a hash of it."""
    tail = f"-{DRIVER}-{k}"
    name = f"{node}{tail}"
    if len(name) <= NAME_MAX:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    head = node[:NAME_MAX - len(tail) - len(digest) - 1].rstrip(".-")
    return f"{head}-{digest}{tail}"


def node_owner(node: str, uid: str) -> dict:
    """The owner reference that ties a slice to its Node: the garbage collector removes the slices
    of a Node that is deleted (an autoscaled-away node leaves none behind)."""
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid, "controller": True}


# What the node's mode in force (cgpud.k8s.modes, its label ack.node.gpu.schedule) publishes: the
# GPU devices whose memory claims share (cgpu, share, mps; core_mem with the compute percentage as a
# second capacity), whole GPUs (exclusive), or nothing (disabled: the node is another driver's).
# Every device says its mode (the attribute `mode`): the webhook's templates select by it.
SHARED_MODES = ("cgpu", "share", "mps", "core_mem")
COMPUTE = "compute"  # core_mem: the GPU's compute in percent, a capacity of its own (docs/kubernetes.md)
COMPUTE_STEP = 5  # (envspec.CORE_STEP: policy 3's 20 slots)


def devices(gpus: list[Gpu], unit: int, mode: str = "cgpu") -> list[dict]:
    """Each GPU as one device, as the node's mode has it: on a sharing node its memory claims share
    (capacity `memory`, KEP-5075: several allocations, each in steps of the node's unit), and on a
    core_mem node its compute too (capacity `compute`, 100, in steps of 5: the percentage); on an
    exclusive node the GPU is given whole; on a disabled node there is none. A GPU out of service
    tainted NoSchedule."""
    if mode == "disabled":
        return []
    out = []
    for g in gpus:
        whole = g.units(unit) * unit
        dev = {
            "name": device_name(g.index),
            "attributes": {"uuid": {"string": g.uuid}, "model": {"string": g.model}, "index": {"int": g.index},
                           "memoryUnit": {"int": unit}, "kind": {"string": KIND_GPU}, "mode": {"string": mode}},
            "capacity": {CAPACITY: {"value": str(whole)}},
            **_taints(g),
        }
        if mode in SHARED_MODES:
            dev["allowMultipleAllocations"] = True
            dev["capacity"][CAPACITY]["requestPolicy"] = {"default": str(unit),
                                                          "validRange": {"min": str(unit), "step": str(unit)}}
        if mode == "core_mem":  # (a claim that names no percentage gets the whole of it: default 100)
            dev["capacity"][COMPUTE] = {"value": "100", "requestPolicy": {
                "default": "100", "validRange": {"min": str(COMPUTE_STEP), "max": "100", "step": str(COMPUTE_STEP)}}}
        out.append(dev)
    return out


def resource_slices(node: str, gpus: list[Gpu], unit: int, generation: int = 1, owner: dict | None = None,
                    mode: str = "cgpu") -> list[dict]:
    """The node's ResourceSlices, one pool named after the node: its GPUs as its mode has them,
    PER_SLICE a slice (one slice for any node there is; one with no device on a disabled node)."""
    devs = devices(gpus, unit, mode)
    parts = [devs[i:i + PER_SLICE] for i in range(0, len(devs), PER_SLICE)] or [[]]
    return [{
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node, k), **({"ownerReferences": [owner]} if owner else {})},
        "spec": {"driver": DRIVER, "nodeName": node,
                 "pool": {"name": node, "generation": generation, "resourceSliceCount": len(parts)}, "devices": part},
    } for k, part in enumerate(parts)]


QUANTITY_KEYS = ("value", "default", "min", "max", "step")  # where a slice holds resource.Quantity strings


def canonical(obj):
    """A slice's part as the API server means it, for comparing what it holds with what we would
    write: quantities as whole numbers (the server may write `14Gi` for `15032385536`), and empty
    or null fields left out (the server omits them)."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            v = canonical(v)
            if k in QUANTITY_KEYS and isinstance(v, str):
                try:
                    v = quantity(v)
                except DraError:
                    pass
            elif k == "validValues" and isinstance(v, list):
                v = [quantity(x) if isinstance(x, str) and re.fullmatch(r"[0-9.]+[A-Za-z]*", x) else x for x in v]
            if v is None or v == [] or v == {}:
                continue
            out[k] = v
        return out
    if isinstance(obj, list):
        return [canonical(x) for x in obj]
    return obj


def slice_content(obj: dict) -> dict:
    """What a slice says, the pool's generation aside (a slice written again at the next generation
    says the same): its spec and its owners, canonical."""
    spec = dict(obj.get("spec") or {})
    spec["pool"] = {k: v for k, v in (spec.get("pool") or {}).items() if k != "generation"}
    owners = [{k: o.get(k) for k in ("apiVersion", "kind", "name", "uid")}
              for o in (obj.get("metadata") or {}).get("ownerReferences") or ()]
    return canonical({"spec": spec, "owners": owners})


def first_difference(a, b, path: str = "") -> str:
    """Where two canonical objects first differ (`spec.devices[3].capacity`), for a log line."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        return path
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{path}[{i}]")
    return path


def quantity(text) -> int:
    """A resource.Quantity (`3Gi`, `3221225472`, `1.5Gi`) as whole bytes, or DraError."""
    suffixes = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
                "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "": 1}
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|)\s*", str(text))
    try:
        value = Decimal(m.group(1)) * suffixes[m.group(2)] if m else None
    except InvalidOperation:
        value = None
    if value is None or value != value.to_integral_value():
        raise DraError(f"capacity {text!r} is not a whole number of bytes")
    return int(value)


@dataclass
class Share:
    """What one request of a claim got on this node: bytes on each of its GPUs, in the order the
    scheduler allocated them, with the configuration that applies to it."""

    request: str
    gpus: list[tuple[int, int]] = field(default_factory=list)  # (GPU index, bytes)
    weight: int = 1
    highprio: bool = False
    percentage: int | None = None  # core_mem: the compute percentage the claim consumed (capacity `compute`)

    def as_dict(self) -> dict:
        return {"request": self.request, "gpus": [list(g) for g in self.gpus], "weight": self.weight,
                "highprio": self.highprio, **({"percentage": self.percentage} if self.percentage is not None else {})}

    @classmethod
    def from_dict(cls, d: dict) -> "Share":
        return cls(d["request"], [(int(i), int(b)) for i, b in d["gpus"]], int(d["weight"]), bool(d["highprio"]),
                   int(d["percentage"]) if d.get("percentage") is not None else None)


def _config(parameters, where: str) -> dict:
    """An opaque configuration of ours: {apiVersion, kind, weight?, highPriority?}, checked."""
    if not isinstance(parameters, dict) or parameters.get("apiVersion") != CONFIG_API_VERSION \
            or parameters.get("kind") != CONFIG_KIND:
        raise DraError(f"{where}: opaque parameters for {DRIVER} must be apiVersion: {CONFIG_API_VERSION}, "
                       f"kind: {CONFIG_KIND}")
    unknown = set(parameters) - {"apiVersion", "kind", "weight", "highPriority"}
    if unknown:
        raise DraError(f"{where}: {CONFIG_KIND} has no field {sorted(unknown)[0]!r} (weight, highPriority)")
    w, hp = parameters.get("weight", 1), parameters.get("highPriority", False)
    if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_INST[1]:
        raise DraError(f"{where}: weight {w!r} is not a whole number from 1 to {MAX_INST[1]}")
    if not isinstance(hp, bool):
        raise DraError(f"{where}: highPriority {hp!r} is not true or false")
    return {k: v for k, v, given in (("weight", w, "weight"), ("highprio", hp, "highPriority")) if given in parameters}


def plan(claim: dict, node: str, gpus: list[Gpu], unit: int) -> list[Share]:
    """The shares of an allocated claim on this node's GPUs, one per request; DraError when the
    claim is not allocated here or asks what cannot be given."""
    meta = claim.get("metadata") or {}
    who = f"ResourceClaim {meta.get('namespace')}/{meta.get('name')}"
    devices = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {})
    results = [r for r in devices.get("results") or () if r.get("driver") == DRIVER]
    if not results:
        raise DraError(f"{who} has no device of {DRIVER} allocated")
    by_index = {g.index: g for g in gpus}
    shares: dict[str, Share] = {}
    units_seen: set[str] = set()
    for r in results:
        if r.get("pool") != node:
            raise DraError(f"{who}: device {r.get('device')} is of pool {r.get('pool')!r}, not this node's ({node})")
        parsed = parse_device(r.get("device"))
        gpu = by_index.get(parsed[0]) if parsed else None
        if gpu is None or (parsed[1] and int(r["device"].rsplit("-", 1)[1]) >= gpu.units(unit)):
            raise DraError(f"{who}: device {r.get('device')!r} is not one of this node's GPUs or their units "
                           f"(GPUs {', '.join(str(i) for i in sorted(by_index)) or 'none'})")
        whole = gpu.units(unit) * unit
        share = shares.setdefault(r["request"], Share(r["request"]))
        if parsed[1]:  # a memory unit (aliyun.com/gpu-mem through the DeviceClass): one unit of its GPU
            if r["device"] in units_seen:
                raise DraError(f"{who}: unit {r['device']} was given twice")
            units_seen.add(r["device"])
            have = dict(share.gpus)
            have[gpu.index] = have.get(gpu.index, 0) + unit
            share.gpus = list(have.items())
            continue
        consumed = (r.get("consumedCapacity") or {}).get(CAPACITY)
        size = quantity(consumed) if consumed is not None else whole  # a device allocated whole
        if size <= 0 or size % unit or size > whole:
            raise DraError(f"{who}: {size} bytes of GPU {gpu.index} is not a whole number of the node's "
                           f"{unit}-byte units from 1 to {gpu.units(unit)}")
        if any(i == gpu.index for i, _ in share.gpus):
            raise DraError(f"{who}: request {r['request']} was given GPU {gpu.index} twice")
        share.gpus.append((gpu.index, size))
        compute = (r.get("consumedCapacity") or {}).get(COMPUTE)
        if compute is not None:  # core_mem: the percentage consumed (one for the request, as the hook takes it)
            p = quantity(compute)
            if not COMPUTE_STEP <= p <= 100 or p % COMPUTE_STEP:
                raise DraError(f"{who}: compute {compute} of GPU {gpu.index} is not a multiple of {COMPUTE_STEP} "
                               f"from {COMPUTE_STEP} to 100 percent")
            if share.percentage not in (None, p):
                raise DraError(f"{who}: request {r['request']} consumed {share.percentage} and {p} percent of "
                               "its GPUs' compute: one percentage for all")
            share.percentage = p
    for n, c in enumerate(devices.get("config") or ()):  # the class's first, then the claim's: later wins
        opaque = c.get("opaque") or {}
        if opaque.get("driver") != DRIVER:
            continue
        settings = _config(opaque.get("parameters"), f"{who}, config {n}")
        if settings and c.get("source") != SOURCE_CLASS:  # (SPEC §2: the cluster admin's to grant)
            raise DraError(f"{who}, config {n}: weight and highPriority are the cluster admin's to grant, in a Device"
                           f"Class's {CONFIG_KIND} (source {SOURCE_CLASS}), not the claim's ({c.get('source')})")
        for name, share in shares.items():
            if not c.get("requests") or name in c["requests"] or name.split("/")[0] in c["requests"]:
                share.weight = settings.get("weight", share.weight)
                share.highprio = settings.get("highprio", share.highprio)
    for share in shares.values():
        if share.percentage is not None and share.weight != 1:
            raise DraError(f"{who}: request {share.request} has {share.percentage} percent of its GPU's compute "
                           f"and a weight ({share.weight}) in its {CONFIG_KIND}: the percentage fixes its compute; "
                           "give one of the two")
    return list(shares.values())


def environment(share: Share, gpus: list[Gpu], unit: int, mode: str = "cgpu") -> dict[str, str]:
    """The container's environment for a share, in the node's units (what the hook reads): on a
    core_mem node its percentage, on an mps node the MPS client's limits (as Allocate gives them)."""
    by_index = {g.index: g for g in gpus}
    units = [b // unit for _, b in share.gpus]
    env = {
        envspec.NVIDIA: ",".join(by_index[i].uuid for i, _ in share.gpus),
        envspec.MEM_IDX: ",".join(str(i) for i, _ in share.gpus),
        envspec.MEM_CONTAINER: ",".join(map(str, units)) if len(set(units)) > 1 else str(units[0]),
        envspec.MEM_POD: str(sum(units)),
    }
    if share.weight != 1:
        env[envspec.WEIGHT] = str(share.weight)
    if share.highprio:
        env[envspec.HIGH_PRIO] = "1"
    if share.percentage is not None:
        env[envspec.CORE] = str(share.percentage)
    if mode == "mps":
        from cgpud.k8s import resources

        env.update(resources.mps_environment(env, [resources.Gpu(g.index, g.uuid, g.memory, 0) for g in gpus], unit))
    return env


def cdi_device(claim_uid: str, request: str) -> str:
    """The CDI device name of a claim's request (CDI allows letters, digits, _ - . :)."""
    return f"{claim_uid}-{re.sub(r'[^A-Za-z0-9_.:-]', '.', request)}"


def cdi_spec(claim_uid: str, shares: list[Share], gpus: list[Gpu], unit: int, mounts: list[str],
             mode: str = "cgpu") -> dict:
    """The claim's CDI spec: a device per request whose edits set its environment (UNSET); `mounts` (the
    daemon's socket directory) are bound into every container of the claim: each as its
    containers' directory (the containers' socket only), read-only (docs/security.md). On an mps
    node the MPS pipe directory and the control daemon's shm (at /dev/shm) too, read-write (the
    client talks to the node's MPS server there)."""
    from cgpud.k8s.resources import MPS_PIPE_DIR, MPS_SHM_DIR

    binds = [{"hostPath": f"{m}/{TENANT_DIR}", "containerPath": m, "options": ["rbind", "ro"]} for m in mounts]
    if mode == "mps":  # (as Allocate mounts them: the pipe directory, and the control daemon's shm at /dev/shm)
        binds.append({"hostPath": MPS_PIPE_DIR, "containerPath": MPS_PIPE_DIR, "options": ["rbind", "rw"]})
        binds.append({"hostPath": MPS_SHM_DIR, "containerPath": "/dev/shm", "options": ["rbind", "rw"]})
    return {
        "cdiVersion": CDI_VERSION, "kind": CDI_VENDOR_CLASS,
        "devices": [{"name": cdi_device(claim_uid, s.request),
                     "containerEdits": {"env": [f"{k}={v}" for k, v in sorted({
                         **UNSET, **environment(s, gpus, unit, mode),
                         allotted.DRA_CLAIM: f"{claim_uid}/{s.request}"}.items())]}}
                    for s in shares],
        # (each the daemon's socket directory, as a container sees it: its containers' directory, read-only)
        "containerEdits": {"mounts": binds},
    }


def node_views(slices: list[dict], claims: list[dict]) -> list[dict]:
    """Each node of our driver's slices with what its claims hold on each GPU, in the node's units:
    `kubectl inspect cgpu` in DRA mode (a node's GPUs from their devices, a claim's share from its
    allocation: consumed capacity, or one unit per unit device). A claim is shown by the pods it is
    reserved for (its own name while it is reserved for none)."""
    nodes: dict[str, dict] = {}
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != DRIVER or not spec.get("nodeName"):
            continue
        node = nodes.setdefault(spec["pool"]["name"], {"name": spec["nodeName"], "gpus": {}, "unit": 0})
        for d in spec.get("devices") or ():
            attrs = d.get("attributes") or {}
            if (attrs.get("kind") or {}).get("string") == KIND_GPU:
                unit = int(attrs["memoryUnit"]["int"])
                node["unit"] = unit
                node["gpus"][int(attrs["index"]["int"])] = quantity(d["capacity"][CAPACITY]["value"]) // unit
    views = {}
    for pool, n in nodes.items():
        views[pool] = {"name": n["name"], "ipaddress": "-", "unit": n["unit"],
                       "gpus": [{"index": i, "allocated": 0, "total": t} for i, t in sorted(n["gpus"].items())],
                       "instances": []}
    for c in claims:
        results = [r for r in ((((c.get("status") or {}).get("allocation") or {}).get("devices") or {})
                               .get("results") or ()) if r.get("driver") == DRIVER and r.get("pool") in views]
        by_pool: dict[str, dict[str, int]] = {}
        for r in results:
            view, parsed = views[r["pool"]], parse_device(r.get("device"))
            if parsed is None or not view["unit"]:
                continue
            consumed = (r.get("consumedCapacity") or {}).get(CAPACITY)
            units = 1 if parsed[1] else (quantity(consumed) // view["unit"] if consumed is not None else
                                         next((g["total"] for g in view["gpus"] if g["index"] == parsed[0]), 0))
            per = by_pool.setdefault(r["pool"], {})
            per[str(parsed[0])] = per.get(str(parsed[0]), 0) + units
        meta = c.get("metadata") or {}
        users = [u.get("name") for u in (c.get("status") or {}).get("reservedFor") or () if u.get("resource") == "pods"]
        for pool, per in by_pool.items():
            for g in views[pool]["gpus"]:
                g["allocated"] += per.get(str(g["index"]), 0)
            views[pool]["instances"].append({"name": ",".join(users) or meta.get("name"),
                                             "namespace": meta.get("namespace"), "gpus": per,
                                             "allocated": sum(per.values())})
    out = []
    for v in views.values():
        allocated, total = sum(g["allocated"] for g in v["gpus"]), sum(g["total"] for g in v["gpus"])
        out.append({**v, "allocated": allocated, "total": total, "percent": allocated * 100 // total if total else 0})
    return sorted(out, key=lambda v: v["name"])
