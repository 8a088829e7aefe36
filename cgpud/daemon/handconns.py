"""A hot upgrade's client connections, from the old daemon to the new one (cgpud.daemon.upgrade).

The kernel passes at most 253 descriptors in one message (SCM_MAX_FD), and a SEQPACKET message is
bounded by the socket's send buffer: so the connections go after `go`, in batches of at most
BATCH_FDS descriptors and BATCH_BYTES of what each had sent but not yet had answered (its
`buf`). Before issue 44 they went in `go` itself, and a node with more than 251 open connections
(a tenant's flood) could not be upgraded at all: sendmsg failed with EINVAL and the old daemon
rolled back. A connection whose unanswered bytes pass MAX_BUF is not handed on (its client sees
the connection close, as at a restart; an honest client has at most a request or two in flight).
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict

log = logging.getLogger("cgpud")

BATCH_FDS = 200
BATCH_BYTES = 96 << 10  # (under the default socket send buffer, 208 KiB)
MAX_BUF = 32 << 10


def meta(a) -> dict:
    """What of an Adopted connection goes as JSON (the descriptor goes as SCM_RIGHTS)."""
    return {**{k: v for k, v in asdict(a).items() if k not in ("fd", "buf")}, "buf": a.buf.decode("latin-1")}


def batches(handed: list) -> tuple[list[tuple[list[dict], list[int]]], int]:
    """([(the connections' JSON, their descriptors)], how many were left out for MAX_BUF)."""
    out: list[tuple[list[dict], list[int]]] = []
    size, left_out = BATCH_BYTES, 0
    for a in handed:
        if len(a.buf) > MAX_BUF:
            left_out += 1
            continue
        m = meta(a)
        n = len(json.dumps(m))
        if not out or len(out[-1][1]) >= BATCH_FDS or size + n > BATCH_BYTES:
            out.append(([], []))
            size = 0
        out[-1][0].append(m)
        out[-1][1].append(a.fd)
        size += n
    if left_out:
        log.warning("hot upgrade: %d connections with more than %d bytes unanswered are not handed on (closed)",
                    left_out, MAX_BUF)
    return out, left_out
