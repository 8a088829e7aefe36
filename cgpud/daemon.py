"""Wiring: inventory -> state -> model -> tree -> mount, in one trio nursery.

Start-up refuses with one clear line (`StartError`) when it cannot do its job:
a bad --gpus spec, an unusable state file, a state written for other GPUs, no
/dev/fuse, a mount point in use. SIGTERM and SIGINT unmount cleanly.
"""
from __future__ import annotations

import grp
import logging
import os
import signal
from dataclasses import dataclass

import pyfuse3
import trio

from fusefs import mount
from fusefs.operations import Operations

from . import __version__, control, tree
from .cgroups import CgroupError, InstanceGroups
from .guard import RegistryError
from .durable import Durable
from .gpus import BadSpec, discover
from .model import InvalidValue, Node
from .paths import FSNAME
from .priority import raise_priority
from .sdnotify import notify
from .service import Watchdog, watchdog_interval
from .store import CorruptState, Store

log = logging.getLogger("cgpud")


class StartError(Exception):
    """The daemon cannot start; the message is one line for a person."""


@dataclass
class Config:
    gpus: str
    mount: str
    state_dir: str
    admin_group: str | None = None
    socket: str | None = None
    dev_dir: str | None = None
    rt_priority: int = 0
    slice_ms: float = 10.0
    placement: str = "binpack"
    mode: str = "cgpu"
    schedule: bool = True


def load_node(cfg: Config) -> tuple[Node, Store]:
    try:
        infos = discover(cfg.gpus)
    except BadSpec as exc:
        raise StartError(str(exc)) from None
    node = Node(infos)
    store = Store(cfg.state_dir)
    try:
        store.open()
    except OSError as exc:
        raise StartError(f"cannot use state directory {cfg.state_dir}: {exc.strerror}") from None
    try:
        state = store.load()
    except CorruptState as exc:
        raise StartError(str(exc)) from None
    if state is not None:
        try:
            node.load_state(state)
        except InvalidValue as exc:
            raise StartError(
                f"state file {store.path} does not fit this node ({exc}). Start with the --gpus it was "
                f"written for, or move the file away to start with no instances and default settings."
            ) from None
    return node, store


def _scheduling(node: Node, durable: Durable, cfg: Config, devices: list[str]):
    from .sched.policies import Params
    from .scheduling import Scheduling

    if not devices:
        raise StartError("scheduling needs a device file per GPU: give --dev-dir")
    try:
        params = Params(slice=cfg.slice_ms / 1000.0, merge_runs=True)
    except ValueError as exc:
        raise StartError(f"--slice-ms {cfg.slice_ms}: {exc}") from None
    try:
        sched = Scheduling(node, cfg.state_dir, dict(enumerate(devices)), params)
    except RegistryError as exc:
        raise StartError(f"cannot read what a previous daemon froze ({exc}); fix or remove that file") from None
    durable.listeners.append(sched.sync)
    return sched


def sim_devices(node: Node, dev_dir: str | None) -> list[str]:
    """One device file per simulated GPU: a process "has the GPU open" while
    it holds its file open (what /dev/nvidiaN is on a real GPU)."""
    if not dev_dir:
        return []
    os.makedirs(dev_dir, exist_ok=True)
    paths = []
    for g in node.gpus:
        p = os.path.join(dev_dir, f"simgpu{g.index}")
        if not os.path.exists(p):
            with open(p, "w") as f:
                f.write(f"{g.info.uuid}\n")
        os.chmod(p, 0o666)
        paths.append(p)
    return paths


def _admin_gid(name: str | None) -> int | None:
    if name is None:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise StartError(f"--admin-group {name}: no such group") from None


async def _watch_signals(task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for sig in signals:
            log.info("%s received: unmounting and stopping", signal.Signals(sig).name)
            notify("STOPPING=1")
            pyfuse3.terminate()
            return


async def _serve_fs(ops, mountpoint, opts, scope, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the tree; when it ends (terminated, or unmounted from outside),
    stop everything else too."""
    try:
        await mount.serve(ops, mountpoint, opts, task_status=task_status)
    finally:
        scope.cancel()


async def serve(cfg: Config) -> None:
    """Run the daemon; a start-up failure comes out as one StartError
    (not wrapped in the nursery's exception group)."""
    try:
        await _serve(cfg)
    except BaseExceptionGroup as group:
        starts = group.subgroup(StartError)
        if starts is not None and starts.subgroup(lambda e: not isinstance(e, (StartError, BaseExceptionGroup))) is None:
            first = starts
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        raise


async def _serve(cfg: Config) -> None:
    node, store = load_node(cfg)
    gid = _admin_gid(cfg.admin_group)
    try:
        durable = Durable(node, store)
        store.save(node.to_state())
        ops = Operations(tree.build(durable), errors=tree.ERRNOS, version=lambda: node.version, write_gid=gid)
        mountpoint = os.path.abspath(cfg.mount)
        try:
            mount.prepare_mountpoint(mountpoint, FSNAME)
        except mount.MountError as exc:
            raise StartError(str(exc)) from None
        allow_other = mount.allow_other_permitted()
        if not allow_other:
            log.warning(
                "mounting without allow_other: only this user can read %s "
                "(add user_allow_other to /etc/fuse.conf to let everyone read)",
                mountpoint,
            )
        prio = raise_priority(cfg.rt_priority)
        cleanups: list = []
        async with trio.open_nursery() as nursery:
            await nursery.start(_watch_signals)
            devices = sim_devices(node, cfg.dev_dir)
            sched = _scheduling(node, durable, cfg, devices) if cfg.schedule else None
            if sched is not None:
                await nursery.start(sched.run)
            if cfg.socket:
                try:
                    groups = InstanceGroups()
                except CgroupError as exc:
                    log.warning("%s: `cgpu run` will be refused", exc)
                    groups = None
                ctl = control.Control(durable, gid, groups, devices=devices,
                                      stats=sched.stats if sched is not None else None,
                                      strategy=cfg.placement, mode=cfg.mode)
                try:
                    await nursery.start(control.serve, cfg.socket, ctl, ops.refresh)
                except OSError as exc:
                    raise StartError(f"control socket {cfg.socket}: {exc.strerror or exc}") from None
                cleanups.append(ctl.close)
                nursery.start_soon(control.reaper, ctl, ops.refresh)
            try:
                await nursery.start(_serve_fs, ops, mountpoint, mount.options(FSNAME, allow_other), nursery.cancel_scope)
            except mount.MountError as exc:
                raise StartError(str(exc)) from None
            gpus = ", ".join(f"{g.index}: {g.info.name} {g.info.memory >> 20} MiB" for g in node.gpus)
            log.info("cgpud %s serving %s (GPUs %s; state in %s; %s)", __version__, mountpoint, gpus, store.path, prio)
            notify("READY=1")  # the tree is mounted, the schedulers and the socket run
            interval = watchdog_interval()
            if interval is not None:
                dog = Watchdog(interval, sched.schedulers if sched is not None else (),
                               probe=lambda: os.statvfs(mountpoint))
                await nursery.start(dog.run)
        for cleanup in cleanups:
            cleanup()
        log.info("stopped")
    finally:
        notify("STOPPING=1")
        store.close()
