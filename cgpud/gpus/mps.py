"""MPS mode (`cgpud serve --mode mps`, SPEC §6): NVIDIA's Multi-Process Service
as the isolation layer. docs/mps.md.

The daemon drives `nvidia-cuda-mps-control` (`--mps-control PATH`, default
the one in PATH):

- at start: `nvidia-cuda-mps-control -d` starts the MPS control daemon; then,
  one command per invocation on its standard input, the node's defaults:
  `set_default_device_pinned_mem_limit <gpu> <MiB>M` per GPU and
  `set_default_active_thread_percentage <pct>` — what an instance made with
  the tree's defaults gets (memsize `default_memsize`, 0 = the whole GPU;
  weight 1 of max_inst). They are sent again when those settings change
  (they apply to MPS servers started afterwards, as NVIDIA documents);
- each instance's own limits are environment variables of its processes
  (`client_env`): CUDA_VISIBLE_DEVICES (its GPUs' UUIDs, so that CUDA
  ordinals 0..k-1 are its GPUs in order), CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
  (`0=<MiB>M,1=…`: its memsize per GPU) and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
  (its share: weight / max_inst, rounded up, at least 1, the smallest over its
  GPUs); `cgpu run` puts them into CMD's environment;
- at stop: `quit`. A marker in the state directory says a control daemon we
  started runs: after a crash of ours (the marker is still there and `-d`
  fails) the next start takes that daemon over instead of refusing.

Sizes are floored to whole MiB (MPS takes M or G); a limit is never below 1M.
"""
from __future__ import annotations

import logging
import math
import os
import shutil

import trio

from cgpud.core.model import Node

log = logging.getLogger("cgpud")

PROGRAM = "nvidia-cuda-mps-control"
ENV_MEM = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ENV_THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_PIPE = "CUDA_MPS_PIPE_DIRECTORY"
TIMEOUT = 10.0  # s for one invocation of the control program


class MpsError(Exception):
    """The MPS control daemon cannot be driven; str() is one line."""


def limit_mib(nbytes: int) -> str:
    return f"{max(1, nbytes >> 20)}M"


def thread_percentage(weight: int, max_inst: int) -> int:
    """An instance's share of the GPU's threads: weight / max_inst, in 1..100 %."""
    return max(1, min(100, math.ceil(100 * weight / max_inst)))


def client_env(node: Node, name: str, pipe_dir: str | None = None) -> dict[str, str]:
    """The environment that makes the processes of instance `name` MPS clients
    with its limits (empty when there is no such instance)."""
    insts = sorted(node.instances_named(name), key=lambda i: i.gpu)
    if not insts:
        return {}
    gpus = [node.gpu(i.gpu) for i in insts]
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(g.info.uuid for g in gpus),
        ENV_MEM: ",".join(f"{k}={limit_mib(i.memsize)}" for k, i in enumerate(insts)),
        ENV_THREADS: str(min(thread_percentage(i.weight, g.max_inst) for i, g in zip(insts, gpus))),
    }
    if pipe_dir:
        env[ENV_PIPE] = pipe_dir
    return env


def default_commands(node: Node) -> list[str]:
    """The node-level defaults: what a client without its own limits gets."""
    cmds = [f"set_default_device_pinned_mem_limit {g.index} {limit_mib(node.default_memsize or g.info.memory)}"
            for g in node.gpus]
    cmds.append(f"set_default_active_thread_percentage {min(thread_percentage(1, g.max_inst) for g in node.gpus)}")
    return cmds


def find_program(path: str | None) -> str:
    found = shutil.which(path or PROGRAM)
    if found is None:
        if path:
            raise MpsError(f"--mps-control {path}: no such executable")
        raise MpsError(f"--mode mps: {PROGRAM} is not in PATH; install the NVIDIA driver's compute utilities "
                       f"or give --mps-control PATH")
    return found


class MpsControl:
    """The MPS control daemon, for as long as `run` runs."""

    def __init__(self, node: Node, program: str | None = None, pipe_dir: str | None = None,
                 state_dir: str | None = None) -> None:
        self.node = node
        # Exists while a control daemon we started runs: after a crash of ours, we take it over.
        self.marker = os.path.join(state_dir, "mps-started") if state_dir else None
        self.program = find_program(program)
        self.pipe_dir = pipe_dir
        self.env = dict(os.environ)
        if pipe_dir:
            self.env[ENV_PIPE] = pipe_dir
        self._sent: list[str] = []
        self._changed = trio.Event()
        self.keep = False  # set when a hot upgrade hands the control daemon on

    def client_env(self, name: str) -> dict[str, str]:
        return client_env(self.node, name, self.pipe_dir)

    def changed(self) -> None:
        """A Durable listener: settings may have changed."""
        self._changed.set()

    async def _invoke(self, args: list[str], stdin: bytes = b"") -> str:
        try:
            with trio.fail_after(TIMEOUT):
                r = await trio.run_process([self.program, *args], stdin=stdin, capture_stdout=True,
                                           capture_stderr=True, check=False, env=self.env)
        except trio.TooSlowError:
            raise MpsError(f"{self.program} {' '.join(args) or stdin.decode().strip()}: no answer in {TIMEOUT:g} s") from None
        except OSError as exc:
            raise MpsError(f"cannot run {self.program}: {exc.strerror}") from None
        out = (r.stdout + r.stderr).decode(errors="replace").strip()
        if r.returncode != 0:
            what = " ".join(args) if args else stdin.decode().strip()
            raise MpsError(f"{self.program} {what}: exit {r.returncode}" + (f": {out.splitlines()[-1]}" if out else ""))
        return out

    async def send(self, command: str) -> str:
        """One command on the control daemon's standard input (as `echo CMD | nvidia-cuda-mps-control`)."""
        out = await self._invoke([], (command + "\n").encode())
        log.debug("mps: %s -> %s", command, out or "(nothing)")
        return out

    async def _send_defaults(self) -> None:
        cmds = default_commands(self.node)
        for cmd in cmds:
            if cmd not in self._sent:
                await self.send(cmd)
        if cmds != self._sent:
            log.info("mps: node defaults: %s", "; ".join(cmds))
        self._sent = cmds

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._invoke(["-d"])
        except MpsError as exc:
            if not (self.marker and os.path.exists(self.marker)):
                raise MpsError(f"cannot start the MPS control daemon: {exc}; if one is running already, stop it "
                               f"(echo quit | {PROGRAM})") from None
            log.warning("mps: %s; it is the one a previous cgpud started and did not stop: taking it over", exc)
        if self.marker:
            with open(self.marker, "w"):
                pass
        try:
            await self._send_defaults()
            log.info("mps: control daemon started (%s)", self.program)
            task_status.started()
            while True:
                await self._changed.wait()
                self._changed = trio.Event()
                try:
                    await self._send_defaults()
                except MpsError as exc:
                    log.error("mps: %s", exc)
        finally:
            if not self.keep:  # kept by a hot upgrade: the marker tells the next daemon it is ours
                with trio.CancelScope(shield=True):
                    try:
                        await self.send("quit")
                        if self.marker:
                            os.unlink(self.marker)
                        log.info("mps: control daemon stopped")
                    except MpsError as exc:
                        log.error("mps: %s", exc)
