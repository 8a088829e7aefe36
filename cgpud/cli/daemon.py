"""`cgpud`: the node daemon."""
from __future__ import annotations

import logging
import os
import sys

import click
import trio

from cgpud import __version__
from cgpud.containers.spec import DEFAULT_HOOK_PATH, DEFAULT_LIBCGPU
from cgpud.daemon.errors import StartError
from cgpud.daemon.foreground import in_terminal, relay
from cgpud.daemon.main import Config, serve as serve_daemon
from cgpud.observe.exposition import DEFAULT_ADDR as DEFAULT_METRICS_ADDR
from cgpud.sched.timerfd import MonotonicClock
from cgpud.state.paths import default_dev_dir, default_mount, default_socket, default_state_dir


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="cgpud: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("pyfuse3").setLevel(max(logging.WARNING, getattr(logging, level.upper())))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cgpud")
def main() -> None:
    """cgpud: GPU sharing for containers, with a /proc/cgpu_km tree over FUSE."""


@main.command()
@click.option("--gpus", default="sim:T4", show_default=True, envvar="CGPUD_GPUS",
              help="GPUs to manage: nvml (the real ones), sim:T4, sim:4xT4, sim:2xA10,1xV100, sim:NAME:MIB, file:PATH")
@click.option("--mount", "mountpoint", default=default_mount, show_default="/run/cgpu_km as root",
              envvar="CGPUD_MOUNT", help="Where to mount the cgpu_km tree.")
@click.option("--state-dir", default=default_state_dir, show_default="/var/lib/cgpud as root",
              envvar="CGPUD_STATE_DIR", help="Where settings and instances are kept.")
@click.option("--admin-group", default=None, envvar="CGPUD_ADMIN_GROUP",
              help="A group whose members may write the tree too (mode 0664).")
@click.option("--socket", "socket_path", default=default_socket, show_default="/run/cgpud/cgpud.sock as root",
              envvar="CGPUD_SOCKET", help="The control socket (for cgpu run, the container hook, cgpu-smi).")
@click.option("--dev-dir", default=None, show_default="/dev for nvml, else /run/cgpud/dev as root", envvar="CGPUD_DEV_DIR",
              help="Where the device file of each simulated GPU is made; with --gpus nvml, where the "
                   "nvidiaN device files are.")
@click.option("--rt-priority", type=click.IntRange(0, 99), default=10, show_default=True, envvar="CGPUD_RT_PRIORITY",
              help="Real-time priority of the daemon's scheduling (0: normal priority).")
@click.option("--slice-ms", type=click.FloatRange(0.5, 1000), default=10.0, show_default=True, envvar="CGPUD_SLICE_MS",
              help="The base time slice X of the scheduler, in milliseconds.")
@click.option("--queue-budget-ms", type=click.FloatRange(0.1, 1000), default=2.0, show_default=True,
              envvar="CGPUD_QUEUE_BUDGET_MS",
              help="Gated instances: the GPU work a process may queue ahead, per stream, while the scheduler may "
                   "stop it (a closing's drain lasts about this long; docs/scheduler.md).")
@click.option("--switch", type=click.Choice(["drain", "ahead", "overlap"]), default="drain", show_default=True,
              envvar="CGPUD_SWITCH",
              help="Gated instances: open the next gate once the stopped one's queued work is done, just before "
                   "it is expected to be, or at the closing (docs/scheduler.md, \"Switches\").")
@click.option("--placement", type=click.Choice(["binpack", "spread"]), default="binpack", show_default=True,
              envvar="CGPUD_PLACEMENT",
              help="How containers that name no GPU are placed: the fullest GPU that fits, or the emptiest.")
@click.option("--mode", type=click.Choice(["exclusive", "share", "cgpu", "core_mem", "mps"]), default="cgpu", show_default=True,
              envvar="CGPUD_MODE", help="Node mode for placement (docs/containers.md); mps also drives NVIDIA MPS "
                                         "(docs/mps.md).")
@click.option("--mem-action", type=click.Choice(["kill", "term", "log"]), default="kill", show_default=True,
              envvar="CGPUD_MEM_ACTION",
              help="Real GPUs (nvml): what to do to a process whose instance passes its memsize.")
@click.option("--mps-control", default=None, envvar="CGPUD_MPS_CONTROL", show_default="nvidia-cuda-mps-control in PATH",
              help="--mode mps: the MPS control program to drive.")
@click.option("--mps-pipe-dir", default=None, envvar="CUDA_MPS_PIPE_DIRECTORY",
              help="--mode mps: the MPS pipe directory (CUDA_MPS_PIPE_DIRECTORY) for the daemon and clients.")
@click.option("--metrics-addr", default=DEFAULT_METRICS_ADDR, show_default=True, envvar="CGPUD_METRICS_ADDR",
              help="Where Prometheus metrics are served (HOST:PORT, port 0 = any free one); `off` for none.")
@click.option("--metrics-auth", type=click.Choice(["none", "open", "kubernetes"]), default="none", show_default=True,
              envvar="CGPUD_METRICS_AUTH",
              help="Who reads the per-instance series: none = loopback clients only (others get the GPUs'); "
                   "open = anyone; kubernetes = a bearer token allowed `get` on /metrics (TokenReview, "
                   "SubjectAccessReview), over TLS (docs/metrics.md).")
@click.option("--metrics-tls-cert", default=None, envvar="CGPUD_METRICS_TLS_CERT",
              help="Serve metrics over TLS with this certificate (PEM); kubernetes auth without one: self-signed.")
@click.option("--metrics-tls-key", default=None, envvar="CGPUD_METRICS_TLS_KEY", help="The key of --metrics-tls-cert.")
@click.option("--hook-path", default=DEFAULT_HOOK_PATH, show_default=True, envvar="CGPUD_HOOK_PATH",
              help="The compiled OCI hook that cgpu-runtime puts into the containers it prepares (Docker, containerd).")
@click.option("--libcgpu", default=DEFAULT_LIBCGPU, show_default=True, envvar="CGPUD_LIBCGPU",
              help="The in-container library cgpu-runtime mounts into the containers it prepares (when it exists).")
@click.option("--compute", default="auto", show_default=True, envvar="CGPUD_COMPUTE",
              type=click.Choice(["auto", "gate", "freeze"]),
              help="How a container that carries libcgpu is held to its compute share: gate its kernel launches "
                   "(its CPU side runs on), or freeze its cgroup; auto: gate on real GPUs, freeze on simulated "
                   "ones (their workloads do not launch through CUDA).")
@click.option("--driver-root", default=None, envvar="CGPUD_DRIVER_ROOT",
              help="--gpus nvml in a container without NVIDIA's toolkit: where the host's / is mounted; "
                   "libnvidia-ml.so.1 is loaded from the driver's directories below it when the loader finds none.")
@click.option("--health/--no-health", default=True, show_default=True, envvar="CGPUD_HEALTH",
              help="Watch the GPUs' health (Xid errors, double-bit ECC errors, a lost GPU) and take a failed GPU "
                   "out of service until it recovers (docs/gpus.md, Health).")
@click.option("--health-ignore-xids", default=None, envvar="CGPUD_HEALTH_IGNORE_XIDS",
              show_default="13,31,43,45,68,109",
              help="Comma-separated Xids that do not take a GPU out of service: the application's own errors (NVIDIA's list by default; \"\": none).")
@click.option("--health-quiet", type=click.FloatRange(0, 86400), default=60.0, show_default=True,
              envvar="CGPUD_HEALTH_QUIET", help="Seconds a failed GPU must answer with no new failure to be back.")
@click.option("--health-max-failures", type=click.IntRange(1, 1000), default=3, show_default=True,
              envvar="CGPUD_HEALTH_MAX_FAILURES",
              help="Failures within --health-window after which a GPU stays out of service until cgpud restarts.")
@click.option("--health-window", type=click.FloatRange(1, 10**7), default=3600.0, show_default=True,
              envvar="CGPUD_HEALTH_WINDOW", help="Seconds over which --health-max-failures counts.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def serve(gpus: str, mountpoint: str, state_dir: str, admin_group: str | None, socket_path: str, dev_dir: str,
          rt_priority: int, slice_ms: float, queue_budget_ms: float, switch: str, placement: str, mode: str, mem_action: str, mps_control: str | None,
          mps_pipe_dir: str | None, metrics_addr: str, metrics_auth: str, metrics_tls_cert: str | None,
          metrics_tls_key: str | None, hook_path: str, libcgpu: str, compute: str, driver_root: str | None,
          health: bool, health_ignore_xids: str | None, health_quiet: float, health_max_failures: int,
          health_window: float, log_level: str) -> None:
    """Mount the tree and serve it until SIGTERM or SIGINT."""
    from cgpud.gpus.health import disabled_by_env, parse_xids

    setup_logging(log_level)
    try:
        ignored = None if health_ignore_xids is None else parse_xids(health_ignore_xids)
        off, more = disabled_by_env(os.environ.get("CGPUD_DISABLE_HEALTHCHECKS", ""))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--health-ignore-xids / CGPUD_DISABLE_HEALTHCHECKS") from None
    if more:
        from cgpud.gpus.health import DEFAULT_IGNORED_XIDS

        ignored = (DEFAULT_IGNORED_XIDS if ignored is None else ignored) | more
    if driver_root:
        os.environ["CGPUD_DRIVER_ROOT"] = driver_root  # (every NVML session of the daemon: cgpud.gpus.nvml)
    if dev_dir is None:
        dev_dir = "/dev" if gpus.strip() == "nvml" else default_dev_dir()
    cfg = Config(gpus=gpus, mount=mountpoint, state_dir=state_dir, admin_group=admin_group, socket=socket_path,
                 dev_dir=dev_dir, rt_priority=rt_priority, slice_ms=slice_ms, queue_budget_ms=queue_budget_ms,
                 switch=switch, placement=placement, mode=mode, mem_action=mem_action, mps_control=mps_control,
                 mps_pipe_dir=mps_pipe_dir, metrics_addr=metrics_addr, metrics_auth=metrics_auth,
                 metrics_tls=(metrics_tls_cert, metrics_tls_key) if metrics_tls_cert or metrics_tls_key else None,
                 hook_path=hook_path,
                 libcgpu=libcgpu, compute=compute, health=health and not off, health_ignore_xids=ignored,
                 health_quiet=health_quiet, health_max_failures=health_max_failures, health_window=health_window)
    try:
        status = trio.run(serve_daemon, cfg, clock=MonotonicClock())  # (its times: CLOCK_MONOTONIC's)
    except StartError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        status = 0
    if cfg.successor is not None and in_terminal():
        # handed over by a hot upgrade: stay the process this terminal's Ctrl-C stops
        status = relay(cfg.successor, state_dir)
    if status:
        sys.exit(status)


@main.command()
@click.option("--cold", is_flag=True, help="Stop the daemon so that the service manager starts the installed "
              "code; refused while instances exist.")
@click.option("--mount", "mountpoint", default=default_mount, show_default="/run/cgpu_km as root",
              envvar="CGPUD_MOUNT", help="The running daemon's tree (hot upgrade).")
@click.option("--socket", "socket_path", default=default_socket, show_default="/run/cgpud/cgpud.sock as root",
              envvar="CGPUD_SOCKET", help="The running daemon's control socket (cold upgrade).")
def upgrade(cold: bool, mountpoint: str, socket_path: str) -> None:
    """Upgrade the running daemon to the code installed now (docs/upgrade.md).

    Hot (the default): the same as `echo 1 > <mount>/upgrade`: instances,
    settings, the mount and client connections are kept. Cold: refused while
    instances exist; otherwise the daemon stops and its service manager
    starts the new code."""
    from cgpud.daemon.upgrade import cold_upgrade, hot_upgrade

    click.echo(cold_upgrade(socket_path) if cold else hot_upgrade(mountpoint))


@main.command("clear-mount")
@click.option("--mount", "mountpoint", default=default_mount, show_default="/run/cgpu_km as root",
              envvar="CGPUD_MOUNT", help="The daemon's mount point.")
def clear_mount(mountpoint: str) -> None:
    """Clear a dead mount a crashed daemon left (systemd: ExecStartPre)."""
    from cgpud.daemon.systemd import ServiceError, clear_mount as clear

    try:
        click.echo(clear(mountpoint))
    except ServiceError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--state-dir", default=default_state_dir, show_default="/var/lib/cgpud as root",
              envvar="CGPUD_STATE_DIR", help="The daemon's state directory (its registry of frozen targets).")
def thaw(state_dir: str) -> None:
    """Thaw everything the daemon froze (systemd: ExecStopPost). Exit 1 if one refused."""
    from cgpud.daemon.systemd import ServiceError, thaw_everything

    try:
        results = thaw_everything(state_dir)
    except ServiceError as exc:
        raise click.ClickException(str(exc)) from None
    for entry, outcome in results:
        what = entry.get("path") or entry.get("pgid") or entry.get("name") if isinstance(entry, dict) else entry
        click.echo(f"{what}: {outcome}")
    if not results:
        click.echo("nothing frozen by cgpud")
    if any(outcome.startswith("refused") for _, outcome in results):
        sys.exit(1)
