"""`cgpu device-plugin`: the kubelet device plugin for `aliyun.com/gpu-mem`
(docs/kubernetes.md), its own process beside the node daemon, which it asks
over the control socket (cgpud.client) only.

The server (gRPC from the kubelet's own api.proto, package v1beta1) stands
apart from the resource logic (cgpud.k8s.resources):

- `Plugin` answers the kubelet: GetDevicePluginOptions (preferred allocation
  available), ListAndWatch (the units, Healthy while the daemon answers and
  has their GPU in service, Unhealthy otherwise: every unit of a GPU the
  daemon's health watch took out of service at once, docs/gpus.md Health;
  sent again on every change),
  GetPreferredAllocation, Allocate (the environment the node's hook reads; a
  request that cannot be met is a gRPC error whose message says why),
  PreStartContainer (nothing to do).
- `serve` keeps it registered: it serves `<plugin dir>/cgpu.sock`, registers
  with `<plugin dir>/kubelet.sock`, and when the kubelet restarts (its socket
  is made anew) or our socket is removed (the kubelet clears the directory at
  start), serves and registers again, within POLL seconds.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures

import grpc

from cgpud.client import Client, ControlError, DaemonUnavailable
from cgpud.k8s import resources as res
from cgpud.k8s.cluster import DISABLE_LABEL, PLACEMENT_LABEL
from cgpud.k8s.nodeapi import NodeApi, Unreachable
from cgpud.k8s.proto import api_pb2 as pb
from cgpud.k8s.proto import api_pb2_grpc as rpc

log = logging.getLogger("cgpud.k8s")

VERSION = "v1beta1"
DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
ENDPOINT = "cgpu.sock"
POLL = 0.1  # s: how often the kubelet's socket and ours are looked at
REFRESH = 1.0  # s: how often the daemon is asked what GPUs it has
NODE_REFRESH = 5.0  # s: how often a publish the API server refused is tried again


class Source:
    """The daemon's GPUs, asked again every `refresh` seconds; `gpus` None while
    it does not answer (its units are then Unhealthy)."""

    def __init__(self, socket: str | None, refresh: float = REFRESH) -> None:
        self.socket, self.refresh = socket, refresh
        self.gpus: list[res.Gpu] | None = None
        self.known: dict[str, res.Gpu] = {}  # every GPU ever seen, by UUID: lost ones are listed Unhealthy
        self.changed = threading.Condition()
        self.version = 0
        self.on_change = None  # called with the GPUs after a change (outside the lock)

    def poll(self) -> None:
        try:
            with Client(self.socket, timeout=5) as c:
                gpus = res.gpus_from_query(c.call("query"))
        except (DaemonUnavailable, ControlError, OSError, ValueError, KeyError) as exc:
            if self.gpus is not None:
                log.warning("cgpud does not answer (%s): every unit is Unhealthy until it does", exc)
            gpus = None
        with self.changed:
            before = (self.gpus and [(g.uuid, g.healthy) for g in self.gpus], set(self.known))
            self.gpus = gpus
            for g in gpus or ():
                self.known[g.uuid] = g
            changed = (self.gpus and [(g.uuid, g.healthy) for g in self.gpus], set(self.known)) != before
            if changed:
                self.version += 1
                self.changed.notify_all()
        if changed and gpus and self.on_change is not None:
            self.on_change(gpus)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.poll()
            stop.wait(self.refresh)


class Plugin(rpc.DevicePluginServicer):
    def __init__(self, source: Source, unit: int = res.GIB, strategy: str = "binpack",
                 disable_isolation: bool = False, node: "NodeApi | None" = None) -> None:
        self.source, self.unit = source, unit
        # the flags; the node's labels, when read, say otherwise (placement) or add (no isolation)
        self.flag_strategy, self.flag_disable = strategy, disable_isolation
        self.labels: dict[str, str] = {}
        self.node = node  # the API server's side (cgpud.k8s.nodeapi), when there is one
        self.published: tuple | None = None  # the per-GPU units and GPUs out of service the API server last accepted
        # The daemon's socket directory, mounted into each container: `cgpu mem` and the simulated
        # GPUs' device files work inside it.
        self.socket_dir: str | None = os.path.dirname(os.path.abspath(source.socket)) if source.socket else None
        self.stopping = threading.Event()

    @property
    def strategy(self) -> str:
        label = self.labels.get(PLACEMENT_LABEL)
        return label if label in res.STRATEGIES else self.flag_strategy

    @property
    def disable_isolation(self) -> bool:
        return self.flag_disable or self.labels.get(DISABLE_LABEL) == "true"

    def node_changed(self, gpus: list[res.Gpu] | None) -> None:
        """The daemon's GPUs changed (or NODE_REFRESH passed): publish them if the API server does
        not have them yet (a write only when needed: the node's labels come by its watch)."""
        if self.node is None or not self.node.usable:
            return
        units = [g.units(self.unit) for g in gpus] if gpus else None
        out = [g.index for g in gpus if not g.healthy] if gpus else []
        if units is not None and (units, out) != self.published and self.node.publish(units, unhealthy=out):
            self.published = (units, out)

    def labels_changed(self, labels: dict[str, str]) -> None:
        """The node's labels, as its watch brought them."""
        if labels.get(PLACEMENT_LABEL) not in (None, *res.STRATEGIES):
            log.warning("node label %s=%s is neither binpack nor spread: placing by --placement (%s)",
                        PLACEMENT_LABEL, labels[PLACEMENT_LABEL], self.flag_strategy)
        self.labels = labels

    def follow_node(self, stop: threading.Event, every: float = NODE_REFRESH) -> None:
        while not stop.wait(every):
            self.node_changed(self.source.gpus)

    def _gpus(self, context) -> list[res.Gpu]:
        gpus = self.source.gpus
        if gpus is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "cgpud does not answer on the node: start it (cgpud serve)")
        return gpus

    def device_list(self) -> pb.ListAndWatchResponse:
        up = {g.uuid for g in self.source.gpus or () if g.healthy}
        known = sorted(self.source.known.values(), key=lambda g: g.index)
        return pb.ListAndWatchResponse(devices=[
            pb.Device(ID=dev, health="Healthy" if g.uuid in up else "Unhealthy")
            for g in known for dev, _ in res.devices([g], self.unit)])

    def GetDevicePluginOptions(self, request, context):
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(self, request, context):
        seen = -1
        while context.is_active() and not self.stopping.is_set():
            with self.source.changed:
                if self.source.version == seen:
                    self.source.changed.wait(0.5)
                if self.source.version == seen:
                    continue
                seen = self.source.version
                resp = self.device_list()
            yield resp

    def GetPreferredAllocation(self, request, context):
        gpus = self._gpus(context)
        out = []
        for creq in request.container_requests:
            available, must = list(creq.available_deviceIDs), list(creq.must_include_deviceIDs)
            try:
                ids = self._extenders_units(available, must, creq.allocation_size, gpus) \
                    or res.preferred(available, must, creq.allocation_size, gpus, self.unit, self.strategy)
            except res.AllocationError as exc:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            out.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=out)

    def _extenders_units(self, available: list[str], must: list[str], size: int, gpus: list[res.Gpu]) -> list[str]:
        """The kubelet's units on the GPU(s) the scheduler extender chose for this container, when
        it chose and they are free: so the kubelet counts each GPU's units as they are really used
        (gpushare takes the GPU from the annotation and leaves the kubelet counting others). [] when
        there is no such choice, or the API server cannot be asked now (Allocate will say)."""
        try:
            choice = self.node.assumed(size, reserve=False) if self.node is not None else None
        except Unreachable:
            return []
        if choice is None or size % len(choice.gpus):
            return []
        try:
            return res.preferred(available, must, size, gpus, self.unit, self.strategy, count=len(choice.gpus),
                                 only=choice.gpus)
        except res.AllocationError:
            return []

    def Allocate(self, request, context):
        gpus = self._gpus(context)
        out, choices = [], []
        try:
            for creq in request.container_requests:
                env = self._allocate_one(list(creq.devices_ids), gpus, choices)
                log.info("Allocate: %s", " ".join(f"{k}={v}" for k, v in sorted(env.items())))
                mounts = [pb.Mount(container_path=self.socket_dir, host_path=self.socket_dir, read_only=False)] \
                    if self.socket_dir else []
                out.append(pb.ContainerAllocateResponse(envs=env, mounts=mounts))
        except (res.AllocationError, Unreachable) as exc:
            for choice in choices:  # nothing half-done: the extender's choices stay for the next try
                self.node.release(choice)
            log.warning("Allocate refused: %s", exc)
            context.abort(grpc.StatusCode.UNAVAILABLE if isinstance(exc, Unreachable)
                          else grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        for choice in choices:
            self.node.confirm(choice)
        return pb.AllocateResponse(container_responses=out)

    def _allocate_one(self, ids: list[str], gpus: list[res.Gpu], choices: list) -> dict[str, str]:
        """One container's environment: on the GPU(s) the scheduler extender chose for it, when it
        did (its choice reserved in `choices`), else on the GPU(s) of the kubelet's units."""
        for dev in ids:
            res.gpu_of(dev, gpus, self.unit)  # only this node's units, whoever chose the GPU
        choice = self.node.assumed(len(ids)) if self.node is not None and ids else None
        if choice is None:
            return res.allocation(ids, gpus, self.unit, disable_isolation=self.disable_isolation)
        choices.append(choice)
        log.info("Allocate: %s/%s, on GPU %s as the scheduler extender chose", choice.namespace, choice.name,
                 ",".join(map(str, choice.gpus)))
        if len(ids) % len(choice.gpus):
            raise res.AllocationError(f"{len(ids)} units cannot be split evenly over GPUs "
                                      f"{','.join(map(str, choice.gpus))} (pod {choice.namespace}/{choice.name}'s "
                                      "ALIYUN_COM_GPU_MEM_IDX)")
        return res.environment(choice.gpus, len(ids) // len(choice.gpus), gpus, self.unit,
                               disable_isolation=self.disable_isolation)

    def PreStartContainer(self, request, context):
        return pb.PreStartContainerResponse()


def _ino(path: str) -> tuple[int, int] | None:
    """Which file is at `path` now: its inode and change time (a socket made
    anew may get the same inode number back)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


def register(plugin_dir: str) -> None:
    with grpc.insecure_channel(f"unix://{os.path.join(plugin_dir, 'kubelet.sock')}") as ch:
        rpc.RegistrationStub(ch).Register(pb.RegisterRequest(
            version=VERSION, endpoint=ENDPOINT, resource_name=res.RESOURCE,
            options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)),
            timeout=5)


def serve(plugin: Plugin, plugin_dir: str, stop: threading.Event) -> None:
    """Serve and stay registered until `stop`."""
    ours = os.path.join(plugin_dir, ENDPOINT)
    kubelet = os.path.join(plugin_dir, "kubelet.sock")
    while not stop.is_set():
        try:
            os.unlink(ours)
        except FileNotFoundError:
            pass
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        rpc.add_DevicePluginServicer_to_server(plugin, server)
        server.add_insecure_port(f"unix://{ours}")
        server.start()
        served, registered_with = _ino(ours), None
        while not stop.is_set():
            now = _ino(kubelet)
            if _ino(ours) != served:
                log.info("%s was removed (the kubelet restarted?): serving it again", ours)
                break
            if now is not None and now != registered_with:
                try:
                    register(plugin_dir)
                    registered_with = now
                    log.info("registered %s with the kubelet at %s", res.RESOURCE, kubelet)
                except grpc.RpcError as exc:
                    log.warning("registering with the kubelet failed (%s); trying again", exc.details())
            stop.wait(POLL)
        plugin.stopping.set()
        server.stop(grace=0.5).wait()
        plugin.stopping.clear()


def main(socket: str | None, plugin_dir: str, unit_name: str, strategy: str, disable_isolation: bool,
         node_name: str | None = None, node_refresh: float = NODE_REFRESH) -> None:
    from cgpud.state.paths import default_socket

    source = Source(socket or default_socket())
    node = NodeApi(node_name)
    node.say_once()
    plugin = Plugin(source, res.UNITS[unit_name], strategy, disable_isolation, node)
    source.on_change = plugin.node_changed
    node.on_labels = plugin.labels_changed
    node.start()
    stop = threading.Event()
    poller = threading.Thread(target=source.run, args=(stop,), daemon=True)
    poller.start()
    if node.usable:
        threading.Thread(target=plugin.follow_node, args=(stop, node_refresh), daemon=True).start()
    log.info("cgpu device plugin: %s in units of %s, %s; kubelet at %s", res.RESOURCE, unit_name, strategy, plugin_dir)
    try:
        serve(plugin, plugin_dir, stop)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        time.sleep(0)
