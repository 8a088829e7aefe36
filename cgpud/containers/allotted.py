"""On Kubernetes, a container's allocation is what the kubelet allotted, not its pod's spec
(SPEC §2 "who sets them", §9; docs/security.md "The pod's spec"). Pure.

Where a container comes from is told by annotations of its OCI spec that a pod cannot write:
containerd's CRI plugin sets `io.kubernetes.cri.container-type` (and the sandbox's ID, name,
namespace, UID) on every container it makes, after the annotations it passes through, so a pod
can neither forge nor remove them (containerd 1.6 pkg/cri/server/container_create_linux.go,
2.x internal/cri/server/container_create.go: the passthrough loops, then
DefaultCRIAnnotations). A spec without it is a plain host's (`docker run`, podman, `cgpu run`):
there the environment is the contract, as before.

The allocation travels as container annotations `cgpu.aliyun.com/allocation-<resource>` that the
device plugin's Allocate returns (ContainerAllocateResponse.annotations): the kubelet makes them the
CRI container config's annotations (pod annotations go to the sandbox's config only), and containerd
copies into the OCI spec those its runtime handler's `container_annotations` names — the cgpu
handler names ours, `cgpu.aliyun.com/allocation-*`, and nothing a pod writes (its own annotations
would need `pod_annotations`, which we never set). Each value is a JSON object of the contract's
variables (envspec.VARIABLES) as the plugin gave them in the environment.

    contract_env(env, config) -> (env, nvidia)

`env` is the environment the hook and `cgpu-runtime` read: on a plain host the spec's own; on
Kubernetes the spec's with every contract variable taken from the allocation. A contract variable
the pod (or its image) set to anything else than the allocation fails the start with one line
(AllotError): never obeyed, and said rather than silently dropped (docs/security.md says why).
NVIDIA_VISIBLE_DEVICES is the exception: CUDA images set it to `all` in their own ENV, so a
value other than the allotted one is not an error but is replaced — `nvidia` is the value the
spec must carry (the allotted GPUs' UUIDs, or `void`: none), or None when it carries it already
or the container is privileged (nvidia-container-toolkit's rule: `privileged`).

A container of a DRA claim (cgpud.k8s.dra) gets its environment from the claim's CDI spec, which
the node writes and which replaces the pod's value of each variable it names; it names every
contract variable (empty when unused) and DRA_CLAIM. Such a container is read from its
environment when it also has the bind the claim's CDI spec gives every container of it, the
daemon's tenant socket directory (`claim_mount`): a pod cannot make a bind of a host path without
a hostPath volume, which Pod Security's baseline forbids (docs/security.md: the claim's UID is not
yet checked against the node's records).
"""
from __future__ import annotations

import json
from typing import Mapping

from cgpud.containers.envspec import NVIDIA, VARIABLES

CRI_TYPE = "io.kubernetes.cri.container-type"  # containerd's CRI plugin, on every container it makes
PREFIX = "cgpu.aliyun.com/allocation-"  # + the resource's short name: one per device plugin
PASSTHROUGH = PREFIX + "*"  # the cgpu runtime handler's container_annotations (containerd's path.Match)
DRA_CLAIM = "CGPU_DRA_CLAIM"  # set by the DRA driver's CDI edits: <claim UID>/<request>
MAX_VALUE = 4096
NO_GPU = "void"  # NVIDIA's value for "no GPU" (nvidia-container-toolkit: NVIDIA_VISIBLE_DEVICES)
_NONE = ("", NO_GPU, "none")


class AllotError(ValueError):
    """The container must not start: str() is the one line."""


def key(resource: str) -> str:
    """The annotation of a resource's allocation: aliyun.com/gpu-mem → …allocation-gpu-mem."""
    return PREFIX + resource.rpartition("/")[2].replace(".", "-")


def annotations(resource: str, env: Mapping[str, str]) -> dict[str, str]:
    """What Allocate returns as the container's annotations for the environment it gives."""
    return {key(resource): json.dumps({k: v for k, v in sorted(env.items()) if k in VARIABLES},
                                      separators=(",", ":"))}


def is_kubernetes(spec_annotations: Mapping) -> bool:
    return spec_annotations.get(CRI_TYPE) == "container"


def allotted(spec_annotations: Mapping) -> dict[str, str] | None:
    """The contract variables of the spec's allocation annotations, merged; None without any."""
    out: dict[str, str] = {}
    found = False
    for k in sorted(spec_annotations):
        if not isinstance(k, str) or not k.startswith(PREFIX):
            continue
        found = True
        raw = spec_annotations[k]
        try:
            value = json.loads(raw) if isinstance(raw, str) and len(raw) <= MAX_VALUE else None
        except ValueError:
            value = None
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise AllotError(f"annotation {k}: not an allocation of the device plugin (a JSON object of strings)")
        for name, v in value.items():
            if name not in VARIABLES:
                raise AllotError(f"annotation {k}: {name} is not a variable of the allocation")
            if out.get(name, v) != v:
                raise AllotError(f"annotation {k}: {name}={v}, another allocation gives {out[name]}")
            out[name] = v
    return out if found else None


def _show(v: str) -> str:
    return v if len(v) <= 60 and v.isprintable() else repr(v[:60])


def contract_env(env: Mapping[str, str], config: Mapping,
                 claim_mount: str | None = None) -> tuple[dict[str, str], str | None]:
    """(the environment to read, the NVIDIA_VISIBLE_DEVICES the spec must carry or None) of a spec
    (config.json) whose process.env is `env`; `claim_mount` the host path every claim's container
    has bound (the daemon's tenant socket directory; None: unknown, no claim believed); AllotError."""
    env = dict(env)
    ann = config.get("annotations")
    ann = ann if isinstance(ann, dict) else {}
    if not is_kubernetes(ann):
        return env, None
    given = allotted(ann)
    claim = env.get(DRA_CLAIM, "").strip()
    if given is None and claim:
        if claim_mount is not None and _binds(config, claim_mount):
            return env, None  # a claim's container: its CDI spec set every variable (see above)
        raise AllotError(f"{DRA_CLAIM}={_show(claim)} is set by the pod's spec or image, not by a claim's CDI device "
                         f"(the container has not the bind of {claim_mount or 'the daemon’s socket directory'} that "
                         "every claim's container has): remove it from the pod")
    given = given or {}
    for name in VARIABLES:
        if name == NVIDIA:
            continue
        have, want = env.get(name, "").strip(), given.get(name, "").strip()
        if have != want:
            what = f"the device plugin allotted {name}={_show(want)}" if want else "the device plugin did not set it"
            raise AllotError(f"{name}={_show(have)} is set by the pod's spec or image, and on Kubernetes the "
                             f"allocation is what the kubelet allotted ({what}): remove it from the pod")
    want_gpus = given.get(NVIDIA, "").strip() or NO_GPU
    have_gpus = env.get(NVIDIA)
    ok = have_gpus is None or privileged(config) or have_gpus.strip() == want_gpus or (want_gpus == NO_GPU and have_gpus.strip().lower() in _NONE)
    out = {k: v for k, v in env.items() if k not in VARIABLES}
    out.update(given)
    return out, None if ok else want_gpus


def _binds(config: Mapping, source: str) -> bool:
    mounts = config.get("mounts")
    return isinstance(mounts, list) and any(isinstance(m, dict) and m.get("source") == source for m in mounts)


def privileged(config: Mapping) -> bool:
    """CAP_SYS_ADMIN in the bounding set: privileged (or granted it), as nvidia-container-toolkit tells
    one whose NVIDIA_VISIBLE_DEVICES it believes. Such a pod sees the host's devices anyway; Pod
    Security's baseline forbids both to tenants. (cgpud's own DaemonSet pods are of them.)"""
    process = config.get("process")
    caps = process.get("capabilities") if isinstance(process, dict) else None
    bounding = caps.get("bounding") if isinstance(caps, dict) else None
    return isinstance(bounding, list) and "CAP_SYS_ADMIN" in bounding


def with_nvidia(config: dict, value: str) -> dict:
    """config with process.env's NVIDIA_VISIBLE_DEVICES entries replaced by one, `value`."""
    process = dict(config.get("process") or {})
    entries = [e for e in process.get("env") or [] if not (isinstance(e, str) and e.partition("=")[0] == NVIDIA)]
    process["env"] = entries + [f"{NVIDIA}={value}"]
    return {**config, "process": process}
