"""Instances over the socket (docs/control.md): register and deregister,
the cgroups the daemon makes for `cgpu run`, and the reaper that removes what
a dead `cgpu run` or a container removed without its poststop left behind.
Privileged: root or the admin group."""
from __future__ import annotations

import errno
import logging
import os

import trio

from cgpud.containers.cgroups import CgroupError
from cgpud.control.protocol import Peer, Refused, arg
from cgpud.containers.envspec import CORE_SLOTS, CORE_STEP
from cgpud.core.model import Busy, ModelError, NoSpace, Node, check_name
from cgpud.gpus import pages
from cgpud.sched.enforce import EnforceError, freezer_from_spec

log = logging.getLogger("cgpud")


class Instances:
    """register, deregister: a family of Control's ops (control.server)."""

    OPS = {"register": True, "deregister": True}

    def register(self, req: dict, peer: Peer, *, gate: str | None = None) -> dict:
        """Create the instances of one container: `name` on each of `gpus`.

        memsize: bytes, one for every GPU or a list GPU by GPU, promised (it
        must fit in what the GPU has not promised to others); None or absent
        = default_memsize, promising nothing. All are created, or none.
        isolate (with cgroup, `cgpu run`): when the daemon has libcgpu, the
        instance gets pages of its own and the reply says how to load it
        (`isolation`: library, pages, env).
        gate (the container hook only, never from a client): the pages whose
        gate holds the instance to its share instead of its cgroup's freezer.
        """
        name = check_name(arg(req, "name", str))
        gpus = arg(req, "gpus", list)
        if not gpus or not all(isinstance(g, int) and not isinstance(g, bool) for g in gpus) or len(set(gpus)) != len(gpus):
            raise Refused(errno.EINVAL, "gpus must be a non-empty list of distinct GPU indices")
        for g in gpus:
            if not 0 <= g < len(self.node.gpus):
                raise Refused(errno.EINVAL, f"no GPU {g} on this node (it has {len(self.node.gpus)})")
        mem = arg(req, "memsize", (int, list), None, allow_none=True)
        mems = mem if isinstance(mem, list) else [mem] * len(gpus)
        if len(mems) != len(gpus) or not all(m is None or (isinstance(m, int) and not isinstance(m, bool)) for m in mems):
            raise Refused(errno.EINVAL, "memsize must be bytes, or a list of bytes per GPU")
        weight = arg(req, "weight", int, 1)
        highprio = arg(req, "highprio", bool, False)
        want_group = arg(req, "cgroup", bool, False)
        policy = arg(req, "policy", int, None, allow_none=True)
        # core_mem (docs/scheduler.md): the weight is a fixed share of CORE_SLOTS slots (policy 3),
        # refused (not lowered to the free weight) when the GPU's compute has not that much left
        core = arg(req, "core", bool, False)
        if core and (policy != 3 or not 1 <= weight <= CORE_SLOTS):
            raise Refused(errno.EINVAL, f"core needs policy 3 and a weight 1..{CORE_SLOTS} (percentage / 5)")
        given = arg(req, "target", dict, None, allow_none=True)
        isolate = arg(req, "isolate", bool, False)
        library = self.library if isolate and self.library and os.path.isfile(self.library) else None
        if library and not want_group:
            raise Refused(errno.EINVAL, "isolate is for instances in a cgroup the daemon makes (cgroup: true)")
        target = None
        if given is not None:
            if want_group:
                raise Refused(errno.EINVAL, "give cgroup: true or a target, not both")
            target = self._check_target(given)
        if want_group:
            if self.groups is None:
                raise Refused(errno.EOPNOTSUPP, "this daemon runs without cgroups; cgpu run cannot place processes")
            if self.node.instances_named(name):
                raise Refused(errno.EEXIST, f"{name} is already registered")
            try:
                target = {"kind": self.groups.kind, "path": self.groups.create(name)}
            except (CgroupError, OSError) as exc:
                raise Refused(errno.EBUSY, f"cannot make a cgroup for {name}: {exc}") from None
        where = gate  # the instance's pages (the hook's, or made here for cgpu run)
        if library:
            where = os.path.join(self.pages_dir, name)
            try:
                pages.prepare(where)  # (filled with the memsizes once they are known, below)
            except OSError as exc:
                self.groups.remove(target["path"])
                raise Refused(errno.EIO, f"cannot make the isolation pages of {name} in {where}: "
                              f"{exc.strerror}") from None
        if where is not None and target is not None and self.gate:
            target = {**target, "gate": where, "gpus": list(gpus)}  # (the page's GPUs, in its order)

        def create(n: Node):
            for g in gpus if core else ():
                gpu = n.gpu(g)
                if gpu.max_inst != CORE_SLOTS or gpu.policy != 3:
                    if gpu.instances:
                        raise Busy(f"GPU {g} holds containers without a compute percentage (policy {gpu.policy}): "
                                   "percentage and memory-only containers never share a GPU")
                    n.set_max_inst(g, CORE_SLOTS)
                if gpu.free_weight < weight:
                    raise NoSpace(f"GPU {g} has {gpu.free_weight * CORE_STEP} % of its compute left; this "
                                  f"container asks {weight * CORE_STEP} %")
            # A memsize asked for is promised (admission keeps it: SPEC §3); none asked: default_memsize, no promise
            made = [n.create_instance(g, name, memsize=m, weight=weight, highprio=highprio, promise=m is not None)
                    for g, m in zip(gpus, mems)]
            if target is not None:
                n.attach(name, target)
            if policy is not None:
                for g in gpus:
                    n.set_policy(g, policy)
            return made

        def undo() -> None:
            if want_group and target is not None:
                self.groups.remove(target["path"])
            if library:
                pages.remove(where)

        try:
            made = self.durable.apply(create)
        except BaseException:
            undo()
            raise
        if library:
            try:
                self._fill_pages(where, [(i.gpu, i.memsize) for i in made])
            except (OSError, ValueError) as exc:
                self.durable.apply(lambda n: n.destroy(name))
                undo()
                raise Refused(errno.EIO, f"cannot write the isolation pages of {name} in {where}: {exc}") from None
        if target is not None:
            self.owners[name] = peer.conn
        log.info("registered %s on GPU %s (pid %d)", name, ",".join(map(str, gpus)), peer.pid)
        return {
            "name": name,
            "instances": [{"gpu": i.gpu, "id": i.id, "memsize": i.memsize, "weight": i.weight} for i in made],
            "target": target,
            **({"env": self.client_env(name)} if self.client_env is not None else {}),
            **({"isolation": {"library": library, "pages": where,
                              "env": {"LD_PRELOAD": library, "CGPU_PAGE_DIR": where}}} if library else {}),
        }

    @staticmethod
    def _check_target(given: dict) -> dict:
        """A target a client names (the container hook: the container's own
        cgroup): a group of a mounted cgroup2 or v1 freezer hierarchy, never
        its root, never one that holds the daemon or a process it protects
        (the same checks as the scheduler's). `container` (optional) is kept
        with it: the container ID that owns the instance."""
        kind, path, container = given.get("kind"), given.get("path"), given.get("container")
        if kind not in ("cgroup2", "cgroup1-freezer") or not isinstance(path, str) or not path.startswith("/"):
            raise Refused(errno.EINVAL, 'a target is {"kind": "cgroup2" or "cgroup1-freezer", "path": "/abs/dir"}')
        if container is not None and (not isinstance(container, str) or not container or len(container) > 1024):
            raise Refused(errno.EINVAL, "a target's container is a non-empty string")
        if set(given) - {"kind", "path", "container"}:
            raise Refused(errno.EINVAL, f"unknown target keys: {', '.join(sorted(set(given) - {'kind', 'path', 'container'}))}")
        try:
            freezer_from_spec({"kind": kind, "path": path}).close()
        except EnforceError as exc:
            raise Refused(errno.EPERM, f"target {path}: {exc}") from None
        return {k: v for k, v in (("kind", kind), ("path", os.path.realpath(path)), ("container", container))
                if v is not None}

    def deregister(self, req: dict, peer: Peer) -> dict:
        name = check_name(arg(req, "name", str))
        container = arg(req, "container", str, None, allow_none=True)
        if container is not None:
            # Only the instances this container registered (a poststop hook of
            # a container whose start failed must not remove another's).
            mine = self.node.instances_named(name)
            if not mine or (mine[0].target or {}).get("container") != container:
                raise Refused(errno.ENOENT, f"no instance {name} of container {container}")
        gone = self.durable.apply(lambda n: n.destroy(name))
        self._drop_group(name, gone[0].target)
        self._drop_pages(name)
        log.info("deregistered %s (pid %d)", name, peer.pid)
        return {"name": name, "gpus": [i.gpu for i in gone]}

    def _orphaned_groups(self) -> None:
        """After any change (inst_ctl on the tree included): a cgroup we made
        whose instance is gone waits for its processes to go, then is removed."""
        if self.groups is None:
            return
        base = self.groups.base + os.sep
        now = {i.target["path"] for i in self.node.instances()
               if i.target and i.target.get("path", "").startswith(base)}
        self.pending_groups |= self._our_paths - now
        self._our_paths = now

    def node_uses(self, path: str) -> bool:
        """Whether some instance (again) has `path` as its target."""
        return any(i.target and i.target.get("path") == path for i in self.node.instances())

    def _drop_group(self, name: str, target: dict | None) -> None:
        self.owners.pop(name, None)
        if self.groups is not None and target and target.get("path", "").startswith(self.groups.base + os.sep):
            # (still populated: _orphaned_groups has marked it; the reaper removes it once empty)
            if not self.groups.remove(target["path"]):
                log.info("cgroup %s still holds processes; removing it when they are gone", target["path"])

    def close(self) -> None:
        """At shutdown: a last try at the cgroups still waiting for their processes to go."""
        for path in list(self.pending_groups):
            try:
                if self.groups is not None and not self.node_uses(path) and not self.groups.remove(path):
                    log.info("cgroup %s still holds processes at shutdown; left in place", path)
            except (OSError, CgroupError):
                pass
        self.pending_groups.clear()

    def reap(self) -> list[str]:
        """Deregister instances whose cgroup (made by us) is empty and whose
        registering connection is gone: `cgpu run` or its command died. Also
        a container's instances (target with `container`, from the hook) whose
        cgroup is gone: the runtime removed the container without its poststop."""
        for path in list(self.pending_groups):  # ours, deregistered while still populated
            try:
                done = self.node_uses(path) or self.groups is None or self.groups.remove(path)
            except (OSError, CgroupError) as exc:
                log.warning("cannot remove cgroup %s (%s); leaving it", path, exc)
                done = True
            if done:
                self.pending_groups.discard(path)
        gone = []
        for inst in list(self.node.instances()):
            t = inst.target
            if t and t.get("container") and inst.name not in gone and not os.path.isdir(t.get("path", "")):
                try:
                    self.durable.apply(lambda n, name=inst.name: n.destroy(name))
                except ModelError:
                    continue
                gone.append(inst.name)
                log.info("%s: the cgroup of container %s is gone; deregistered", inst.name, t["container"])
                continue
            if self.groups is None:
                continue
            if not t or not t.get("path", "").startswith(self.groups.base + os.sep):
                continue
            if self.owners.get(inst.name) in self.live_conns or inst.name in gone:
                continue
            if not self.groups.populated(t["path"]):
                try:
                    self.durable.apply(lambda n, name=inst.name: n.destroy(name))
                except ModelError:
                    continue
                self._drop_group(inst.name, t)
                gone.append(inst.name)
                log.info("%s: its processes are gone; deregistered", inst.name)
        for name in gone:
            self._drop_pages(name)
        return gone

    def _fill_pages(self, where: str, made: list[tuple[int, int]]) -> None:
        """Write the limits of an instance's pages: (GPU, memsize) of each of its GPUs, in the page's order."""
        pages.fill(where, [m for _, m in made], [self.node.gpu(g).info.uuid for g, _ in made])
        if getattr(self, "watchdog", None) is not None:
            pages.mark_watched(where)  # (its processes keep a headroom for the driver's growth from the start)

    def _drop_pages(self, name: str) -> None:
        where = os.path.join(self.pages_dir, name)
        if os.path.isdir(where) and not self.node.instances_named(name):
            pages.remove(where)


async def reaper(control: "Instances", after, interval: float = 1.0, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    while True:
        if control.reap():
            await after()
        await trio.sleep(interval)
