"""`cgpu node keep`: the DaemonSet's container that takes `cgpu node install` off the node when
the DaemonSet itself goes (`helm uninstall`, `kubectl delete -k`), and only then
(docs/kubernetes.md, "Helm": the node as it was).

The init container installs (the runtime's settings, the hook, the programs); nothing in a pod
runs when a DaemonSet is deleted but its pods' ends. So this container watches its own
DaemonSet (one object, by name, from its start: the watch stays open while `helm uninstall`
deletes the rights it was opened with) and waits for SIGTERM. At SIGTERM it decides:

- the DaemonSet was deleted (the watch saw DELETED, or a deletionTimestamp): the pod ends
  because the DaemonSet does: `cgpu node uninstall` — the node's files as before the install,
  containerd given back its settings and restarted (new containers start with runc) — but for
  cgpu-runtime and its runtime.conf (RUNTIME_KEPT): every container started while it was
  containerd's runtime, this pod's too, has a shim that calls it to be killed and deleted; a node
  without it cannot stop those pods. They stay, in the install's record, for a later
  `cgpu node uninstall` once those containers are gone;
- the DaemonSet is there (a pod deleted to restart it or to take a new image, a node drained,
  the kubelet stopping): the node stays installed (the next pod's init container finds it so);
- nothing known (no API server, the watch never worked): the node stays installed — never
  uninstall on a doubt (GPU pods of the node would lose their runtime).

The kubelet sends SIGTERM only after the garbage collector acted on the DaemonSet's deletion,
which the watch has usually brought by then; if not yet, it waits up to SETTLE seconds for it.
`helm upgrade` (a new image) changes the DaemonSet's template only: its updateStrategy OnDelete
leaves every pod, this one too, running (a hot upgrade restarts no container).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

log = logging.getLogger("cgpud.k8s")
SETTLE = 5.0  # s: at SIGTERM, how long a healthy watch may still bring the DaemonSet's deletion


@dataclass
class Seen:
    """What the watch of the DaemonSet has told (the model: pure)."""

    present: bool | None = None  # None: never read
    deleting: bool = False  # deleted, or being deleted (deletionTimestamp)

    def listed(self, items: list[dict]) -> None:
        self.present = bool(items)
        self.deleting = not items or any((i.get("metadata") or {}).get("deletionTimestamp") for i in items)

    def event(self, kind: str, obj: dict) -> None:
        if kind == "DELETED":
            self.present, self.deleting = False, True
        else:
            self.present = True
            self.deleting = bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def decide(seen: Seen) -> tuple[bool, str]:
    """(uninstall?, why): only a DaemonSet seen going takes the node's parts off."""
    if seen.present is None:
        return False, "the DaemonSet could never be read: the node stays installed (never undone on a doubt)"
    if seen.deleting:
        return True, "the DaemonSet was deleted: undoing cgpu node install"
    return False, "the DaemonSet is still there (a pod restart, an upgrade or a drain): the node stays installed"


class Keeper:
    def __init__(self, namespace: str, name: str) -> None:
        self.namespace, self.name = namespace, name
        self.seen = Seen()
        self.changed = threading.Condition()
        self.informer = None

    def _replace(self, items: list[dict]) -> None:
        with self.changed:
            self.seen.listed(items)
            self.changed.notify_all()

    def _event(self, kind: str, obj: dict) -> None:
        with self.changed:
            self.seen.event(kind, obj)
            self.changed.notify_all()

    def start(self) -> None:
        from kubernetes import client

        from cgpud.k8s.api import NoCluster, connect
        from cgpud.k8s.informer import Informer

        try:
            _, api_client = connect("cgpu-node-keeper")
        except NoCluster as exc:
            log.warning("%s: the node stays installed when this pod ends", exc)
            return
        apps = client.AppsV1Api(api_client)

        def list_fn(**kw):
            return apps.list_namespaced_daemon_set(self.namespace, **kw)

        self.informer = Informer(f"DaemonSet {self.namespace}/{self.name}", list_fn, self._replace, self._event,
                                 field_selector=f"metadata.name={self.name}")
        self.informer.start()

    def at_end(self, settle: float = SETTLE) -> tuple[bool, str]:
        """At SIGTERM: the decision, after waiting up to `settle` for the watch to bring a deletion
        while it says the DaemonSet is there."""
        with self.changed:
            self.changed.wait_for(lambda: self.seen.deleting or self.seen.present is None, timeout=settle)
            return decide(self.seen)


def main(host_root: str, namespace: str, name: str, restart: str) -> int:
    import signal

    from cgpud.containers.nodeinstall import RUNTIME_KEPT, InstallError, uninstall

    keeper = Keeper(namespace, name)
    keeper.start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    log.info("keeping the node's install while DaemonSet %s/%s is there", namespace, name)
    while not done.wait(3600):
        pass
    undo, why = keeper.at_end()
    log.info("%s", why)
    if not undo:
        return 0
    try:
        report = uninstall(host_root, restart, keep=RUNTIME_KEPT)
    except InstallError as exc:
        log.warning("cannot undo the install (%s)", exc)
        return 1
    for p in report.removed:
        log.info("removed %s", p)
    for engine, what in report.engines.items():
        log.info("%s: %s%s", engine, what, ", restarted" if engine in report.restarted else "")
    for step in report.todo:
        log.warning("to do: %s", step)
    return 0
