"""KEP-4680's device health for the DRA plugin: the kubelet's `v1.DRAResourceHealth` service
(k8s.io/kubelet/pkg/apis/dra-health/v1, proto/drahealth.proto), and the same as v1alpha1 (what the
kubelets of 1.34-1.36 call), both advertised in its registration. The kubelet (ResourceHealthStatus, beta and on by default since 1.36) keeps one
NodeWatchResources stream open and puts each allocated device's health into the pod's status
(`kubectl describe pod`: allocatedResourcesStatus).

Every device of the node's pool (pool = node name: the GPU `gpu-N`, one device per GPU,
cgpud.k8s.dra) is HEALTHY while its GPU is in service and UNHEALTHY, with the reason,
while the daemon's health watch has it out (docs/gpus.md, Health); UNKNOWN while the daemon does not
answer. The list is sent at once on a change and again every RESEND seconds (the kubelet takes a
device not heard of within its timeout as Unknown).
"""
from __future__ import annotations

import threading
import time

import grpc

from cgpud.k8s import dra
from cgpud.k8s.proto import drahealth_pb2 as pb
from cgpud.k8s.proto import drahealth_pb2_grpc as rpc

SERVICE = "v1.DRAResourceHealth"
# The kubelets of 1.34-1.36 call v1alpha1 only (pkg/kubelet/cm/dra/plugin: drahealthv1alpha1 alone);
# 1.37's calls the first of v1, v1alpha1 the plugin's registration names. The two protos differ in
# their package alone (k8s.io/kubelet pkg/apis/dra-health/{v1,v1alpha1}/api.proto): the same
# messages on the wire, so one servicer answers both names (add_to_server).
SERVICE_ALPHA = "v1alpha1.DRAResourceHealth"
SERVICES = [SERVICE, SERVICE_ALPHA]
RESEND = 10.0  # s
TIMEOUT = 60  # s: health_check_timeout_seconds: past it the kubelet takes the device's health as Unknown
LOOK = 0.1  # s: how often the node's GPUs are looked at for a change


def _message(g: dra.Gpu) -> str:
    key, value = g.taint or ("", "")
    why = {dra.TAINT_XID: f"Xid {value}", dra.TAINT_LOST: "GPU is lost (fallen off the bus)",
           dra.TAINT_ECC: "double-bit ECC error"}.get(key, "failed")
    return f"GPU {g.index} ({g.uuid}) is out of service: {why}; see cgpu-smi and the cgpud log"[:1024]


def health_list(pool: str, gpus: list[dra.Gpu] | None, unit: int, known: list[dra.Gpu]) -> pb.NodeWatchResourcesResponse:
    """Every device of the pool with its health (`known`: the GPUs last seen, listed UNKNOWN while
    the daemon does not answer)."""
    now = int(time.time())
    out = []
    for g in (gpus if gpus is not None else known):
        health = pb.UNKNOWN if gpus is None else pb.UNHEALTHY if g.taint else pb.HEALTHY
        msg = "cgpud does not answer on the node" if gpus is None else _message(g) if g.taint else ""
        out.append(pb.DeviceHealth(device=pb.DeviceIdentifier(pool_name=pool, device_name=dra.device_name(g.index)),
                                   health=health, last_updated_time=now, health_check_timeout_seconds=TIMEOUT,
                                   message=msg))
    return pb.NodeWatchResourcesResponse(devices=out)


class Health(rpc.DRAResourceHealthServicer):
    """The service over the plugin's view of the node (draplugin.Node: `gpus`, `unit`)."""

    def __init__(self, node, pool: str, stopping: threading.Event | None = None) -> None:
        self.node, self.pool = node, pool
        self.stopping = stopping or threading.Event()
        self.known: list[dra.Gpu] = []

    def NodeWatchResources(self, request, context):
        sent, at = None, 0.0
        while context.is_active() and not self.stopping.is_set():
            gpus, unit = self.node.gpus, self.node.unit
            if gpus is not None:
                self.known = gpus
            key = (gpus, unit)
            if key != sent or time.monotonic() - at >= RESEND:
                sent, at = key, time.monotonic()
                yield health_list(self.pool, gpus, unit, self.known)
            self.stopping.wait(LOOK)


def add_to_server(servicer, server) -> None:
    """The health service under both names the kubelets call (SERVICES)."""
    rpc.add_DRAResourceHealthServicer_to_server(servicer, server)
    handlers = {"NodeWatchResources": grpc.unary_stream_rpc_method_handler(
        servicer.NodeWatchResources, request_deserializer=pb.NodeWatchResourcesRequest.FromString,
        response_serializer=pb.NodeWatchResourcesResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_ALPHA, handlers),))
