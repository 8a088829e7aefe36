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
  through the official client (cgpud.k8s.draapi) once the kubelet has
  registered the plugin, when the daemon's GPUs or the node's mode change
  (cgpud.k8s.dranode), and again every `refresh` seconds until the API
  server took them; what the API server serves of DRA read at start
  (cgpud.k8s.draserved).

Longer than 450 lines on purpose: the kubelet's two servers and the claims' records and CDI specs
kept through a reboot share one driver's state and locks (the API server's side, the node's and
the probe of what the server serves are modules of their own).
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

from cgpud.k8s import dra, draserved, modes
from cgpud.k8s.api import one_line
from cgpud.k8s.draapi import Api  # noqa: F401 - (draplugin.Api, as the tests and bench name it)
from cgpud.k8s.dranode import Modes, Node  # noqa: F401 - (likewise)
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


class Driver(rpc.DRAPluginServicer):
    """The kubelet's Prepare and Unprepare. Each claim has a lock of its own (a claim whose API call
    hangs holds up no other); the API server is asked with a timeout."""

    def __init__(self, node: Node, node_name: str, state_dir: str, cdi_dir: str, claims,
                 mounts: list[str] | None = None) -> None:
        self.node, self.node_name = node, node_name
        self.state_dir, self.cdi_dir = state_dir, cdi_dir
        self.claims = claims  # (namespace, name) -> the ResourceClaim as JSON
        self.mounts = mounts or []
        self.guard = threading.Lock()
        self.locks: dict[str, threading.Lock] = {}
        self.unit_refused: str | None = None  # why new claims are refused (the node's unit changed under claims)
        self.spec_unit: int | None = None  # the unit the prepared claims' specs were last written in
        self.on_unprepare = None
        self.mode = lambda: "cgpu"  # the node's mode in force (Modes.mode, once main sets it)
        os.makedirs(state_dir, exist_ok=True)

    def lock_of(self, uid: str) -> threading.Lock:
        with self.guard:
            return self.locks.setdefault(uid, threading.Lock())

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

    def _read_record(self, uid: str) -> dict | None:
        try:
            with open(self.record_path(uid)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:  # (a record cut short by a full disk): prepared anew
            log.warning("claim %s's record is unreadable (%s): preparing it anew", uid, exc)
            return None

    def spec_of(self, record: dict, unit: int) -> dict:
        """A prepared claim's CDI spec in `unit` (its bytes are kept, the environment is in units),
        or DraError when its bytes are not whole units of `unit`."""
        shares = [dra.Share.from_dict(s) for s in record["shares"]]
        for s in shares:
            for i, b in s.gpus:
                if b % unit:
                    raise dra.DraError(f"claim {record['namespace']}/{record['name']} holds {b} bytes of GPU {i}, "
                                       f"not a whole number of {unit}-byte units")
        if "gpus" in record:  # [index, uuid(, memory)]: the memory since modes (an mps client's share)
            gpus = [dra.Gpu(int(g[0]), str(g[1]), "", int(g[2]) if len(g) > 2 else 0) for g in record["gpus"]]
        else:  # (a record of an earlier version: the GPUs as the daemon has them)
            gpus = list(self.node.gpus or ())
        return dra.cdi_spec(record["uid"], shares, gpus, unit, self.mounts, record.get("mode", "cgpu"))

    def write_spec(self, record: dict) -> None:
        unit = self.node.unit if self.node.gpus is not None else int(record["unit"])
        try:
            spec = self.spec_of(record, unit)
        except dra.DraError:  # (the unit change is refused: the claim's spec stays in its own unit)
            spec = self.spec_of(record, int(record["unit"]))
        write_atomically(self.spec_path(record["uid"]), json.dumps(spec, indent=1).encode())

    def _remove(self, uid: str) -> None:
        for path in (self.spec_path(uid), self.record_path(uid)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    # ---- at start and when the node's unit changes -------------------------------------------

    def restore(self) -> int:
        """At start, before the kubelet can call: every prepared claim's CDI spec written again (a
        node's reboot empties /var/run/cdi, and the kubelet starts a claim's containers again with
        no new Prepare), and the records of claims that are gone collected. The claims that remain."""
        asking, kept = True, 0
        self.spec_unit = self.node.unit if self.node.gpus is not None else None
        for uid, record in self.prepared().items():
            with self.lock_of(uid):
                gone = False
                if asking:
                    try:
                        claim = self.claims(record["namespace"], record["name"])
                        gone = (claim.get("metadata") or {}).get("uid") != uid
                    except Exception as exc:  # noqa: BLE001 - gone, or the API server not answering
                        if getattr(exc, "status", None) == 404:
                            gone = True
                        else:
                            asking = False  # (keep every record: they were right when prepared)
                            log.warning("cannot read the prepared claims (%s): their CDI specs are written "
                                        "again all the same", one_line(exc))
                if gone:
                    self._remove(uid)
                    log.info("claim %s/%s (%s) is gone: its record collected", record["namespace"],
                             record["name"], uid)
                    continue
                try:
                    self.write_spec(record)
                    kept += 1
                except (OSError, KeyError, ValueError) as exc:
                    log.warning("cannot write claim %s's CDI spec again (%s)", uid, exc)
        return kept

    def accept_unit(self, unit: int) -> bool:
        """The node's unit is `unit` now: every prepared claim's spec in it (their bytes kept), and
        True; False (and new claims refused, saying why) while a claim's bytes are not whole units
        of it — its containers would start with other memory than the claim's."""
        records = self.prepared()
        odd = []
        for uid, record in records.items():
            try:
                self.spec_of(record, unit)
            except dra.DraError:
                odd.append(f"{record['namespace']}/{record['name']}")
            except (KeyError, ValueError):
                pass
        if odd:
            why = (f"the node's unit changed to {unit} bytes while claims holding other sizes are prepared "
                   f"({', '.join(odd[:3])}{'…' if len(odd) > 3 else ''}): delete their pods, or run cgpud in "
                   f"its earlier mode")
            if why != self.unit_refused:
                log.warning("%s; new claims are refused until then", why)
            self.unit_refused = why
            return False
        if self.unit_refused:
            log.info("the node's unit is %d bytes: claims are accepted again", unit)
        self.unit_refused = None
        if unit != self.spec_unit:
            for uid, record in records.items():
                with self.lock_of(uid):
                    if os.path.exists(self.record_path(uid)):
                        self.write_spec(record)
            self.spec_unit = unit
        return True

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

    def _claim(self, namespace: str, name: str, uid: str) -> dict:
        try:
            claim = self.claims(namespace, name)
        except Exception as exc:  # noqa: BLE001 - any trouble asking: one line for the pod's events
            raise dra.DraError(f"cannot read ResourceClaim {namespace}/{name}: {one_line(exc)}") from None
        if (claim.get("metadata") or {}).get("uid") != uid:
            raise dra.DraError(f"ResourceClaim {namespace}/{name} is not the claim {uid} (deleted and made again?)")
        return claim

    def prepare(self, namespace: str, name: str, uid: str) -> pb.NodePrepareResourceResponse:
        with self.lock_of(uid):
            record = self._read_record(uid)
            claim = None
            if record is not None:  # prepared before (the kubelet asks again after its restart, a reboot…)
                try:
                    claim = self.claims(namespace, name)
                except Exception as exc:  # noqa: BLE001
                    if getattr(exc, "status", None) == 404:
                        raise dra.DraError(f"cannot read ResourceClaim {namespace}/{name}: {one_line(exc)}") from None
                    log.warning("cannot read ResourceClaim %s/%s (%s): prepared as recorded", namespace, name,
                                one_line(exc))
                if claim is not None and ((claim.get("metadata") or {}).get("uid") != uid
                                          or allocation(claim) != record.get("allocation", allocation(claim))):
                    log.info("claim %s/%s (%s) was allocated anew since it was prepared: preparing it again",
                             namespace, name, uid)
                    record = None
            if record is None:
                record = self._prepare_new(namespace, name, uid, claim)
            else:
                self.write_spec(record)  # (a reboot emptied the CDI directory; the unit may have changed)
        devices = []
        for d in record["devices"]:
            devices.append(pb.Device(request_names=[d["request"]], pool_name=d["pool"], device_name=d["device"],
                                     cdi_device_ids=d["cdi"], **({"share_id": d["share"]} if d.get("share") else {})))
        return pb.NodePrepareResourceResponse(devices=devices)

    def _prepare_new(self, namespace: str, name: str, uid: str, claim: dict | None = None) -> dict:
        gpus, unit = self.node.gpus, self.node.unit
        if gpus is None:
            raise dra.DraError("cgpud does not answer on the node: start it (cgpud serve)")
        if self.unit_refused:
            raise dra.DraError(self.unit_refused)
        mode = self.mode()
        if mode == "disabled":
            raise dra.DraError(f"this node's mode is disabled ({modes.LABEL}): its GPUs are another driver's; the "
                               "claim was allocated before the node was disabled: delete its pod")
        if claim is None or (claim.get("metadata") or {}).get("uid") != uid:
            claim = self._claim(namespace, name, uid)
        shares = dra.plan(claim, self.node_name, gpus, unit)
        results = [r for r in claim["status"]["allocation"]["devices"]["results"] if r.get("driver") == dra.DRIVER]
        devices, given = [], set()
        for r in results:  # each request's CDI device once, on its first device (the kubelet passes each on)
            first = r["request"] not in given
            given.add(r["request"])
            devices.append({"request": r["request"], "pool": r["pool"], "device": r["device"],
                            "share": r.get("shareID"),
                            "cdi": [f"{dra.CDI_VENDOR_CLASS}={dra.cdi_device(uid, r['request'])}"] if first else []})
        used = {i for s in shares for i, _ in s.gpus}
        record = {"namespace": namespace, "name": name, "uid": uid, "unit": unit,
                  "shares": [s.as_dict() for s in shares], "devices": devices,
                  "gpus": [[g.index, g.uuid, g.memory] for g in gpus if g.index in used],
                  "allocation": allocation(claim), "mode": mode}
        spec = self.spec_of(record, unit)
        write_atomically(self.spec_path(uid), json.dumps(spec, indent=1).encode())
        write_atomically(self.record_path(uid), json.dumps(record).encode())
        log.info("prepared %s/%s (%s): %s", namespace, name, uid, "; ".join(
            f"{s.request}: " + ", ".join(f"GPU {i} {b} bytes" for i, b in s.gpus) for s in shares))
        return record

    def unprepare(self, uid: str) -> None:
        with self.lock_of(uid):
            self._remove(uid)
        with self.guard:
            self.locks.pop(uid, None)
        log.info("unprepared %s", uid)
        if self.on_unprepare is not None:  # (a unit change or a mode change may wait for this claim)
            self.on_unprepare()


def allocation(claim: dict) -> list:
    """What a claim was allocated of our driver, comparable: (request, pool, device, share ID,
    bytes consumed) of each result. A claim allocated anew under the same UID differs (a new
    share ID at least)."""
    results = ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or ())
    out = []
    for r in results:
        if r.get("driver") != dra.DRIVER:
            continue
        consumed = (r.get("consumedCapacity") or {}).get(dra.CAPACITY)
        try:
            consumed = dra.quantity(consumed) if consumed is not None else None
        except dra.DraError:
            pass
        out.append([r.get("request"), r.get("pool"), r.get("device"), r.get("shareID"), consumed])
    return sorted(out, key=json.dumps)


class Registration(regrpc.RegistrationServicer):
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.registered = threading.Event()

    def GetInfo(self, request, context):
        from cgpud.k8s import drahealth  # (KEP-4680: device health, docs/gpus.md Health)

        return regpb.PluginInfo(type="DRAPlugin", name=dra.DRIVER, endpoint=self.endpoint,
                                supported_versions=[SERVICE, *drahealth.SERVICES])

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

    health = drahealth.Health(driver.node, driver.node_name, stop)

    def add_plugin(s) -> None:
        rpc.add_DRAPluginServicer_to_server(driver, s)
        drahealth.add_to_server(health, s)  # (KEP-4680: the kubelet's health stream, v1 and v1alpha1)

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
         state_dir: str, refresh: float, mode: str | None = None) -> None:
    from cgpud.state.paths import default_socket

    node = Node(socket or default_socket())
    api = Api(node_name)
    served = draserved.Served()
    try:
        version = api.server_version()
        served = draserved.probe(api.client, node_name)  # (NotServed: the one line, and the plugin stops)
    except draserved.NotServed:
        raise
    except Exception as exc:  # noqa: BLE001 - not reachable yet: it serves its node all the same
        log.warning("cannot ask the API server what it serves (%s): going on as if all of DRA is on", one_line(exc))
    else:
        log.info("the API server is Kubernetes %s: it serves resource.k8s.io/v1, shared devices%s", version,
                 ", device taints" if served.taints else " (no device taints)")
    driver = Driver(node, node_name, state_dir, cdi_dir, api.claim,
                    mounts=[os.path.dirname(os.path.abspath(node.socket))])
    registration = Registration(os.path.join(plugin_dir, "dra.sock"))
    follower = Modes(node, driver, node_name, mode, api.core)
    driver.mode = lambda: follower.mode
    stop = threading.Event()
    pending = threading.Event()  # slices to write (the node changed, or the API server's differ)
    kick = threading.Event()  # (wakes the loop below at once)

    failing: list[str] = []  # the last failure said (said once until it works again)
    no_owner: list[int] = []  # (said once)

    def publish(gpus, unit) -> None:
        pending.clear()
        if not driver.accept_unit(unit):
            return  # (the slices stay in the old unit until the claims holding other sizes are gone)
        try:
            owner = None
            try:
                owner = api.node_owner()
            except Exception as exc:  # noqa: BLE001 - published all the same; the owner next time
                if not no_owner:
                    no_owner.append(1)
                    log.warning("cannot read Node %s (%s): its slices are published without an owner", node_name,
                                one_line(exc))
                pending.set()
            slices = dra.resource_slices(node_name, draserved.publishable(gpus, served), unit, owner=owner,
                                         mode=follower.mode)
            if api.publish(slices):
                log.info("published %d ResourceSlices of pool %s: %d GPUs in units of %d bytes, mode %s", len(slices),
                         node_name, len(gpus), unit, follower.mode)
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

    def unprepared() -> None:
        follower.reconsider()  # (a mode change may have waited for this claim)
        changed()

    api.on_change = changed
    follower.on_change = changed
    driver.on_unprepare = unprepared
    node.poll()  # (the node's unit, for the specs written again below)
    restored = driver.restore()  # before the kubelet can call (it starts a claim's containers with no Prepare)
    try:
        api.start_watch()
    except Exception as exc:  # noqa: BLE001 - its thread lists again; say it now
        log.warning("cannot list the ResourceSlices of %s yet (%s)", node_name, one_line(exc))
        threading.Thread(target=api.watch.run, daemon=True).start()
    node.on_change = publish
    try:
        follower.start_watch()  # (the node's label: its mode)
    except Exception as exc:  # noqa: BLE001 - its thread lists again
        log.warning("cannot watch node %s yet (%s): mode %s until it can be read", node_name, one_line(exc),
                    follower.mode)
    log.info("cgpu DRA plugin %s on node %s: %d claims prepared before", dra.DRIVER, node_name, restored)
    threading.Thread(target=follow, daemon=True).start()
    try:
        serve(driver, registry_dir, plugin_dir, stop, registration)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        time.sleep(0)
