"""Paths of a host whose root is mounted somewhere else (a container's /host,
an install's DESTDIR): its symbolic links followed as the host would follow
them, an absolute target taken below that root."""
from __future__ import annotations

import os


def resolve(root: str, path: str, hops: int = 16) -> str | None:
    """The file the host's `path` names, below `root`; None when there is none (or the links loop)."""
    where = os.path.join(root, path.lstrip("/"))
    for _ in range(hops):
        if not os.path.islink(where):
            return where if os.path.isfile(where) else None
        target = os.readlink(where)
        where = os.path.join(root, target.lstrip("/")) if target.startswith("/") else \
            os.path.join(os.path.dirname(where), target)
    return None
