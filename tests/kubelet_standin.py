"""A kubelet stand-in for the device plugin tests, written from the kubelet's
api.proto (cgpud/k8s/proto): no kubelet runs offline.

Like the kubelet's device manager it serves `Registration` on
`<plugin dir>/kubelet.sock`; on Register it dials the plugin's endpoint back,
asks its options, follows `ListAndWatch` in a thread (keeping the latest
list), and offers `preferred()` then `allocate()` as the device manager calls
them for each container. `restart()` removes and re-creates its socket, as a
restarted kubelet does, which must bring a new registration.

`registrations`, `devices`, `preferred()` and `allocate()` are those of
`aliyun.com/gpu-mem`; the plugin's other resources (the node's modes:
nvidia.com/gpu, aliyun.com/gpu-core.percentage) are followed the same way in
`others[resource]` (an `Endpoint`: `devices`, `wait_devices()`, `allocate()`).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc

from cgpud.k8s.proto import api_pb2 as pb
from cgpud.k8s.proto import api_pb2_grpc as rpc


PRIMARY = "aliyun.com/gpu-mem"


class Endpoint:
    """Another resource's plugin, dialled back and followed as the device manager does."""

    def __init__(self, sock: str) -> None:
        self.channel = grpc.insecure_channel(f"unix://{sock}")
        self.plugin = rpc.DevicePluginStub(self.channel)
        self.devices: dict[str, str] = {}
        self.changed = threading.Condition()
        stream = self.plugin.ListAndWatch(pb.Empty())
        threading.Thread(target=self._watch, args=(stream,), daemon=True).start()

    def _watch(self, stream) -> None:
        try:
            for resp in stream:
                with self.changed:
                    self.devices = {d.ID: d.health for d in resp.devices}
                    self.changed.notify_all()
        except grpc.RpcError:
            pass

    def wait_devices(self, pred, timeout: float = 10) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not pred(self.devices):
                left = deadline - time.monotonic()
                assert left > 0, f"timed out waiting for the device list; last: {self.devices}"
                self.changed.wait(left)
            return dict(self.devices)

    def allocate(self, *containers: list[str]) -> list[dict[str, str]]:
        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers])
        return [dict(r.envs) for r in self.plugin.Allocate(req, timeout=5).container_responses]


class Kubelet(rpc.RegistrationServicer):
    def __init__(self, plugin_dir: str) -> None:
        self.dir = plugin_dir
        self.sock = os.path.join(plugin_dir, "kubelet.sock")
        self.registrations: list[tuple[float, pb.RegisterRequest]] = []
        self.others: dict[str, Endpoint] = {}
        self.devices: dict[str, str] = {}  # ID -> health, from the last ListAndWatch response
        self.lists = 0
        self.changed = threading.Condition()
        self.server = None
        self.channel = None
        self.start()

    # ---- Registration -----------------------------------------------------------

    def Register(self, request, context):
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version}")
        at = time.monotonic()
        if request.resource_name != PRIMARY:
            old = self.others.pop(request.resource_name, None)
            if old is not None:
                old.channel.close()
            self.others[request.resource_name] = Endpoint(os.path.join(self.dir, request.endpoint))
            return pb.Empty()
        self._dial(request)
        self.registrations.append((at, request))
        return pb.Empty()

    def _dial(self, request) -> None:
        if self.channel is not None:
            self.channel.close()
        self.channel = grpc.insecure_channel(f"unix://{os.path.join(self.dir, request.endpoint)}")
        self.plugin = rpc.DevicePluginStub(self.channel)
        self.options = self.plugin.GetDevicePluginOptions(pb.Empty(), timeout=5)
        stream = self.plugin.ListAndWatch(pb.Empty())
        threading.Thread(target=self._watch, args=(stream,), daemon=True).start()

    def _watch(self, stream) -> None:
        try:
            for resp in stream:
                with self.changed:
                    self.devices = {d.ID: d.health for d in resp.devices}
                    self.lists += 1
                    self.changed.notify_all()
        except grpc.RpcError:
            pass  # the plugin went away (or we closed the channel)

    # ---- what the device manager does ----------------------------------------------

    def wait_devices(self, pred, timeout: float = 10) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not pred(self.devices):
                left = deadline - time.monotonic()
                assert left > 0, f"timed out waiting for the device list; last: {self.devices}"
                self.changed.wait(left)
            return dict(self.devices)

    def preferred(self, available: list[str], size: int, must: list[str] = ()) -> list[str]:
        req = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=list(must), allocation_size=size)])
        return list(self.plugin.GetPreferredAllocation(req, timeout=5).container_responses[0].deviceIDs)

    def allocate(self, *containers: list[str]) -> list[dict[str, str]]:
        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers])
        resp = self.plugin.Allocate(req, timeout=5).container_responses
        self.mounts = [[(m.host_path, m.container_path, m.read_only) for m in r.mounts] for r in resp]
        self.annotations = [dict(r.annotations) for r in resp]  # (the container's, as the kubelet passes them on)
        return [dict(r.envs) for r in resp]

    # ---- life ------------------------------------------------------------------------

    def start(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        rpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.sock}")
        self.server.start()

    def restart(self) -> float:
        """Stop, clear the socket, start again (as the kubelet does); the monotonic time it was back."""
        self.stop()
        try:
            os.unlink(self.sock)
        except FileNotFoundError:
            pass
        self.start()
        return time.monotonic()

    def stop(self) -> None:
        for other in list(self.others.values()):  # (a plugin's Register, in a server thread, may add one now)
            other.channel.close()
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.server is not None:
            self.server.stop(grace=0).wait()
            self.server = None


@contextlib.contextmanager
def plugin_node(daemon, tmp, node: str, labels: dict | None = None):
    """`cgpu device-plugin` of `daemon` for `node` (with `labels`; it looks at the node every 0.2 s)
    against the API server stand-in (tests/apiserver_standin.py) and this kubelet stand-in, all in
    directory `tmp` (its log plugin.log): (api, kubelet, the plugin's process); all stopped after."""
    from apiserver_standin import ApiServer

    api = ApiServer(tmp, history=50, bookmark_every=0.2)
    api.add_node(node, labels=labels)
    plugin_dir = os.path.join(tmp, "device-plugins")
    os.mkdir(plugin_dir)
    kubelet = Kubelet(plugin_dir)
    cgpu = os.path.join(os.path.dirname(sys.executable), "cgpu")
    with open(os.path.join(tmp, "plugin.log"), "wb") as log:
        proc = subprocess.Popen([cgpu, "--socket", os.fspath(daemon.socket), "device-plugin", "--plugin-dir", plugin_dir,
                                 "--node-refresh", "0.2"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, KUBECONFIG=os.fspath(api.kubeconfig), NODE_NAME=node))
        try:
            yield api, kubelet, proc
        finally:
            proc.terminate()
            proc.wait(10)
            kubelet.stop()
            api.close()
