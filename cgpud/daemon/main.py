"""Wiring: inventory -> state -> model -> tree -> mount, in one trio nursery.

Start-up refuses with one clear line (`StartError`) when it cannot do its job:
a bad --gpus spec, an unusable state file, a state written for other GPUs, no
/dev/fuse, a mount point in use. SIGTERM and SIGINT unmount cleanly.

Longer than 450 lines on purpose: it is the one place where the parts are
wired together in their start-up order; split, that order would be spread
over several files.
"""
from __future__ import annotations

import errno
import faulthandler
import functools
import grp
import logging
import os
import struct
import signal
import socket
from dataclasses import dataclass

import pyfuse3
import trio

from fusefs import mount
from fusefs.handover import FuseServer
from fusefs.operations import Operations

from cgpud import __version__, tree

from cgpud.control import server as control
from cgpud.control.doors import raise_open_files
from cgpud.control.protocol import Refused

from cgpud.daemon import upgrade
from cgpud.sched import native
from cgpud.sched.guard import RegistryError
from cgpud.state.durable import Durable
from cgpud.gpus import BadSpec, discover, pages
from cgpud.core.model import ERRNOS, InvalidValue, Node
from cgpud.state.lock import Locked, StateLock
from cgpud.state.paths import FSNAME
from cgpud.sched.policies import Params
from cgpud.sched.priority import raise_priority
from cgpud.daemon.sdnotify import notify
from cgpud.daemon.errors import StartError
from cgpud.daemon.services import Services
from cgpud.daemon.systemd import Watchdog, watchdog_interval
from cgpud.state.store import CorruptState, Store

log = logging.getLogger("cgpud")


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
    queue_budget_ms: float = 2.0  # gated instances: GPU work a process may queue ahead while it may be held
    switch: str = "drain"  # when the switcher opens the next gate: drain, ahead, overlap (docs/scheduler.md)
    placement: str = "binpack"
    mode: str = "cgpu"
    schedule: bool = True
    mem_action: str = "kill"  # real GPUs: what the memory watchdog does past memsize (kill|term|log)
    mps_control: str | None = None  # --mode mps: the nvidia-cuda-mps-control to drive (None: from PATH)
    mps_pipe_dir: str | None = None  # --mode mps: CUDA_MPS_PIPE_DIRECTORY for the daemon and clients
    metrics_addr: str | None = None  # HOST:PORT; None or "off": no metrics
    metrics_auth: str = "none"  # who reads the per-instance series (cgpud/observe/door.py): none, open, kubernetes
    metrics_tls: tuple[str | None, str | None] | None = None  # (certificate, key) to serve metrics over TLS
    hook_path: str | None = None  # the OCI hook cgpu-runtime's `prepare` puts in containers (None: the default)
    libcgpu: str | None = None  # the in-container library cgpu-runtime's `prepare` mounts (if the file exists)
    # how the compute share of an instance whose processes carry libcgpu is enforced: "gate" (its kernel
    # launches), "freeze" (its cgroup), "auto" (gate on real GPUs; on simulated ones workloads do not launch
    # through CUDA, so freeze) (docs/isolation.md)
    compute: str = "auto"
    # GPU health (cgpud/gpus/health.py, docs/gpus.md "Health"): watched unless off; the Xids that are the
    # application's own (None: NVIDIA's list); the quiet time before a failed GPU is back; failures within
    # the window after which it stays out
    health: bool = True
    health_ignore_xids: frozenset | None = None
    health_quiet: float = 60.0
    health_max_failures: int = 3
    health_window: float = 3600.0

    @property
    def gates(self) -> bool:
        """"auto" gates on real GPUs if the native part is built ("gate" without it: refused at start)."""
        auto = self.compute == "auto" and self.gpus.strip() == "nvml"
        return self.compute == "gate" or (auto and native.missing(warn="containers with libcgpu are frozen") is None)
    successor: int | None = None  # set by serve: after a hot upgrade, the pid of the daemon that serves now


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


def _params(cfg: Config) -> Params:
    """The scheduler's parameters the flags name (StartError: one line saying which flag is wrong)."""
    try:
        return Params(slice=cfg.slice_ms / 1000.0, merge_runs=True, queue_budget=cfg.queue_budget_ms / 1000.0,
                      switch=cfg.switch)
    except ValueError as exc:
        raise StartError(f"--slice-ms {cfg.slice_ms} --queue-budget-ms {cfg.queue_budget_ms}: {exc}") from None


def _scheduling(node: Node, durable: Durable, cfg: Config, devices: list[str]):
    from cgpud.sched.scheduling import Scheduling

    if not devices:
        raise StartError("scheduling needs a device file per GPU: give --dev-dir")
    params = _params(cfg)
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


def gpu_devices(node: Node, cfg: Config) -> list[str]:
    """The device file of each GPU: /dev/nvidia<minor> (under --dev-dir) for
    real GPUs, which must exist; the daemon's own files for simulated ones."""
    if cfg.gpus.strip() != "nvml":
        return sim_devices(node, cfg.dev_dir)
    from cgpud.gpus.nvml import device_files

    try:
        return device_files([g.info for g in node.gpus], cfg.dev_dir or "/dev")
    except BadSpec as exc:
        raise StartError(str(exc)) from None


def _admin_gid(name: str | None) -> int | None:
    if name is None:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise StartError(f"--admin-group {name}: no such group") from None


async def _start_mps(nursery, node: Node, durable: Durable, cfg: Config):
    from cgpud.sched.guard import registry_path, thaw_all
    from cgpud.gpus.mps import MpsControl, MpsError

    # No scheduler in mps mode, but what a previous daemon (in another mode) left frozen runs again.
    path = registry_path(cfg.state_dir)
    try:
        if not any(outcome.startswith("refused") for _, outcome in thaw_all(path)) and os.path.exists(path):
            os.unlink(path)
    except RegistryError as exc:
        raise StartError(f"cannot read what a previous daemon froze ({exc}); fix or remove that file") from None
    try:
        mps = MpsControl(node, cfg.mps_control, cfg.mps_pipe_dir, cfg.state_dir)
        await nursery.start(mps.run)
    except MpsError as exc:
        raise StartError(str(exc)) from None
    durable.listeners.append(mps.changed)
    return mps


async def _start_watchdog(nursery, node: Node, ctl: "control.Control", cfg: Config):
    """Memory isolation on real GPUs (cgpud/gpus/memwatch.py). Instances get their
    processes (targets) only through the control socket, hence here."""
    from cgpud.gpus.nvml import NvmlError
    from cgpud.gpus.memwatch import MemWatchdog

    def owner(pid: int, gpu: int):
        try:
            return ctl.instance_of(pid, gpu)
        except Refused:
            return None

    def library(inst) -> int | None:
        """What the instance's usage page says it holds on its GPU: the page's GPU of that UUID (a page
        of an older cgpud names none: the k-th of its GPUs in index order)."""
        where = os.path.join(ctl.pages_dir, inst.name)
        gpus = sorted(i.gpu for i in node.instances_named(inst.name))
        try:
            return pages.used_on(where, node.gpu(inst.gpu).info.uuid, gpus.index(inst.gpu))
        except (OSError, ValueError, IndexError, struct.error):
            return None

    def page(inst) -> tuple[str, int] | None:
        """The instance's usage page directory and its GPU's index there (where the driver's readings go)."""
        where = os.path.join(ctl.pages_dir, inst.name)
        gpus = sorted(i.gpu for i in node.instances_named(inst.name))
        try:
            return where, pages.gpu_index(where, node.gpu(inst.gpu).info.uuid, gpus.index(inst.gpu))
        except (OSError, ValueError, IndexError, struct.error):
            return None

    watchdog = MemWatchdog(node, owner, cfg.mem_action, library=library, page=page)
    try:
        await nursery.start(watchdog.run)
    except NvmlError as exc:
        raise StartError(str(exc)) from None
    watchdog.over = ctl.oom_refusals  # each process found past its memsize counts as an out-of-memory event (metrics)
    ctl.watchdog = watchdog  # for whoever reports it (kills / over per (gpu, instance))
    return watchdog


async def _start_charge_check(nursery, services: Services, cfg: Config) -> None:
    """The check of what the containers' usage pages say against NVML's per-process utilisation
    (cgpud/sched/gputime.py, ChargeCheck; docs/security.md, "The charge"): on real GPUs, and on
    simulated ones when CGPUD_CHARGE_NVML=1 says NVML's GPU i stands for the simulated GPU i (the
    stand-in NVML and card: tests, benches). Without NVML the page is checked against its gate's time
    alone (the per-step floor, docs/scheduler.md)."""
    if services.sched is None or services.ctl is None or not cfg.gates:
        return
    if cfg.gpus.strip() != "nvml" and os.environ.get("CGPUD_CHARGE_NVML") != "1":
        return
    if os.environ.get("CGPUD_BENCH_NO_CHARGE_CHECK") == "1":  # (bench/charge.py's reference: the check off)
        log.warning("the usage pages' GPU time is not checked (CGPUD_BENCH_NO_CHARGE_CHECK=1)")
        return
    from cgpud.gpus.nvml import Nvml, NvmlError
    from cgpud.sched.gputime import ChargeCheck
    ctl = services.ctl
    nv = Nvml()
    try:
        await trio.to_thread.run_sync(nv.open)
    except NvmlError as exc:
        log.warning("the usage pages' GPU time is checked against the gates' time alone: %s", exc)
        return

    def owner(pid: int, gpu: int):
        try:
            return ctl.instance_of(pid, gpu)
        except Refused:
            return None

    check = ChargeCheck(nv, lambda: services.sched.schedulers if services.sched is not None else [], owner)
    log.info("the usage pages' GPU time is checked against NVML's per-process utilisation every %.2g s",
             check.window)
    await nursery.start(check.run)


async def _start_health(nursery, node: Node, durable: Durable, services: Services, cfg: Config):
    """GPU health (cgpud/gpus/health.py): NVML's events on real GPUs, the state directory's sim-faults
    file on simulated ones. A GPU out of service: its scheduler goes on (its instances stay isolated), nothing new is
    placed on it, query/metrics/cgpu-smi say why."""
    import time

    from cgpud.gpus import health
    from cgpud.gpus.nvml import NvmlError

    policy = _health_policy(cfg)
    if cfg.gpus.strip() == "nvml":
        source = health.NvmlSource()
    else:
        source = health.FileSource(health.sim_faults_path(cfg.state_dir), len(node.gpus))

    def changed(i: int, st) -> None:
        shown = st.as_dict(0.0)
        shown.pop("out_for")
        node.gpu(i).health = {**shown, "since": None if st.healthy else time.time()}  # (wall time, for people)
        if services.sched is not None:
            services.sched.set_in_service(i, st.healthy)
        for listener in durable.listeners:
            listener()

    watch = health.HealthWatch(health.Health(len(node.gpus), policy), source, changed,
                               names=[f"GPU {g.index} ({g.info.uuid})" for g in node.gpus])
    for g in node.gpus:
        g.health = {"healthy": True, "reason": "", "advice": "", "last_xid": 0, "lost": False, "retired": False,
                    "failures": 0, "since": None}
    try:
        await nursery.start(watch.run)
    except NvmlError as exc:
        raise StartError(f"GPU health: {exc} (or --no-health)") from None
    return watch


def _health_policy(cfg: Config):
    from cgpud.gpus import health

    ignored = health.DEFAULT_IGNORED_XIDS if cfg.health_ignore_xids is None else cfg.health_ignore_xids
    try:
        return health.Policy(frozenset(ignored), cfg.health_quiet, cfg.health_max_failures, cfg.health_window)
    except ValueError as exc:
        raise StartError(f"--health-quiet/--health-max-failures/--health-window: {exc}") from None


STOP_REPORT_AFTER = 8.0  # s after SIGTERM/SIGINT: a daemon still stopping then prints where it is


async def _watch_signals(task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        stopping = False
        async for sig in signals:  # (until the daemon's nursery ends: a second Ctrl-C changes nothing)
            if stopping:
                log.info("%s received: already stopping", signal.Signals(sig).name)
                continue
            log.info("%s received: unmounting and stopping", signal.Signals(sig).name)
            notify("STOPPING=1")
            # A stop takes well under a second. Should one hang, its stacks go to stderr (the journal)
            # after STOP_REPORT_AFTER s, "Timeout" first: what to attach to a report.
            faulthandler.dump_traceback_later(STOP_REPORT_AFTER, exit=False)
            pyfuse3.terminate()
            stopping = True


async def _serve_fs(fuse, scope, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the tree; when it ends (terminated, or unmounted from outside),
    stop everything else too."""
    try:
        await fuse.run(task_status=task_status)
    finally:
        scope.cancel()


async def _metrics_when_free(addr, pub, shown: str, door, tls, patience: float = 30.0) -> None:
    from cgpud.observe import exposition

    deadline = trio.current_time() + patience
    while True:
        try:
            await exposition.serve(addr, pub, door=door, tls=tls)
            return
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or trio.current_time() > deadline:
                log.error("metrics: cannot serve on %s (%s): no metrics until the daemon restarts",
                          shown, exc.strerror or exc)
                return
            await trio.sleep(0.1)


def _events(services: Services) -> tuple[dict, int]:
    """What the metrics count of the daemon's events: the memory watchdog's kills, starts refused."""
    ctl = services.ctl
    watchdog = getattr(ctl, "watchdog", None)
    return (getattr(watchdog, "kills", {}), ctl.starts_refused if ctl is not None else 0)


async def _start_metrics(nursery, cfg: Config, durable: Durable, services: Services, *, wait_for_port: bool) -> None:
    """Prometheus metrics (docs/metrics.md), unless --metrics-addr is off."""
    from cgpud.observe import door as doors, exposition, metrics

    try:
        addr = exposition.parse_addr(cfg.metrics_addr)
    except exposition.BadAddress as exc:
        raise StartError(str(exc)) from None
    if addr is None:
        return
    try:  # (before anything is bound: a certificate that cannot be loaded, no API server to ask)
        door = doors.Door(cfg.metrics_auth)
        tls = doors.tls_context(*(cfg.metrics_tls or (None, None)), cfg.metrics_auth)
    except doors.DoorError as exc:
        raise StartError(str(exc)) from None
    pub = metrics.Publisher(durable.node, schedulers=lambda: services.sched.schedulers if services.sched is not None else (),
                            oom=services.ctl.oom_refusals if services.ctl is not None else None,
                            mode=cfg.mode, placement=cfg.placement, events=functools.partial(_events, services))
    durable.listeners.append(pub.changed)
    if wait_for_port:  # a hot upgrade: the daemon before still serves the port until it exits
        nursery.start_soon(_metrics_when_free, addr, pub, cfg.metrics_addr, door, tls)
        return
    try:
        await nursery.start(functools.partial(exposition.serve, addr, pub, door=door, tls=tls))
    except OSError as exc:
        raise StartError(f"--metrics-addr {cfg.metrics_addr}: {exc.strerror or exc}; choose another "
                         f"HOST:PORT, or `off`") from None


async def serve(cfg: Config) -> int:
    """Run the daemon; its exit status (0, or upgrade.COLD_EXIT after a cold
    upgrade). A start-up failure comes out as one StartError (not wrapped in
    the nursery's exception group)."""
    try:
        return await _serve(cfg)
    except BaseExceptionGroup as group:
        starts = group.subgroup(StartError)
        if starts is not None and starts.subgroup(lambda e: not isinstance(e, (StartError, BaseExceptionGroup))) is None:
            first = starts
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        raise


def _check_flags(cfg: Config) -> None:
    """What the flags say, checked before anything is done (a refused start touches nothing)."""
    from cgpud.observe import door, exposition

    _params(cfg)
    try:
        if exposition.parse_addr(cfg.metrics_addr) is not None:
            door.check_config(cfg.metrics_auth, cfg.metrics_tls)
    except (exposition.BadAddress, door.DoorError) as exc:
        raise StartError(str(exc)) from None
    _admin_gid(cfg.admin_group)
    _health_policy(cfg)
    if cfg.compute == "gate" and (why := native.missing()) is not None:
        raise StartError(f"--compute gate: {why}")


def _check_metrics_port(cfg: Config) -> None:
    """Refuse, before anything is mounted, a metrics address another process listens on (a start refused
    after the mount would leave it dead: "Transport endpoint is not connected" until the next start)."""
    from cgpud.observe import exposition

    addr = exposition.parse_addr(cfg.metrics_addr)
    if addr is None or addr[1] == 0:
        return
    probe = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the metrics server binds)
        probe.bind(addr)
    except OSError as exc:
        raise StartError(f"--metrics-addr {cfg.metrics_addr}: {exc.strerror or exc}; choose another "
                         f"HOST:PORT, or `off`") from None
    finally:
        probe.close()


def _lock_state(cfg: Config) -> StateLock:
    try:
        return StateLock.acquire(cfg.state_dir)
    except Locked as exc:
        raise StartError(str(exc)) from None
    except OSError as exc:
        raise StartError(f"cannot use state directory {cfg.state_dir}: {exc.strerror}") from None


def _check_socket(path: str | None) -> None:
    """Refuse, before doing anything, when another daemon answers on the socket."""
    if not path or not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return  # a socket left by a daemon that is gone: serving replaces it
    else:
        raise StartError(f"another daemon answers on {path}: stop it, or choose another --socket")
    finally:
        probe.close()


async def _serve(cfg: Config) -> int:
    takeover = upgrade.Takeover.from_env()  # started by a hot upgrade (cgpud.daemon.upgrade)
    # Every refusal comes before any side effect: flags, the state directory's lock
    # (one daemon per state directory), the socket; then the mount point (load_node
    # reads the state; the mount, the guard and cgroups come after all of them).
    _check_flags(cfg)
    raise_open_files()  # (systemd gives 1024 unless the unit says: the sockets' bounds need more, control.doors)
    lock = _lock_state(cfg)
    try:
        if takeover is None:
            _check_socket(cfg.socket)
            _check_metrics_port(cfg)
        node, store = load_node(cfg)
    except BaseException:
        lock.close()
        raise
    gid = _admin_gid(cfg.admin_group)
    upgrader = None
    try:
        devices = gpu_devices(node, cfg)
        durable = Durable(node, store)
        if takeover is None and store.load() != node.to_state():
            try:
                store.save(node.to_state())
            except OSError as exc:
                raise StartError(f"cannot write the state file {store.path} ({exc.strerror}): "
                                 f"make room under {cfg.state_dir}") from None
        status = upgrade.Status()
        upgrader = upgrade.Upgrader(status)
        upgrader.lock_fd = lock.fd  # handed on to the next daemon with everything else
        ops = Operations(tree.build(durable, upgrader), errors=ERRNOS, version=lambda: node.version, write_gid=gid)
        mountpoint = os.path.abspath(cfg.mount)
        fuse = FuseServer(ops, mountpoint)
        if takeover is None:
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
        async with trio.open_nursery() as nursery:
            await nursery.start(_watch_signals)
            # In mps mode MPS shares compute (active-thread percentage): no time slices.
            schedules = cfg.schedule and cfg.mode != "mps"
            mps = await _start_mps(nursery, node, durable, cfg) if cfg.mode == "mps" else None
            services = Services(
                durable, cfg.socket,
                (lambda: _scheduling(node, durable, cfg, devices)) if schedules else None, ops.refresh,
                admin_gid=gid, devices=devices, strategy=cfg.placement, mode=cfg.mode,
                client_env=mps.client_env if mps is not None else None, hook_path=cfg.hook_path,
                library=cfg.libcgpu, gate=cfg.gates)
            exit_status = 0

            def cold_stop() -> None:
                nonlocal exit_status
                exit_status = upgrade.COLD_EXIT
                pyfuse3.terminate()

            if services.ctl is not None:
                services.ctl.ops["cold_upgrade"] = (True, upgrade.cold_op(services.ctl, cold_stop))
            try:
                if takeover is not None:
                    await upgrade.take_over(takeover, fuse, services, ops, store, status,
                                            cfg.state_dir if cfg.schedule else None)
                else:
                    try:
                        fuse.mount(mount.options(FSNAME, allow_other))
                    except mount.MountError as exc:
                        raise StartError(str(exc)) from None
                await services.start(nursery, **(takeover.service_args() if takeover else {}))
                if cfg.gpus.strip() == "nvml" and services.ctl is not None:
                    await _start_watchdog(nursery, node, services.ctl, cfg)
                await _start_charge_check(nursery, services, cfg)
                if cfg.health:
                    await _start_health(nursery, node, durable, services, cfg)
                await _start_metrics(nursery, cfg, durable, services, wait_for_port=takeover is not None)
                if takeover is not None:
                    fuse.takeover(takeover.fuse_fd)
            except BaseException as exc:
                if takeover is not None:  # the old daemon serves again
                    with trio.CancelScope(shield=True):
                        await takeover.failed(str(exc) or type(exc).__name__)
                else:  # a refused start leaves no mount behind (nothing would serve it)
                    fuse.close()
                raise
            await nursery.start(_serve_fs, fuse, nursery.cancel_scope)
            upgrader.services, upgrader.fuse, upgrader.nursery = services, fuse, nursery

            def handed_over() -> None:
                if mps is not None:
                    mps.keep = True  # the next daemon takes the MPS control daemon over
                nursery.cancel_scope.cancel()

            upgrader.on_handed_over = handed_over
            if takeover is not None:
                await takeover.serving()
            gpus = ", ".join(f"{g.index}: {g.info.name} {g.info.memory >> 20} MiB" for g in node.gpus)
            log.info("cgpud %s serving %s (GPUs %s; state in %s; %s)", __version__, mountpoint, gpus, store.path, prio)
            notify("READY=1")  # the tree is mounted, the schedulers and the socket run
            interval = watchdog_interval()
            if interval is not None:
                dog = Watchdog(interval, lambda: services.sched.schedulers if services.sched is not None else (),
                               probe=lambda: os.statvfs(mountpoint))
                await nursery.start(dog.run)
        if not upgrader.handed_over:
            services.close()
        else:
            cfg.successor = upgrader.successor
        log.info("stopped")
        return exit_status
    finally:
        if upgrader is None or not upgrader.handed_over:
            notify("STOPPING=1")
        store.close()
        lock.close()  # (after a handover the new daemon holds the same lock: it stays taken)
