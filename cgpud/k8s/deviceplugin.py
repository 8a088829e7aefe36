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
  GetPreferredAllocation, Allocate (the environment the container sees, and
  the same allocation as the container's annotations, which the node's hook
  and cgpu-runtime read: a pod cannot write them, containers.allotted; a
  request that cannot be met is a gRPC error whose message says why),
  PreStartContainer (nothing to do).
- `serve` keeps it registered: it serves `<plugin dir>/cgpu.sock`, registers
  with `<plugin dir>/kubelet.sock`, and when the kubelet restarts (its socket
  is made anew) or our socket is removed (the kubelet clears the directory at
  start), serves and registers again, within POLL seconds.

Longer than 450 lines on purpose: one plugin serves the node's three resources (a node's mode,
docs/kubernetes.md) with the health, the mode and the MPS environment each a few lines of the same
Allocate and ListAndWatch; split, each part would repeat the kubelet's protocol around them.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures

import grpc

from cgpud.client import Client, ControlError, DaemonUnavailable
from cgpud.containers import allotted
from cgpud.control.callers import TENANT_DIR
from cgpud.k8s import modes
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
        self.instances: list[str] | None = None  # the daemon's instances' names (None: not known)
        self.daemon_mode: str | None = None  # the mode the daemon places containers by
        self.on_instances = None  # called when the daemon's instances change (the node's mode waits for them)

    def bump(self) -> None:
        """Send every device list again (the node's mode changed)."""
        with self.changed:
            self.version += 1
            self.changed.notify_all()

    def poll(self) -> None:
        try:
            with Client(self.socket, timeout=5) as c:
                snap = c.call("query")
                gpus = res.gpus_from_query(snap)
            names = sorted({i["name"] for g in snap.get("gpus", []) for i in g.get("instances", [])})
            if names != self.instances or snap.get("mode") != self.daemon_mode:
                self.instances, self.daemon_mode = names, snap.get("mode")
                if self.on_instances is not None:
                    self.on_instances()
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
    resource, endpoint = res.RESOURCE, ENDPOINT

    def __init__(self, source: Source, unit: int | None = None, strategy: str = "binpack",
                 disable_isolation: bool = False, node: "NodeApi | None" = None, mode: str = "cgpu") -> None:
        self.source, self.flag_unit = source, unit  # (--unit; None: the mode's, res.mode_unit)
        # The node's mode (cgpud.k8s.modes): the label's once the node and its pods are read, else --mode
        self.flag_mode = self.mode = mode
        self.decision: modes.Decision | None = None
        self.mode_lock = threading.Lock()
        self._warned: str | None = None  # the last warning about the label's value (said once)
        # the flags; the node's labels, when read, say otherwise (placement) or add (no isolation)
        self.flag_strategy, self.flag_disable = strategy, disable_isolation
        self.labels: dict[str, str] = {}
        self.node = node  # the API server's side (cgpud.k8s.nodeapi), when there is one
        self.published: tuple | None = None  # the per-GPU units and GPUs out of service the API server last accepted
        # The daemon's socket directory as a container sees it: its containers' directory (the containers'
        # socket only, control.callers.TENANT_DIR) mounted read-only at its path: `cgpu mem` works inside.
        self.socket_dir: str | None = os.path.dirname(os.path.abspath(source.socket)) if source.socket else None
        self.stopping = threading.Event()

    @property
    def strategy(self) -> str:
        label = self.labels.get(PLACEMENT_LABEL)
        return label if label in res.STRATEGIES else self.flag_strategy

    @property
    def unit(self) -> int:
        """The memory of one device: --unit, else the mode's (128 MiB on a share node, SPEC §3). It
        changes only with the mode, which waits until no GPU pod is left on the node."""
        return self.flag_unit or res.mode_unit(self.mode)

    @property
    def disable_isolation(self) -> bool:
        return self.flag_disable or self.labels.get(DISABLE_LABEL) == "true" or self.mode == "share"

    def reconsider(self) -> None:
        """Work out the node's mode again (its labels, its GPU pods or the daemon's instances
        changed): switch to the label's mode when nothing holds a GPU, else keep the one in force
        and say why (cgpud.k8s.modes.decide); every device list is sent again on a switch."""
        node = self.node
        if node is None or not node.usable or node.node_labels is None or not node.pods_synced:
            return  # (the label is read with the node; without the API server: --mode)
        with self.mode_lock:
            want, warning = modes.wanted(node.node_labels, self.flag_mode)
            if warning and warning != self._warned:
                log.warning("%s", warning)
                node.node_event("GpuModeUnknown", warning)
            self._warned = warning
            holders = list(node.gpu_pods.values()) + [f"instance {n}" for n in self.source.instances or ()
                                                      if not node.gpu_pods]
            current = self.mode if self.decision is not None else node.mode_in_force
            decision = modes.decide(current, want, holders)
            if decision == self.decision:
                self._tell_daemon()
                return
            before, self.decision, self.mode = self.mode if self.decision is not None else current, decision, \
                decision.mode
            log.info("%s", decision.message())
        node.write_mode(decision, before)
        self.source.bump()
        self._tell_daemon()
        self.node_changed(self.source.gpus)  # (the GPUs' units, when the mode changed the unit)

    def _tell_daemon(self) -> None:
        """The daemon places (and refuses) the containers that start by the node's mode in force."""
        if self.mode == "disabled" or self.source.daemon_mode in (None, self.mode):
            return
        try:
            with Client(self.source.socket, timeout=5) as c:
                c.call("mode", mode=self.mode)
            self.source.daemon_mode = self.mode
            log.info("cgpud places containers in mode %s from now on", self.mode)
        except (DaemonUnavailable, ControlError, OSError) as exc:
            log.warning("cannot tell cgpud the node's mode %s (%s); trying again", self.mode, exc)

    def advertising(self, resource: str | None = None) -> bool:
        return modes.advertises(self.mode, resource or self.resource)

    def _not_here(self, context) -> None:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"this node runs in mode {self.mode} ({modes.LABEL}), which has no {self.resource}: "
                      f"{', '.join(modes.RESOURCES[self.mode]) or 'no GPU resource'} only")

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
        self.reconsider()

    def follow_node(self, stop: threading.Event, every: float = NODE_REFRESH) -> None:
        while not stop.wait(every):
            self.node_changed(self.source.gpus)

    def _gpus(self, context) -> list[res.Gpu]:
        gpus = self.source.gpus
        if gpus is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "cgpud does not answer on the node: start it (cgpud serve)")
        return gpus

    def device_list(self) -> pb.ListAndWatchResponse:
        if not self.advertising():
            return pb.ListAndWatchResponse(devices=[])
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
        if not self.advertising():
            self._not_here(context)
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
        if not self.advertising():
            self._not_here(context)
        out, choices = [], []
        try:
            for creq in request.container_requests:
                env = self._allocate_one(list(creq.devices_ids), gpus, choices)
                mounts = [pb.Mount(container_path=self.socket_dir, host_path=os.path.join(self.socket_dir, TENANT_DIR),
                                   read_only=True)] if self.socket_dir else []
                if self.mode == "mps":  # MPS the isolation layer: the client's limits and the pipe directory
                    env.update(res.mps_environment(env, gpus, self.unit))
                    mounts.append(pb.Mount(container_path=res.MPS_PIPE_DIR, host_path=res.MPS_PIPE_DIR,
                                           read_only=False))
                    mounts.append(pb.Mount(container_path="/dev/shm", host_path=res.MPS_SHM_DIR, read_only=False))
                log.info("Allocate: %s", " ".join(f"{k}={v}" for k, v in sorted(env.items())))
                out.append(pb.ContainerAllocateResponse(envs=env, mounts=mounts,
                                                        annotations=allotted.annotations(res.RESOURCE, env)))
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


class ModePlugin(rpc.DevicePluginServicer):
    """A resource of the node's other modes (cgpud.k8s.modes), served beside aliyun.com/gpu-mem on
    its own endpoint: listed only while the node's mode (the gpu-mem plugin's, `main`) uses it."""

    resource = endpoint = ""

    def __init__(self, main: Plugin) -> None:
        self.main, self.source = main, main.source
        self.stopping = threading.Event()

    def advertising(self) -> bool:
        return self.main.advertising(self.resource)

    def ids(self, g: res.Gpu) -> list[str]:
        raise NotImplementedError

    def device_list(self) -> pb.ListAndWatchResponse:
        if not self.advertising():
            return pb.ListAndWatchResponse(devices=[])
        up = {g.uuid for g in self.source.gpus or () if g.healthy}
        known = sorted(self.source.known.values(), key=lambda g: g.index)
        return pb.ListAndWatchResponse(devices=[pb.Device(ID=dev, health="Healthy" if g.uuid in up else "Unhealthy")
                                                for g in known for dev in self.ids(g)])

    ListAndWatch = Plugin.ListAndWatch

    def GetDevicePluginOptions(self, request, context):
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)

    def GetPreferredAllocation(self, request, context):
        return pb.PreferredAllocationResponse()

    def PreStartContainer(self, request, context):
        return pb.PreStartContainerResponse()

    def Allocate(self, request, context):
        gpus = self.main._gpus(context)
        if not self.advertising():
            Plugin._not_here(self, context)
        out = []
        try:
            for creq in request.container_requests:
                env = self.environment(list(creq.devices_ids), gpus)
                log.info("Allocate %s: %s", self.resource, " ".join(f"{k}={v}" for k, v in sorted(env.items())))
                out.append(pb.ContainerAllocateResponse(envs=env, annotations=allotted.annotations(self.resource, env)))
        except res.AllocationError as exc:
            log.warning("Allocate refused: %s", exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.AllocateResponse(container_responses=out)

    @property
    def mode(self) -> str:
        return self.main.mode

    def environment(self, ids: list[str], gpus: list[res.Gpu]) -> dict[str, str]:
        raise NotImplementedError


class WholeGpuPlugin(ModePlugin):
    """`nvidia.com/gpu` (mode exclusive): one device per GPU, its UUID; the container gets the
    plain GPU (no ALIYUN_COM_GPU_MEM_CONTAINER: the node's hook leaves it alone)."""

    resource, endpoint = modes.WHOLE, "cgpu-whole.sock"

    def ids(self, g: res.Gpu) -> list[str]:
        return [g.uuid]

    def environment(self, ids: list[str], gpus: list[res.Gpu]) -> dict[str, str]:
        by_uuid = {g.uuid: g for g in gpus}
        bad = [d for d in ids if d not in by_uuid or not by_uuid[d].healthy]
        if not ids or bad or len(set(ids)) != len(ids):
            raise res.AllocationError(f"{', '.join(bad) or 'no device'}: not this node's {self.resource} "
                                      "(whole GPUs in service, by UUID), or given twice")
        return {"NVIDIA_VISIBLE_DEVICES": ",".join(sorted(ids, key=lambda u: by_uuid[u].index))}


class CorePlugin(ModePlugin):
    """`aliyun.com/gpu-core.percentage` (mode core_mem): 100 devices per GPU, one per percent,
    IDs `<GPU-UUID>-_-core-<j>`; a container's count is its compute percentage
    (ALIYUN_COM_GPU_CORE_PERCENTAGE), a multiple of 5 from 5 to 100 (docs/scheduler.md)."""

    resource, endpoint = modes.CORE, "cgpu-core.sock"

    def ids(self, g: res.Gpu) -> list[str]:
        return [f"{g.uuid}{res.SEP}core-{j}" for j in range(100)]

    def environment(self, ids: list[str], gpus: list[res.Gpu]) -> dict[str, str]:
        mine = {dev for g in gpus for dev in self.ids(g)}
        bad = [d for d in ids if d not in mine]
        if bad or len(set(ids)) != len(ids):
            raise res.AllocationError(f"{', '.join(bad) or 'a device given twice'}: not this node's {self.resource}")
        return {res.CORE_ENV: str(res.check_percentage(len(ids)))}


def _ino(path: str) -> tuple[int, int] | None:
    """Which file is at `path` now: its inode and change time (a socket made
    anew may get the same inode number back)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


def register(plugin_dir: str, endpoint: str = ENDPOINT, resource: str = res.RESOURCE,
             preferred: bool = True) -> None:
    with grpc.insecure_channel(f"unix://{os.path.join(plugin_dir, 'kubelet.sock')}") as ch:
        rpc.RegistrationStub(ch).Register(pb.RegisterRequest(
            version=VERSION, endpoint=endpoint, resource_name=resource,
            options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=preferred)),
            timeout=5)


def serve(plugin: "Plugin | list", plugin_dir: str, stop: threading.Event) -> None:
    """Serve each plugin's endpoint and stay registered (aliyun.com/gpu-mem first) until `stop`."""
    plugins = plugin if isinstance(plugin, list) else [plugin]
    socks = [os.path.join(plugin_dir, p.endpoint) for p in plugins]
    kubelet = os.path.join(plugin_dir, "kubelet.sock")
    while not stop.is_set():
        servers = []
        for p, ours in zip(plugins, socks):
            try:
                os.unlink(ours)
            except FileNotFoundError:
                pass
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
            rpc.add_DevicePluginServicer_to_server(p, server)
            server.add_insecure_port(f"unix://{ours}")
            server.start()
            servers.append(server)
        served, registered_with = [_ino(o) for o in socks], None
        while not stop.is_set():
            now = _ino(kubelet)
            if [_ino(o) for o in socks] != served:
                log.info("%s was removed (the kubelet restarted?): serving it again", plugin_dir)
                break
            if now is not None and now != registered_with:
                try:
                    for p in plugins:
                        register(plugin_dir, p.endpoint, p.resource, p.endpoint == ENDPOINT)
                    registered_with = now
                    log.info("registered %s with the kubelet at %s", ", ".join(p.resource for p in plugins), kubelet)
                except grpc.RpcError as exc:
                    log.warning("registering with the kubelet failed (%s); trying again", exc.details())
            stop.wait(POLL)
        for p in plugins:
            p.stopping.set()
        for server in servers:
            server.stop(grace=0.5).wait()
        for p in plugins:
            p.stopping.clear()


def main(socket: str | None, plugin_dir: str, unit_name: str | None, strategy: str, disable_isolation: bool,
         node_name: str | None = None, node_refresh: float = NODE_REFRESH, mode: str = "cgpu") -> None:
    from cgpud.state.paths import default_socket

    source = Source(socket or default_socket())
    node = NodeApi(node_name)
    node.say_once()
    plugin = Plugin(source, res.UNITS[unit_name] if unit_name else None, strategy, disable_isolation, node, mode)
    source.on_change = plugin.node_changed
    source.on_instances = node.on_pods = plugin.reconsider
    node.on_labels = plugin.labels_changed
    node.start()
    stop = threading.Event()
    poller = threading.Thread(target=source.run, args=(stop,), daemon=True)
    poller.start()
    if node.usable:
        threading.Thread(target=plugin.follow_node, args=(stop, node_refresh), daemon=True).start()
    log.info("cgpu device plugin: %s in units of %s, %s; kubelet at %s", res.RESOURCE,
             unit_name or "the mode's (128MiB on a share node, else GiB)", strategy, plugin_dir)
    try:
        serve([plugin, WholeGpuPlugin(plugin), CorePlugin(plugin)], plugin_dir, stop)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        time.sleep(0)
