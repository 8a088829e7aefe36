"""`cgpu`: the user's tool."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time

import click

from cgpud import __version__
from cgpud.client import Client, ControlError, DaemonUnavailable
from cgpud.cli.common import Ctx, pass_ctx
from cgpud.core.units import parse_size


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cgpu")
@click.option("--socket", envvar="CGPUD_SOCKET", default=None, help="The daemon's control socket.")
@click.pass_context
def main(ctx: click.Context, socket: str | None) -> None:
    """cgpu: work with a cgpud node."""
    ctx.obj = Ctx(socket)


def _gpu_list(gpu: int | None, gpus: str | None) -> list[int]:
    if gpu is not None and gpus is not None:
        raise click.UsageError("give --gpu or --gpus, not both")
    if gpus is not None:
        try:
            return [int(x) for x in gpus.split(",")]
        except ValueError:
            raise click.UsageError(f"--gpus {gpus}: expected GPU indices like 0,1") from None
    return [gpu if gpu is not None else 0]


@main.command(context_settings={"allow_interspersed_args": False})
@click.option("--gpu", type=int, default=None, help="The GPU to run on (default 0).")
@click.option("--gpus", default=None, help="Several GPUs: 0,1.")
@click.option("--mem", default=None, help="GPU memory per GPU: 6G, 512M, bytes (default: default_memsize).")
@click.option("--weight", type=int, default=1, show_default=True, help="Compute weight, 0..max_inst.")
@click.option("--highprio", is_flag=True, help="High priority: takes the GPU when active, up to prio_ratio %.")
@click.option("--core", "percentage", type=int, default=None,
              help="core_mem: this percentage of the GPU's compute, fixed (a multiple of 5, 5..100; "
                   "docs/scheduler.md). Replaces --weight.")
@click.option("--name", default=None, help="Instance name: 12 characters of [0-9A-Za-z_.-] (default: random).")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@pass_ctx
def run(ctx: Ctx, gpu, gpus, mem, weight, highprio, percentage, name, cmd) -> None:
    """Run CMD as an instance, in a cgroup of its own, until it exits.

    The instance is registered before CMD starts and removed when it exits
    (also when CMD is killed). CMD sees CGPU_INSTANCE, CGPU_GPUS and
    CGPU_DEVICE (the simulated GPU's device file) in its environment, and,
    when the daemon has the in-container library, LD_PRELOAD and
    CGPU_PAGE_DIR: CMD's CUDA is held to its memsize (docs/isolation.md).
    """
    gpu_ids = _gpu_list(gpu, gpus)
    try:
        memsize = parse_size(mem) if mem is not None else None
    except ValueError as exc:
        raise click.UsageError(f"--mem: {exc}") from None
    name = name or secrets.token_hex(6)
    core = {}
    if percentage is not None:
        if not 5 <= percentage <= 100 or percentage % 5:
            raise click.UsageError(f"--core {percentage}: give a multiple of 5 from 5 to 100")
        weight, core = percentage // 5, {"policy": 3, "core": True}
    # The connection stays open for as long as CMD runs: it tells the daemon
    # this instance is still wanted (an instance whose cgroup is empty and
    # whose connection is gone is removed by the daemon).
    c = ctx.client()
    try:
        res = c.call("register", name=name, gpus=gpu_ids, memsize=memsize, weight=weight,
                     highprio=highprio, cgroup=True, isolate=True, **core)
        devices = c.call("hello")["devices"]
    except ControlError as exc:
        c.close()
        raise click.ClickException(f"cannot register {name}: {exc}") from None
    procs = os.path.join(res["target"]["path"], "cgroup.procs")
    for inst in res.get("instances", []):
        if inst.get("weight", weight) < weight:  # (SPEC §4: a new instance gets min(asked, free_weight))
            click.echo(f"cgpu run: {name} got weight {inst['weight']} on GPU {inst['gpu']}, not {weight}: the GPU's "
                       f"free_weight was {inst['weight']}"
                       + ("; with weight 0 it gets no compute under policies 2 and 3" if inst["weight"] == 0 else ""),
                       err=True)

    def join_cgroup() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    env = dict(os.environ, CGPU_INSTANCE=name, CGPU_GPUS=",".join(map(str, gpu_ids)))
    env.update(res.get("env") or {})  # mps mode: the instance's MPS limits (docs/mps.md)
    isolation = (res.get("isolation") or {}).get("env") or {}  # libcgpu and its pages (docs/isolation.md)
    if isolation:
        preload = [isolation["LD_PRELOAD"], *[p for p in env.get("LD_PRELOAD", "").split() if p]]
        env.update(isolation, LD_PRELOAD=" ".join(dict.fromkeys(preload)))
    if devices:
        env["CGPU_DEVICE"] = devices[gpu_ids[0]]
    code = 127
    try:
        try:
            child = subprocess.Popen(list(cmd), env=env, preexec_fn=join_cgroup)
        except OSError as exc:
            raise click.ClickException(f"cannot run {cmd[0]}: {exc.strerror}") from None
        except subprocess.SubprocessError:
            raise click.ClickException(f"cannot put {cmd[0]} into the instance's cgroup {procs}") from None
        # Ctrl-C reaches CMD directly (same process group); SIGTERM/SIGHUP sent
        # to us are passed on.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda s, f: child.send_signal(s))
        rc = child.wait()
        code = rc if rc >= 0 else 128 - rc
    finally:
        _deregister(c, ctx.socket, name)
    sys.exit(code)


def _deregister(c: Client, socket: str | None, name: str) -> None:
    try:
        try:
            c.call("deregister", name=name)
        except DaemonUnavailable:  # the daemon was restarted meanwhile: ask the new one
            with Client(socket) as fresh:
                fresh.call("deregister", name=name)
    except (DaemonUnavailable, ControlError) as exc:
        click.echo(f"cgpu: could not deregister {name} ({exc}); the daemon removes it once its processes are gone",
                   err=True)
    finally:
        c.close()


@main.command()
@click.option("--seconds", type=float, default=10.0, show_default=True, help="How long to run.")
@click.option("--gpu", type=int, default=None, help="Which simulated GPU (default: $CGPU_GPUS's first, or 0).")
@click.option("--device", default=None, envvar="CGPU_DEVICE", help="The device file to hold open.")
@click.option("--interval", type=float, default=0.0, help="Also print the rate every INTERVAL seconds.")
@click.option("--mem", default=None, help="Also hold this much of the instance's GPU memory while running: 1G, 512M, bytes.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@pass_ctx
def workload(ctx: Ctx, seconds, gpu, device, interval, mem, as_json) -> None:
    """A stand-in GPU job: opens the simulated GPU, runs fixed-size kernels,
    prints iterations per second. With --mem it allocates that much GPU memory
    at the start (failing at once if it does not fit) and holds it to the end."""
    from cgpud.gpus.gpumem import NotInInstanceError, default_gpu
    from cgpud.gpus.workload import run as run_workload

    try:
        nbytes = parse_size(mem) if mem is not None else 0
    except ValueError as exc:
        raise click.UsageError(f"--mem: {exc}") from None
    mem_gpu = gpu if gpu is not None else default_gpu()
    if device is None or gpu is not None:
        index = gpu if gpu is not None else int(os.environ.get("CGPU_GPUS", "0").split(",")[0])
        with ctx.client() as c:
            devices = c.call("hello")["devices"]
        if not 0 <= index < len(devices):
            raise click.ClickException(f"no simulated GPU {index} (the daemon has {len(devices)})")
        device = devices[index]
        mem_gpu = index
    with _memory_errors():
        try:
            run_workload(device, seconds, interval, as_json, mem=nbytes, gpu=mem_gpu, socket=ctx.socket)
        except NotInInstanceError:
            raise
        except OSError as exc:
            raise click.ClickException(f"cannot open the GPU device {device}: {exc.strerror}") from None


# ---- simulated GPU memory (docs/memory.md) ------------------------------------


@contextlib.contextmanager
def _memory_errors():
    """The memory library's errors as one line each."""
    from cgpud.gpus.gpumem import NotInInstanceError, OutOfMemoryError

    try:
        yield
    except OutOfMemoryError as exc:
        raise click.ClickException(f"out of memory: {exc}") from None
    except NotInInstanceError as exc:
        raise click.ClickException(str(exc)) from None
    except DaemonUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    except ControlError as exc:
        raise click.ClickException(f"{exc} ({exc.error})") from None


def _mib(n: int) -> str:
    return f"{n >> 20}MiB"


@main.group()
def mem() -> None:
    """The GPU memory of this process's instance (simulated GPUs).

    Run inside an instance (`cgpu run -- cgpu mem info`): the instance's memsize
    is its total, as nvidia-smi shows it inside a cGPU container.
    """


@mem.command("info")
@click.option("--gpu", type=int, default=None, help="Which GPU (default: $CGPU_GPUS's first, or the instance's lowest).")
@click.option("--json", "as_json", is_flag=True, help="Print gpu, instance, free, total, used (bytes) as JSON.")
@pass_ctx
def mem_info(ctx: Ctx, gpu, as_json) -> None:
    """Free and total GPU memory of the caller's instance."""
    from cgpud.gpus.gpumem import SimGpu

    with _memory_errors():
        with SimGpu(gpu, ctx.socket) as g:
            i = g.info()
    if as_json:
        click.echo(json.dumps({"gpu": i.gpu, "instance": i.instance, "free": i.free, "total": i.total, "used": i.used}))
    else:
        click.echo(f"GPU {i.gpu} ({i.instance}): {_mib(i.used)} / {_mib(i.total)} used, {_mib(i.free)} free"
                   f" ({i.free} of {i.total} bytes)")


@mem.command("hold")
@click.argument("size")
@click.option("--seconds", type=float, default=None, help="Hold this long, then free and exit (default: until killed).")
@click.option("--gpu", type=int, default=None, help="Which GPU (default: $CGPU_GPUS's first, or the instance's lowest).")
@pass_ctx
def mem_hold(ctx: Ctx, size, seconds, gpu) -> None:
    """Allocate SIZE (1G, 512M, bytes) of the instance's GPU memory and hold it.

    Prints one line once it holds it. Past the instance's memsize it fails with
    "out of memory: …". The memory is returned when this exits, however it exits.
    """
    from cgpud.gpus.gpumem import SimGpu

    try:
        nbytes = parse_size(size)
    except ValueError as exc:
        raise click.UsageError(f"SIZE: {exc}") from None
    if nbytes <= 0:
        raise click.UsageError("SIZE: hold at least one byte")
    if seconds is not None and seconds < 0:
        raise click.UsageError("--seconds must not be negative")
    with _memory_errors():
        with SimGpu(gpu, ctx.socket) as g:
            a = g.alloc(nbytes)
            free, total = g.mem_info()
            click.echo(f"holding {nbytes} bytes on GPU {a.gpu} as pid {os.getpid()}: "
                       f"{_mib(free)} free of {_mib(total)}")
            sys.stdout.flush()
            try:
                if seconds is None:
                    while True:
                        time.sleep(3600)
                else:
                    time.sleep(seconds)
            except KeyboardInterrupt:
                sys.exit(130)


# ---- the OCI runtime hook (docs/containers.md) ----------------------------------


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("stage", metavar="[createRuntime|prestart|poststop|auto]", required=False, default="auto")  # checked by the hook
@click.argument("rest", nargs=-1, type=click.UNPROCESSED)
@pass_ctx
def hook(ctx: Ctx, stage, rest) -> None:
    """OCI runtime hook: forwards the OCI state on stdin to the daemon, which
    registers the container from its ALIYUN_COM_GPU_* environment and attaches
    its own cgroup (createRuntime or prestart), removes it (poststop), or
    either by the state's status (auto, or no stage at all: a hooks entry
    written as `args: ["cgpu", "hook"]` works). The compiled `cgpu-hook`
    does the same without Python's start-up.

    A bad value fails with one line naming the variable. With
    CGPU_HOOK_PASSTHROUGH=1 a container starts unmanaged when the daemon is
    down; CGPU_HOOK_TIMEOUT (default 5 s) bounds every wait for the daemon.
    """
    from cgpud.containers.hook import main as hook_main

    sys.exit(hook_main(stage, sys.stdin, ctx.socket))


# ---- monitoring (docs/monitoring.md) ---------------------------------------------


def _ask(ctx: Ctx, op: str, **args):
    """One read-only request; a missing daemon or a refusal is one line."""
    with ctx.client() as c:
        try:
            return c.call(op, **args)
        except DaemonUnavailable as exc:
            raise click.ClickException(str(exc)) from None
        except ControlError as exc:
            raise click.ClickException(f"{exc} ({exc.error})") from None


@main.command()
@click.option("-d", "--details", is_flag=True, help="Per instance: its GiB on each GPU.")
@click.option("--json", "as_json", is_flag=True, help="Print the allocation as JSON.")
@pass_ctx
def inspect(ctx: Ctx, details, as_json) -> None:
    """The node's GPU memory allocation, like `kubectl inspect cgpu`:
    allocated/total GiB per GPU and for the node."""
    import socket as _socket

    from cgpud.observe.inspect import allocation, detail, primary_ipv4, summary

    node = allocation(_ask(ctx, "query"), _socket.gethostname(), primary_ipv4())
    if as_json:
        click.echo(json.dumps(node, indent=2))
    else:
        click.echo(detail([node]) if details else summary([node]))


@main.command()
@click.option("--seconds", type=float, default=10.0, show_default=True,
              help="How far back (at most 60: the daemon keeps the last 60 s of slices).")
@click.option("--gpu", type=int, default=None, help="Only this GPU (default: every GPU).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the timeline picture here (SVG).")
@click.option("--json", "as_json", is_flag=True, help="Print the slices and each instance's intervals as JSON.")
@pass_ctx
def trace(ctx: Ctx, seconds, gpu, output, as_json) -> None:
    """A timeline of who had each GPU when over the last SECONDS: one lane per
    instance (ran / held its slot idle / frozen waiting), the GPU's unused time,
    the policy. Give -o FILE.svg, --json, or both (from the same slices)."""
    from cgpud.observe.trace import summary as trace_summary, svg

    if output is None and not as_json:
        raise click.UsageError("give -o FILE.svg for the picture, or --json for the intervals")
    summ = trace_summary(_ask(ctx, "trace", seconds=seconds, gpu=gpu))
    if output is not None:
        try:
            with open(output, "w") as f:
                f.write(svg(summ))
        except OSError as exc:
            raise click.ClickException(f"cannot write {output}: {exc.strerror}") from None
    if as_json:
        click.echo(json.dumps(summ))
    else:
        for g in summ["gpus"]:
            ran = ", ".join(f"{n} {t['run']:.2f} s" for n, t in g["totals"].items() if t["run"] > 0) or "nobody ran"
            click.echo(f"GPU {g['gpu']} (policy {g['policy']}): {len(g['slices'])} slices; {ran}")
        click.echo(f"wrote {output}")


def _add_commands() -> None:
    from cgpud.cli import host, k8s, node

    for cmd in (host.runtime_config, host.doctor, node.node, k8s.device_plugin, k8s.dra_plugin, k8s.dra_webhook,
                k8s.scheduler_extender):
        main.add_command(cmd)


_add_commands()
