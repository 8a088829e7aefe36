"""Changes that are on disk before they are acknowledged.

`Durable.apply(change)` runs `change(node)`; if the node's state moved, it is
saved before `apply` returns. If the save fails (a full disk, say), the node is
put back as it was and the OSError goes up: a refused write changes nothing.
"""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

from cgpud.core.model import Node
from cgpud.state.store import Store

log = logging.getLogger("cgpud")
T = TypeVar("T")


class Durable:
    def __init__(self, node: Node, store: Store) -> None:
        self.node = node
        self.store = store
        # Told after every change that landed (the scheduler attaches targets).
        self.listeners: list[Callable[[], None]] = []

    def apply(self, change: Callable[[Node], T]) -> T:
        """Run `change`; all of it lands, on disk, or none of it does."""
        before = self.node.to_state()
        held = {(i.gpu, i.name): dict(i.procs) for i in self.node.instances()}
        try:
            result = change(self.node)
            after = self.node.to_state()
            if after != before:
                self.store.save(after)
        except Exception as exc:
            if self.node.to_state() != before:  # a change of several steps failed midway, or the save did
                self.node.load_state(before)
                for inst in self.node.instances():  # memory held by live processes is not in the state
                    inst.procs = held.get((inst.gpu, inst.name), {})
            if isinstance(exc, OSError):
                log.error("could not save state to %s (%s); the change was refused", self.store.path, exc.strerror)
            raise
        for listener in self.listeners:
            try:
                listener()
            except Exception:  # noqa: BLE001 - the change landed; a listener's trouble is its own
                log.exception("after a change: %r failed", listener)
        return result
