"""`cgpu dra-plugin`: cgpud's DRA kubelet plugin, driver `cgpu.aliyun.com`
(docs/kubernetes.md, DRA mode), its own process beside the node daemon, which
it asks over the control socket (cgpud.client) only.

- Registration: the kubelet's plugin watcher (pluginregistration/v1) finds
  `<registry dir>/cgpu.aliyun.com-reg.sock`, asks GetInfo (type DRAPlugin,
  the endpoint `<plugin dir>/dra.sock`, service `v1.DRAPlugin`) and dials the
  endpoint. A kubelet that restarts finds the socket again; a socket removed
  is served anew within POLL seconds.
- DRAPlugin (the kubelet's dra/v1 api.proto): NodePrepareResources reads each
  claim from the API server, turns its allocation into shares
  (cgpud.k8s.dra.plan), writes the claim's CDI spec (one CDI device per
  request, carrying the environment the node's hook reads) and keeps the
  claim on disk (`<state dir>/<uid>.json`): a restarted plugin answers a
  Prepare again from there and can Unprepare what it prepared before.
  NodeUnprepareResources removes the spec and the record. The instance is
  made by the node's hook when the container starts (named by the
  container, in the tree as every container is) and removed when it stops.
- The node's ResourceSlices (cgpud.k8s.dra.resource_slices), published
  through the official client once the kubelet has registered the plugin,
  when the daemon's GPUs change, and again every `refresh` seconds until the
  API server took them.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from concurrent import futures

import grpc

from cgpud.client import Client, ControlError, DaemonUnavailable
from cgpud.containers.placement import unit_for
from cgpud.k8s import dra
from cgpud.k8s.api import one_line
from cgpud.k8s.proto import dra_pb2 as pb
from cgpud.k8s.proto import dra_pb2_grpc as rpc
from cgpud.k8s.proto import pluginregistration_pb2 as regpb
from cgpud.k8s.proto import pluginregistration_pb2_grpc as regrpc

log = logging.getLogger("cgpud.k8s")

SERVICE = "v1.DRAPlugin"  # what the kubelet calls the dra/v1 service (k8s.io/kubelet/pkg/apis/dra/v1)
DEFAULT_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
DEFAULT_PLUGIN_DIR = f"/var/lib/kubelet/plugins/{dra.DRIVER}"
DEFAULT_CDI_DIR = "/var/run/cdi"
DEFAULT_STATE_DIR = "/var/lib/cgpud/dra"
POLL = 0.1  # s: how often our sockets are looked at
REFRESH = 1.0  # s: how often the daemon is asked what GPUs it has


def write_atomically(path: str, data: bytes) -> None:
    """`path` holds either its old bytes or all of `data`, never a part (a runtime reading a CDI
    spec, a restart reading a record)."""
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class Node:
    """The daemon's GPUs and unit, asked every `refresh` seconds; `gpus` None while it does not
    answer. `on_change(gpus, unit)` after each change."""

    def __init__(self, socket: str | None) -> None:
        self.socket = socket
        self.gpus: list[dra.Gpu] | None = None
        self.unit = 0
        self.on_change = None

    def poll(self) -> None:
        try:
            with Client(self.socket, timeout=5) as c:
                snap = c.call("query")
            gpus, unit = dra.gpus_from_query(snap), unit_for(snap.get("mode", "exclusive"))
        except (DaemonUnavailable, ControlError, OSError, ValueError, KeyError) as exc:
            if self.gpus is not None:
                log.warning("cgpud does not answer (%s): claims are refused until it does", exc)
            self.gpus = None
            return
        if (gpus, unit) != (self.gpus, self.unit):
            self.gpus, self.unit = gpus, unit
            if self.on_change is not None:
                self.on_change(gpus, unit)

    def run(self, stop: threading.Event, refresh: float = REFRESH) -> None:
        while not stop.is_set():
            self.poll()
            stop.wait(refresh)


class Api:
    """The API server through the official client: claims read; the node's slices watched (so a
    slice someone deleted — the kubelet deletes its node's slices when it starts — is written
    again at once, and nothing is read to find out) and written when they differ."""

    def __init__(self, node: str) -> None:
        from kubernetes import client

        from cgpud.k8s.api import connect

        _, api_client = connect("cgpu-dra-plugin")
        self.resource = client.ResourceV1Api(api_client)
        self.node = node
        self.have: dict[str, dict] = {}  # our slices as the API server has them, by name
        self.lock = threading.Lock()
        self.on_change = None  # called when the watch brings a change to our slices
        self.watch = None

    def claim(self, namespace: str, name: str) -> dict:
        r = self.resource.read_namespaced_resource_claim(name, namespace, _preload_content=False)
        return json.loads(r.data)

    def start_watch(self) -> None:
        from cgpud.k8s.informer import Informer

        def ours(obj: dict) -> bool:
            return (obj.get("spec") or {}).get("driver") == dra.DRIVER

        def replace(items: list[dict]) -> None:
            with self.lock:
                self.have = {o["metadata"]["name"]: o for o in items if ours(o)}
            if self.on_change is not None:
                self.on_change()

        def event(kind: str, obj: dict) -> None:
            if not ours(obj):
                return
            with self.lock:
                if kind == "DELETED":
                    self.have.pop(obj["metadata"]["name"], None)
                else:
                    self.have[obj["metadata"]["name"]] = obj
            if self.on_change is not None:
                self.on_change()

        self.watch = Informer(f"ResourceSlices of {self.node}", self.resource.list_resource_slice, replace, event,
                              field_selector=f"spec.nodeName={self.node}")
        self.watch.sync()
        self.watch.start()

    def publish(self, slices: list[dict]) -> bool:
        """Write the node's slices when what the API server has differs, all with the pool's next
        generation (kube-scheduler reads a pool's slices of its highest generation only, so a slice
        left from a longer list earlier is ignored). True when it wrote."""
        def spec(obj: dict) -> dict:
            return {**obj.get("spec", {}), "pool": {**obj.get("spec", {}).get("pool", {}), "generation": None}}

        with self.lock:
            have = dict(self.have)
        if all(b["metadata"]["name"] in have and spec(have[b["metadata"]["name"]]) == spec(b) for b in slices):
            return False
        generation = 1 + max((int(o["spec"]["pool"].get("generation", 0)) for o in have.values()), default=0)
        for body in json.loads(json.dumps(slices)):
            body["spec"]["pool"]["generation"] = generation
            old = have.get(body["metadata"]["name"])
            if old is None:
                r = self.resource.create_resource_slice(body, _preload_content=False)
            else:
                body["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
                r = self.resource.replace_resource_slice(body["metadata"]["name"], body, _preload_content=False)
            written = json.loads(r.data)
            with self.lock:  # (its watch event may come later: a look before it must not write again)
                self.have[written["metadata"]["name"]] = written
        return True


class Driver(rpc.DRAPluginServicer):
    def __init__(self, node: Node, node_name: str, state_dir: str, cdi_dir: str, claims,
                 mounts: list[str] | None = None) -> None:
        self.node, self.node_name = node, node_name
        self.state_dir, self.cdi_dir = state_dir, cdi_dir
        self.claims = claims  # (namespace, name) -> the ResourceClaim as JSON
        self.mounts = mounts or []
        self.lock = threading.Lock()
        os.makedirs(state_dir, exist_ok=True)

    # ---- on disk -------------------------------------------------------------------------

    def record_path(self, uid: str) -> str:
        return os.path.join(self.state_dir, f"{uid}.json")

    def spec_path(self, uid: str) -> str:
        return os.path.join(self.cdi_dir, f"{dra.DRIVER}-{uid}.json")

    def prepared(self) -> dict[str, dict]:
        """The claims prepared and not unprepared, by UID (what survives a restart)."""
        out = {}
        for f in sorted(os.listdir(self.state_dir)):
            if f.endswith(".json") and not f.startswith("."):
                try:
                    with open(os.path.join(self.state_dir, f)) as fh:
                        out[f[:-5]] = json.load(fh)
                except (OSError, ValueError) as exc:
                    log.warning("unreadable record %s (%s): ignored", f, exc)
        return out

    # ---- the kubelet's calls -----------------------------------------------------------------

    def NodePrepareResources(self, request, context):
        out = {}
        for c in request.claims:
            try:
                out[c.uid] = self.prepare(c.namespace, c.name, c.uid)
            except dra.DraError as exc:
                log.warning("prepare %s/%s refused: %s", c.namespace, c.name, exc)
                out[c.uid] = pb.NodePrepareResourceResponse(error=str(exc))
            except OSError as exc:  # (the CDI directory or the state directory not writable, full…)
                log.warning("prepare %s/%s failed: %s", c.namespace, c.name, exc)
                out[c.uid] = pb.NodePrepareResourceResponse(
                    error=f"cannot write claim {c.uid}'s CDI spec or record: {exc.strerror or exc} ({exc.filename})")
        return pb.NodePrepareResourcesResponse(claims=out)

    def NodeUnprepareResources(self, request, context):
        out = {}
        for c in request.claims:
            try:
                self.unprepare(c.uid)
                out[c.uid] = pb.NodeUnprepareResourceResponse()
            except OSError as exc:
                out[c.uid] = pb.NodeUnprepareResourceResponse(error=f"cannot remove claim {c.uid}'s files: {exc}")
        return pb.NodeUnprepareResourcesResponse(claims=out)

    def prepare(self, namespace: str, name: str, uid: str) -> pb.NodePrepareResourceResponse:
        with self.lock:
            try:
                with open(self.record_path(uid)) as f:
                    record = json.load(f)  # prepared before (the kubelet asks again after its restart)
            except FileNotFoundError:
                record = None
            except (OSError, ValueError) as exc:  # (a record cut short by a full disk): prepared anew
                log.warning("claim %s's record is unreadable (%s): preparing it anew", uid, exc)
                record = None
            if record is None:
                record = self._prepare_new(namespace, name, uid)
        devices = []
        for d in record["devices"]:
            devices.append(pb.Device(request_names=[d["request"]], pool_name=d["pool"], device_name=d["device"],
                                     cdi_device_ids=d["cdi"], **({"share_id": d["share"]} if d.get("share") else {})))
        return pb.NodePrepareResourceResponse(devices=devices)

    def _prepare_new(self, namespace: str, name: str, uid: str) -> dict:
        gpus, unit = self.node.gpus, self.node.unit
        if gpus is None:
            raise dra.DraError("cgpud does not answer on the node: start it (cgpud serve)")
        try:
            claim = self.claims(namespace, name)
        except Exception as exc:  # noqa: BLE001 - any trouble asking: one line for the pod's events
            raise dra.DraError(f"cannot read ResourceClaim {namespace}/{name}: {one_line(exc)}") from None
        if (claim.get("metadata") or {}).get("uid") != uid:
            raise dra.DraError(f"ResourceClaim {namespace}/{name} is not the claim {uid} (deleted and made again?)")
        shares = dra.plan(claim, self.node_name, gpus, unit)
        results = [r for r in claim["status"]["allocation"]["devices"]["results"] if r.get("driver") == dra.DRIVER]
        devices, given = [], set()
        for r in results:  # each request's CDI device once, on its first device (the kubelet passes each on)
            first = r["request"] not in given
            given.add(r["request"])
            devices.append({"request": r["request"], "pool": r["pool"], "device": r["device"],
                            "share": r.get("shareID"),
                            "cdi": [f"{dra.CDI_VENDOR_CLASS}={dra.cdi_device(uid, r['request'])}"] if first else []})
        spec = dra.cdi_spec(uid, shares, gpus, unit, self.mounts)
        write_atomically(self.spec_path(uid), json.dumps(spec, indent=1).encode())
        record = {"namespace": namespace, "name": name, "uid": uid, "unit": unit,
                  "shares": [s.as_dict() for s in shares], "devices": devices}
        write_atomically(self.record_path(uid), json.dumps(record).encode())
        log.info("prepared %s/%s (%s): %s", namespace, name, uid, "; ".join(
            f"{s.request}: " + ", ".join(f"GPU {i} {b} bytes" for i, b in s.gpus) for s in shares))
        return record

    def unprepare(self, uid: str) -> None:
        with self.lock:
            for path in (self.spec_path(uid), self.record_path(uid)):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        log.info("unprepared %s", uid)


class Registration(regrpc.RegistrationServicer):
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.registered = threading.Event()

    def GetInfo(self, request, context):
        from cgpud.k8s import drahealth  # (KEP-4680: device health, docs/gpus.md Health)

        return regpb.PluginInfo(type="DRAPlugin", name=dra.DRIVER, endpoint=self.endpoint,
                                supported_versions=[SERVICE, drahealth.SERVICE])

    def NotifyRegistrationStatus(self, request, context):
        if request.plugin_registered:
            log.info("registered with the kubelet as %s", dra.DRIVER)
            self.registered.set()
        else:
            log.warning("the kubelet refused the registration: %s", request.error)
        return regpb.RegistrationStatusResponse()


def _ino(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


def serve(driver: Driver, registry_dir: str, plugin_dir: str, stop: threading.Event,
          registration: Registration | None = None) -> None:
    """Serve the plugin's socket and the registration socket until `stop`; either removed is
    served again (a kubelet that cleans its directories, or one of ours removed by hand)."""
    endpoint = os.path.join(plugin_dir, "dra.sock")
    reg = os.path.join(registry_dir, f"{dra.DRIVER}-reg.sock")
    registration = registration or Registration(endpoint)
    os.makedirs(plugin_dir, exist_ok=True)
    os.makedirs(registry_dir, exist_ok=True)
    from cgpud.k8s import drahealth
    from cgpud.k8s.proto import drahealth_pb2_grpc as healthrpc

    health = drahealth.Health(driver.node, driver.node_name, stop)

    def add_plugin(s) -> None:
        rpc.add_DRAPluginServicer_to_server(driver, s)
        healthrpc.add_DRAResourceHealthServicer_to_server(health, s)  # (KEP-4680: the kubelet's health stream)

    while not stop.is_set():
        servers = []
        for path, add in ((endpoint, add_plugin),
                          (reg, lambda s: regrpc.add_RegistrationServicer_to_server(registration, s))):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
            add(server)
            server.add_insecure_port(f"unix://{path}")
            server.start()
            servers.append(server)
        served = (_ino(endpoint), _ino(reg))
        log.info("serving %s and %s", endpoint, reg)
        while not stop.wait(POLL):
            if (_ino(endpoint), _ino(reg)) != served:
                log.info("a socket of ours was removed: serving both again")
                break
        for server in servers:
            server.stop(grace=0.5).wait()
    for path in (reg, endpoint):  # the kubelet sees the plugin go
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def main(socket: str | None, node_name: str, registry_dir: str, plugin_dir: str, cdi_dir: str,
         state_dir: str, refresh: float) -> None:
    from cgpud.state.paths import default_socket

    node = Node(socket or default_socket())
    api = Api(node_name)
    driver = Driver(node, node_name, state_dir, cdi_dir, api.claim,
                    mounts=[os.path.dirname(os.path.abspath(node.socket))])
    registration = Registration(os.path.join(plugin_dir, "dra.sock"))
    stop = threading.Event()
    pending = threading.Event()  # slices to write (the node changed, or the API server's differ)
    kick = threading.Event()  # (wakes the loop below at once)

    failing: list[str] = []  # the last failure said (said once until it works again)

    def publish(gpus, unit) -> None:
        pending.clear()
        try:
            slices = dra.resource_slices(node_name, gpus, unit)
            if api.publish(slices):
                log.info("published %d ResourceSlices of pool %s: %d GPUs in units of %d bytes", len(slices),
                         node_name, len(gpus), unit)
            failing.clear()
        except Exception as exc:  # noqa: BLE001 - tried again every refresh
            if not failing:
                log.warning("publishing the ResourceSlices of pool %s failed (%s); trying again", node_name,
                            one_line(exc))
            failing[:] = [one_line(exc)]
            pending.set()

    def changed() -> None:
        pending.set()
        kick.set()

    def follow() -> None:
        # The slices go out once the kubelet has registered the plugin: a pod placed on them before
        # that fails to prepare ("DRA driver cgpu.aliyun.com is not registered") and waits for the
        # kubelet's next try (80 s in the cluster tier, the DaemonSet's pod starting beside waiting pods).
        while not registration.registered.wait(POLL):
            if stop.is_set():
                return
        while not stop.is_set():
            node.poll()
            if pending.is_set() and node.gpus is not None:
                publish(node.gpus, node.unit)
            kick.wait(refresh)
            kick.clear()

    api.on_change = changed
    try:
        api.start_watch()
    except Exception as exc:  # noqa: BLE001 - its thread lists again; say it now
        log.warning("cannot list the ResourceSlices of %s yet (%s)", node_name, one_line(exc))
        threading.Thread(target=api.watch.run, daemon=True).start()
    node.on_change = publish
    log.info("cgpu DRA plugin %s on node %s: %d claims prepared before", dra.DRIVER, node_name,
             len(driver.prepared()))
    threading.Thread(target=follow, daemon=True).start()
    try:
        serve(driver, registry_dir, plugin_dir, stop, registration)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        time.sleep(0)
