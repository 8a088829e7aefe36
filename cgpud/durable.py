"""Changes that are on disk before they are acknowledged.

`Durable.apply(change)` runs `change(node)`; if the node's state moved, it is
saved before `apply` returns. If the save fails (a full disk, say), the node is
put back as it was and the OSError goes up: a refused write changes nothing.
"""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

from .model import Node
from .store import Store

log = logging.getLogger("cgpud")
T = TypeVar("T")


class Durable:
    def __init__(self, node: Node, store: Store) -> None:
        self.node = node
        self.store = store

    def apply(self, change: Callable[[Node], T]) -> T:
        before = self.node.to_state()
        result = change(self.node)
        after = self.node.to_state()
        if after != before:
            try:
                self.store.save(after)
            except OSError as exc:
                self.node.load_state(before)
                log.error("could not save state to %s (%s); the change was refused", self.store.path, exc.strerror)
                raise
        return result
