"""The `prepare` op: `cgpu-runtime` (native/runtime/cgpu-runtime.c) asks it
before the real runtime creates a container whose config.json may ask for
cgpud (docs/containers.md, "Docker and containerd"). Privileged: it makes the
daemon read and rewrite a file the caller names.

    {"op": "prepare", "bundle": "/abs/bundle", "id": "<container id>"}

The environment is read as the hook reads it (on Kubernetes the kubelet's
allocation, containers.allotted: a contract variable the pod set fails the
create, its NVIDIA_VISIBLE_DEVICES is narrowed to the allotted GPUs here, in
config.json, before the real runtime — nvidia-container-runtime — sees it) and
checked as the hook will check it (SPEC §2: a bad value,
or no GPU with room, fails `docker run` now, with the hook's own line); a
container that asks for nothing (CGPU_DISABLE, 0) is left alone; otherwise
containers.spec's modifiers (cgpud's hooks) are applied to config.json,
atomically (containers.hookd.write_config). Reading and writing happen in
worker threads within CONFIG_TIMEOUT, before `handle`; `prepare` then
answers what was done."""
from __future__ import annotations

import errno
import logging
import os
from typing import Any

import trio

from cgpud.containers import allotted, hookd, spec
from cgpud.containers.envspec import MEM_CONTAINER, EnvError, parse_env
from cgpud.containers.placement import PlacementError, resolve, states_from_node, unit_for
from cgpud.control.callers import TENANT_DIR
from cgpud.control.protocol import Peer, Refused
from cgpud.core.model import ModelError
from cgpud.gpus import pages

log = logging.getLogger("cgpud")

RESULT_KEY = object()  # where `load_bundle` leaves its outcome for `prepare` (no JSON request can carry it)


class Runtime:
    """prepare: a family of Control's ops (control.server)."""

    OPS = {"prepare": True}
    LOADERS = {"prepare": "load_bundle"}

    def prepare(self, req: dict, peer: Peer) -> dict:
        outcome = req.get(RESULT_KEY)
        if outcome is None:
            raise Refused(errno.EINVAL, "prepare runs only as a request on the control socket")
        if isinstance(outcome, hookd.HookError):
            log.info("runtime prepare (pid %d) refused: %s", peer.pid, outcome)
            self.starts_refused += 1  # (Hooks': metrics)
            raise Refused(outcome.code, str(outcome))
        return outcome

    async def load_bundle(self, req: dict, peer: Peer) -> dict:
        try:
            outcome: Any = await self._prepare_bundle(req, peer)
        except hookd.HookError as exc:
            outcome = exc
        return {**req, RESULT_KEY: outcome}

    async def _prepare_bundle(self, req: dict, peer: Peer | None = None) -> dict:
        cid = req.get("id")
        if not isinstance(cid, str) or not cid or len(cid) > hookd.MAX_ID or "\0" in cid:
            raise hookd.HookError('prepare needs the container\'s "id" (a non-empty string)')
        path = hookd.config_path({"id": cid, "bundle": req.get("bundle")})
        path = hookd.as_seen_by(path, peer.pid if peer else 0)
        config = read = await self._in_thread(hookd.read_config, cid, path, what=f"reading {path}")
        env, nvidia = hookd.contract_env(config, claim_mount(self.socket_path))  # (on Kubernetes: SPEC §2)
        if nvidia is not None:  # GPUs the kubelet did not allot, named by the pod or its image: narrowed
            config = allotted.with_nvidia(config, nvidia)
        if not self._check(env).managed:
            if nvidia is None:
                return {"action": "left alone", "id": cid}
            await self._in_thread(hookd.write_config, cid, path, config, what=f"writing {path}")
            log.info("container %s: %s=%s, as the kubelet allotted", cid, allotted.NVIDIA, nvidia)
            return {"action": "left alone", "id": cid, "gpus": nvidia}
        library = self.library if self.library and os.path.isfile(self.library) else None
        where = os.path.join(self.pages_dir, hookd.short_name(cid)) if library else None
        if where is not None:  # the pages' files must exist before the runtime mounts them
            await self._in_thread(_make_pages, cid, where, what=f"making {where}")
        try:
            new = spec.prepare(config, spec.Hooks(self.hook_path, self.socket_path, library, where))
        except spec.SpecError as exc:
            raise hookd.HookError(f"container {cid}: {exc}") from None
        if new == read:
            return {"action": "prepared already", "id": cid}
        await self._in_thread(hookd.write_config, cid, path, new, what=f"writing {path}")
        log.info("container %s: cgpud's hooks added to %s", cid, path)
        return {"action": "prepared", "id": cid}

    def _check(self, env: dict[str, str]):
        """As the hook will: the environment, and whether some GPU has room.
        The request (containers.request.Request), or HookError."""
        node = self.node
        try:
            request = parse_env(env, [g.info for g in node.gpus], max_inst=[g.max_inst for g in node.gpus],
                                unit=unit_for(self.mode))
        except EnvError as exc:
            raise hookd.HookError(str(exc)) from None
        if request.managed:
            try:
                resolve(request, states_from_node(node), strategy=self.strategy, mode=self.mode)
            except PlacementError as exc:
                raise hookd.HookError(f"{MEM_CONTAINER}={env.get(MEM_CONTAINER, '').strip()}: {exc}",
                                      errno.ENOSPC) from None
            except ModelError as exc:
                raise hookd.HookError(f"{MEM_CONTAINER}={env.get(MEM_CONTAINER, '').strip()}: {exc}") from None
        return request

    @staticmethod
    async def _in_thread(fn, *args, what: str):
        result: Any = hookd.HookError(f"{what} took more than {hookd.CONFIG_TIMEOUT:g} s", errno.ETIMEDOUT)
        with trio.move_on_after(hookd.CONFIG_TIMEOUT):
            result = await trio.to_thread.run_sync(hookd.catching, fn, *args, abandon_on_cancel=True)
        if isinstance(result, hookd.HookError):
            raise result
        return result


def claim_mount(socket_path: str | None) -> str | None:
    """The host path every DRA claim's container has bound (its CDI spec's: the containers' socket
    directory beside the daemon's socket), by which the hook knows one (containers.allotted)."""
    return os.path.join(os.path.dirname(os.path.abspath(socket_path)), TENANT_DIR) if socket_path else None


def _make_pages(cid: str, where: str) -> None:
    try:
        pages.prepare(where, preload=spec.LIB_IN_CONTAINER)
    except OSError as exc:
        raise hookd.HookError(f"container {cid}: cannot make its GPU isolation pages in {where}: {exc.strerror}",
                              exc.errno or errno.EIO) from None
