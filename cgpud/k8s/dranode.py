"""The DRA plugin's node side (cgpud.k8s.draplugin): the node daemon's GPUs and unit, asked over the
control socket, and the node's mode (its label ack.node.gpu.schedule) that the slices follow."""
from __future__ import annotations

import logging
import threading

from cgpud.client import Client, ControlError, DaemonUnavailable
from cgpud.containers.placement import unit_for
from cgpud.k8s import dra, modes

log = logging.getLogger("cgpud.k8s")

REFRESH = 1.0  # s: how often the daemon is asked what GPUs it has


class Node:
    """The daemon's GPUs and unit, asked every `refresh` seconds; `gpus` None while it does not
    answer. `on_change(gpus, unit)` after each change."""

    def __init__(self, socket: str | None) -> None:
        self.socket = socket
        self.gpus: list[dra.Gpu] | None = None
        self.unit = 0
        self.mode: str | None = None  # the daemon's mode (it places and refuses containers by it)
        self.on_change = None

    def poll(self) -> None:
        try:
            with Client(self.socket, timeout=5) as c:
                snap = c.call("query")
            gpus, unit = dra.gpus_from_query(snap), unit_for(snap.get("mode", "exclusive"))
            self.mode = snap.get("mode")
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


class Modes:
    """The node's mode for the DRA driver (cgpud.k8s.modes, docs/kubernetes.md "A node's mode"): the
    node's label ack.node.gpu.schedule, read by a watch of its Node, decides what the slices publish;
    while claims are prepared on the node a label change waits (the node keeps the mode in force,
    says so in the CgpuModePending condition and an event, as the device plugin does) and takes
    effect when the last is unprepared. Without the label, the node keeps `flag` (--mode), else the
    daemon's own mode. The daemon is told the mode in force (it places containers and picks the
    node's unit by it); `on_change()` after a switch."""

    def __init__(self, node: Node, driver, node_name: str, flag: str | None = None, api=None) -> None:
        self.node, self.driver, self.node_name, self.flag = node, driver, node_name, flag
        self.api = api  # CoreV1Api, or None (no API server: the flag's or the daemon's mode)
        self.labels: dict[str, str] | None = None  # None until the Node is read
        self.annotated: str | None = None  # the mode in force as the Node's annotation says it
        self.decision: modes.Decision | None = None
        self._warned: str | None = None
        self.lock = threading.RLock()
        self.on_change = None
        self.watch = None

    @property
    def mode(self) -> str:
        """The mode in force: the decision's; before any, the flag's or the daemon's (cgpu)."""
        if self.decision is not None:
            return self.decision.mode
        return self.default()

    def default(self) -> str:
        return self.flag or (self.node.mode if self.node.mode in modes.MODES else None) or "cgpu"

    def holders(self) -> list[str]:
        return [f"{r.get('namespace')}/{r.get('name')}" for r in self.driver.prepared().values()]

    def node_seen(self, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        self.annotated = (meta.get("annotations") or {}).get(modes.MODE_IN_FORCE)
        labels = meta.get("labels") or {}
        if labels != self.labels:
            self.labels = labels
            self.reconsider()

    def reconsider(self) -> None:
        """The mode again (the label changed, or a claim was unprepared): switch when no claim is
        prepared, else keep the one in force and say why."""
        if self.labels is None:
            return
        with self.lock:
            want, warning = modes.wanted(self.labels, self.default())
            if warning and warning != self._warned:
                log.warning("%s", warning)
                if self.api is not None:
                    from cgpud.k8s.nodeapi import node_event

                    node_event(self.api, self.node_name, "GpuModeUnknown", warning, "cgpu-dra-plugin")
            self._warned = warning
            current = self.decision.mode if self.decision is not None else self.annotated
            decision = modes.decide(current, want, self.holders())
            if decision == self.decision:
                self.tell_daemon()
                return
            before = self.decision.mode if self.decision is not None else current
            self.decision = decision
            log.info("%s", decision.message())
            if self.api is not None:
                from cgpud.k8s.nodeapi import write_mode

                write_mode(self.api, self.node_name, self.labels, decision, before, "cgpu-dra-plugin")
            self.tell_daemon()
        if self.on_change is not None:
            self.on_change()

    def tell_daemon(self) -> None:
        """The daemon places (and refuses) the containers that start, and sizes the node's unit, by
        the mode in force (disabled: nothing of ours starts; the daemon keeps its mode)."""
        mode = self.mode
        if mode == "disabled" or self.node.mode in (None, mode):
            return
        try:
            with Client(self.node.socket, timeout=5) as c:
                c.call("mode", mode=mode)
            log.info("cgpud places containers in mode %s from now on", mode)
            self.node.poll()  # (its unit: 128 MiB in share, else 1 GiB)
        except (DaemonUnavailable, ControlError, OSError) as exc:
            log.warning("cannot tell cgpud the node's mode %s (%s); trying again", mode, exc)

    def start_watch(self) -> None:
        from cgpud.k8s.informer import Informer

        def replace(items: list[dict]) -> None:
            for obj in items:
                self.node_seen(obj)

        def event(kind: str, obj: dict) -> None:
            if kind != "DELETED":
                self.node_seen(obj)

        self.watch = Informer(f"node {self.node_name}", self.api.list_node, replace, event,
                              field_selector=f"metadata.name={self.node_name}")
        self.watch.start()
