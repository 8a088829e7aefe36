"""The DRA plugin's API server side (cgpud.k8s.draplugin): claims read, the node's ResourceSlices
watched and written, through the official client."""
from __future__ import annotations

import json
import logging
import threading

from cgpud.k8s import dra
from cgpud.k8s.api import done

log = logging.getLogger("cgpud.k8s")

API_TIMEOUT = 10.0  # s: the longest one call to the API server may take


class Api:
    """The API server through the official client: claims read; the node's slices watched (so a
    slice someone deleted — the kubelet deletes its node's slices when it starts — is written
    again at once, and nothing is read to find out) and written when they differ. Every call has a
    timeout (API_TIMEOUT): a hung API server delays one claim, never the node's plugin."""

    def __init__(self, node: str) -> None:
        from kubernetes import client

        from cgpud.k8s.api import connect

        self.core, api_client = connect("cgpu-dra-plugin")
        self.client = api_client
        self.resource = client.ResourceV1Api(api_client)
        self.versions = client.VersionApi(api_client)
        self.node = node
        self.have: dict[str, dict] = {}  # our slices as the API server has them, by name
        # what the API server made of a slice we wrote, by name: (what we sent, what it stored),
        # both canonical; where it dropped or changed a field, writing again would change nothing
        self.stored_as: dict[str, tuple[dict, dict]] = {}
        self.said_dropped: set[str] = set()
        self.lock = threading.Lock()
        self.on_change = None  # called when the watch brings a change to our slices
        self.watch = None
        self.owner: dict | None = None

    def server_version(self) -> str:
        r = self.versions.get_code(_preload_content=False, _request_timeout=API_TIMEOUT)
        return str(json.loads(r.data).get("gitVersion", ""))

    def claim(self, namespace: str, name: str) -> dict:
        r = self.resource.read_namespaced_resource_claim(name, namespace, _preload_content=False,
                                                         _request_timeout=API_TIMEOUT)
        return json.loads(r.data)

    def node_owner(self) -> dict | None:
        """The owner reference to our Node (read once; None while it cannot be read)."""
        if self.owner is None:
            r = self.core.read_node(self.node, _preload_content=False, _request_timeout=API_TIMEOUT)
            self.owner = dra.node_owner(self.node, json.loads(r.data)["metadata"]["uid"])
        return self.owner

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

    def same(self, have: dict, want: dict) -> bool:
        """The API server's slice says what we would write (semantically: quantities by value,
        fields it drops or rewrites as it did the last time we wrote this)."""
        h, w = dra.slice_content(have), dra.slice_content(want)
        return h == w or self.stored_as.get(want["metadata"]["name"]) == (w, h)

    def publish(self, slices: list[dict]) -> bool:
        """Make the API server's slices of this node what `slices` say, as upstream's slice
        controller does: nothing when they say it already; one slice changed in place at the pool's
        generation when that suffices; else all at the next generation (kube-scheduler reads a
        pool's slices of its highest generation only), then the slices no longer wanted deleted.
        True when it wrote."""
        with self.lock:
            have = dict(self.have)
        want = {b["metadata"]["name"]: b for b in slices}

        def generation(obj: dict) -> int:
            return int((obj.get("spec") or {}).get("pool", {}).get("generation", 0))

        top = max((generation(o) for o in have.values()), default=0)
        differ = [n for n, b in want.items() if n not in have or not self.same(have[n], b)]
        obsolete = [n for n in have if n not in want]
        whole = all(n in have and generation(have[n]) == top for n in want)  # (a write cut short earlier: not)
        if not differ and not obsolete and whole:
            return False
        if whole and not obsolete and len(differ) == 1:
            gen, names = top, differ  # one update: the pool is never seen half old, half new
        else:
            gen, names = top + 1, list(want)
        for name in names:
            body = json.loads(json.dumps(want[name]))
            body["spec"]["pool"]["generation"] = gen
            old = have.get(name)
            if old is None:
                r = self.resource.create_resource_slice(body, _preload_content=False, _request_timeout=API_TIMEOUT)
            else:
                body["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
                r = self.resource.replace_resource_slice(name, body, _preload_content=False,
                                                         _request_timeout=API_TIMEOUT)
            written = json.loads(r.data)
            sent, stored = dra.slice_content(body), dra.slice_content(written)
            if sent != stored:
                self.stored_as[name] = (sent, stored)
                if name not in self.said_dropped:
                    self.said_dropped.add(name)
                    log.warning("the API server stored ResourceSlice %s otherwise than written (first at %s): "
                                "a feature gate of the server off? (docs/kubernetes.md, DRA versions); not "
                                "written again for that", name, dra.first_difference(sent, stored))
            else:
                self.stored_as.pop(name, None)
            with self.lock:  # (its watch event may come later: a look before it must not write again)
                self.have[name] = written
        for name in obsolete:
            try:
                done(self.resource.delete_resource_slice(name, _preload_content=False, _request_timeout=API_TIMEOUT))
            except Exception as exc:  # noqa: BLE001 - gone already is what we want
                if getattr(exc, "status", None) != 404:
                    raise
            with self.lock:
                self.have.pop(name, None)
            self.stored_as.pop(name, None)
        return True
