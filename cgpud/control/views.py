"""Read-only ops: who the daemon is, what the node holds, how the
schedulers did (docs/control.md: hello, query, stats, trace). Open to the
host; a container's `hello`, `query` and `stats` answer about its own
instance only (control.server's `admit` says which: `asking`)."""
from __future__ import annotations

import errno
import os
import time

from cgpud import __version__
from cgpud.control.protocol import Peer, Refused, Streamed, arg, gpu_arg
from cgpud.core.model import Node, quoted


def own_snapshot(node: Node, name: str) -> dict:
    """What a container may see: its own instance on each GPU it has a share
    of, and of those GPUs what the card is — no other tenant, no sum of theirs."""
    return {
        "version": __version__,
        "gpus": [
            {
                "index": g.index, "uuid": g.info.uuid, "name": g.info.name, "memory": g.info.memory,
                "policy": g.policy,
                "instances": [{**i.settings(), "used": i.used, "procs": {str(p): n for p, n in sorted(i.procs.items())}}
                              for i in g.instances.values() if i.name == name],
            }
            for g in node.gpus if name in g.instances
        ],
    }


def snapshot(node: Node) -> dict:
    """Everything a client may want to see, as plain data."""
    return {
        "version": __version__,
        "default_memsize": node.default_memsize,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.info.uuid,
                "name": g.info.name,
                "memory": g.info.memory,
                "policy": g.policy,
                "max_inst": g.max_inst,
                "prio_ratio": g.prio_ratio,
                "free_weight": g.free_weight,
                "health": g.health or {"healthy": True},
                "instances": [
                    {**i.settings(), "used": i.used, "procs": {str(p): n for p, n in sorted(i.procs.items())}}
                    for i in g.instances.values()
                ],
            }
            for g in node.gpus
        ],
    }


class Views:
    """hello, query, stats, trace: a family of Control's ops (control.server)."""

    OPS = {"hello": False, "query": False, "stats": False, "trace": False, "mode": True}
    # op -> method where the op's name is an attribute too (self.mode is the node's mode: an op
    # looked up by its name got the string, and every `mode` call failed with an internal error)
    METHODS = {"mode": "set_mode"}

    asking: str | None  # (Control's)

    def hello(self, req: dict, peer: Peer) -> dict:
        if peer.who.container and self.asking is not None:
            return {"version": __version__, "privileged": False, "caller": "container", "instance": self.asking,
                    "compute": "gate" if self.gate else "freeze"}
        return {
            "version": __version__,
            "pid": os.getpid(),
            "gpus": len(self.node.gpus),
            "devices": self.devices,
            "privileged": self.privileged(peer),
            "caller": "container" if peer.who.container else "host",
            # the in-container library it puts into containers (docs/isolation.md), and whether it is there
            "library": self.library,
            "library_present": bool(self.library and os.path.isfile(self.library)),
            "compute": "gate" if self.gate else "freeze",
            "hook": self.hook_path,  # the OCI hook cgpu-runtime puts into the containers it prepares
        }

    def query(self, req: dict, peer: Peer) -> dict:
        if peer.who.container and self.asking is not None:
            return own_snapshot(self.node, self.asking)
        return {**snapshot(self.node), "strategy": self.strategy, "mode": self.mode}

    def set_mode(self, req: dict, peer: Peer) -> dict:
        """Set the node's mode for the containers that start from now on (the device plugin follows
        the node's ack.node.gpu.schedule label: docs/kubernetes.md); running ones keep theirs."""
        from cgpud.containers.placement import MODES

        mode = arg(req, "mode", str)
        if mode not in MODES:
            raise Refused(errno.EINVAL, f"mode {quoted(mode)} is not one of {', '.join(MODES)}")
        before, self.mode = self.mode, mode
        return {"mode": mode, "was": before}

    def stats(self, req: dict, peer: Peer) -> list[dict]:
        """The scheduler's telemetry per GPU (empty when it does not run); to a
        container, of its own instance alone (no node-wide counts: they would
        tell its neighbours' activity)."""
        out = self._stats() if self._stats else []
        if not (peer.who.container and self.asking is not None):
            return out
        mine = self.asking
        return [{"gpu": st["gpu"], "uptime": st["uptime"], "frozen": [n for n in st["frozen"] if n == mine],
                 "instances": {n: i for n, i in st["instances"].items() if n == mine}}
                for st in out if mine in st["instances"]]

    def trace(self, req: dict, peer: Peer) -> dict:
        """The slices of the last `seconds` (default 10, at most the ring's
        60 s), of every GPU or of `gpu`: who had each GPU when (cgpu trace)."""
        from cgpud.observe.trace import encode
        from cgpud.sched.telemetry import HISTORY_SECONDS as HORIZON

        seconds = arg(req, "seconds", (int, float), 10.0)
        if not 0 < seconds <= HORIZON:
            raise Refused(errno.EINVAL, f"seconds must be more than 0 and at most {HORIZON:g} "
                                        f"(the daemon keeps the last {HORIZON:g} s of slices), not {seconds}")
        gpu = gpu_arg(req)
        if gpu is not None and gpu >= len(self.node.gpus):
            raise Refused(errno.EINVAL, f"no GPU {gpu} on this node (it has {len(self.node.gpus)})")
        if self.tracer is None:
            raise Refused(errno.EOPNOTSUPP, "this daemon runs no scheduler: there are no slices to show")
        return Streamed(encode(self.tracer(float(seconds), gpu), seconds, time.time()))
