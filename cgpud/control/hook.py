"""The `hook` op: a container's OCI hook stage, done in the daemon
(docs/containers.md). Privileged: it makes the daemon read a file the caller
names. containers.hookd reads and checks the request and config.json and
plans the instances; here they are registered or deregistered through the
instances family's own ops, so a container joins exactly as `register` does."""
from __future__ import annotations

import errno
import logging
import os

import trio

from cgpud.containers import hookd, inject
from cgpud.control.protocol import Peer, Refused
from cgpud.control.runtime import claim_mount
from cgpud.core.model import ModelError, errno_of

log = logging.getLogger("cgpud")
INJECTED_KEY = object()  # (load_hook's failure to put the library in, for the hook to report)


def _inject(state: dict, config: dict, pid: int, library: str, where: str) -> None:
    cid = state["id"]
    inject.into_container(cid, pid, inject.rootfs_of(cid, config, state["bundle"]), library, where)


class Hooks:
    """hook: a family of Control's ops (control.server)."""

    OPS = {"hook": True}
    LOADERS = {"hook": "load_hook"}
    starts_refused = 0  # container starts the hook or cgpu-runtime's prepare refused since the daemon started (metrics)

    def hook(self, req: dict, peer: Peer) -> dict:
        """Returns what was done (`{"action": "registered", …}`, `"left alone"`,
        `"deregistered"`, `"nothing"`); a refusal carries the hook's one line."""
        try:
            return self._hook(req, peer)
        except hookd.HookError as exc:
            log.info("container hook (%s, pid %d) refused: %s", req.get("stage"), peer.pid, exc)
            self.starts_refused += 1
            raise Refused(exc.code, str(exc)) from None

    def _hook(self, req: dict, peer: Peer) -> dict:
        kind, state = hookd.check_request(req)
        cid = state["id"]
        name = hookd.short_name(cid)
        if kind == "remove":
            return self._leave(cid, name, peer)
        try:
            return self._join(req, state, cid, name, peer)
        except hookd.HookError:
            # Pages made for it (cgpu-runtime's prepare, the injection) go with the refusal, unless a
            # registered container of the same short name owns them (the clash it was refused for).
            self._drop_pages(name)
            raise

    def _join(self, req: dict, state: dict, cid: str, name: str, peer: Peer) -> dict:
        if isinstance(req.get(INJECTED_KEY), hookd.HookError):
            raise req[INJECTED_KEY]  # asked for isolation, and it could not be put in: the container does not start
        env = req.get(hookd.ENV_KEY)
        if env is None:  # not loaded (called without `load_hook`): read it here
            env = hookd.catching(hookd.read_env, cid, hookd.config_path(state), claim_mount(self.socket_path))
        if isinstance(env, hookd.HookError):
            raise env
        plan = hookd.plan(state, env, self.node, strategy=self.strategy, mode=self.mode, hook_pid=peer.pid)
        if plan.get("action") == "left alone":
            return plan
        where = os.path.join(self.pages_dir, name)
        prepared = os.path.isdir(where)  # by cgpu-runtime: the container carries libcgpu
        try:
            result = self.register(plan, peer, gate=where if prepared and self.gate else None)
        except (Refused, ModelError) as exc:
            code = exc.code if isinstance(exc, Refused) else errno_of(exc)
            raise hookd.HookError(f"cannot register {name} on GPU {','.join(map(str, plan['gpus']))}: {exc} "
                                  f"({errno.errorcode[code]})", code) from None
        if prepared:  # the limits the container's library reads
            try:
                self._fill_pages(where, [(i["gpu"], i["memsize"]) for i in result["instances"]])
            except (OSError, ValueError) as exc:
                self.deregister({"name": name, "container": cid}, peer)
                raise hookd.HookError(f"cannot write the GPU isolation pages of {name} in {where}: {exc}") from None
        return {"action": "registered", "container": cid, **result}

    def _leave(self, cid: str, name: str, peer: Peer) -> dict:
        try:  # only the instances this container registered (its ID is kept with the target)
            result = self.deregister({"name": name, "container": cid}, peer)
        except Refused as exc:
            if exc.code == errno.ENOENT:
                return {"action": "nothing", "name": name}  # never registered, or another container's
            raise
        return {"action": "deregistered", "container": cid, **result}  # (its pages went with it: deregister)

    async def load_hook(self, req: dict, peer: Peer) -> dict:
        """The hook's config.json read, in a worker thread with a time limit; and, for a
        container that joins through the hook alone (not prepared by cgpu-runtime), the
        in-container library mounted into it when the daemon has one (containers.inject)."""
        req = await hookd.load(req, peer.pid, claim_mount(self.socket_path))
        env = req.get(hookd.ENV_KEY)
        library = self.library if self.library and os.path.isfile(self.library) else None
        if library is None or not isinstance(env, dict):
            return req
        try:
            kind, state = hookd.check_request(req)
            if kind != "add" or not self._check(env).managed:  # (CGPU_DISABLE=true: not managed, nothing put in)
                return req
            where = os.path.join(self.pages_dir, hookd.short_name(state["id"]))
            if os.path.isdir(where):
                return req  # prepared by cgpu-runtime: its mounts are in the spec
            pid = hookd.container_pid(state, peer.pid)
        except hookd.HookError:
            return req  # (the hook itself says what is wrong)
        done = await trio.to_thread.run_sync(hookd.catching, _inject, state, req[hookd.CONFIG_KEY], pid, library,
                                             where)
        return {**req, INJECTED_KEY: done} if isinstance(done, hookd.HookError) else req
