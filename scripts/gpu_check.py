"""make gpu-check: cgpud on a machine with an NVIDIA GPU, with the real driver (issues 23, 27 and 28).

It starts the daemon on the real GPUs (`cgpud serve --gpus nvml --compute gate`, in a temporary
directory of its own, with libcgpu built here or named by --libcgpu), and runs through `cgpu run`
(so through libcgpu, held to a memsize of 2 GiB unless a row says otherwise) whatever of
cuda-bindings, PyTorch (with torchvision), CuPy, JAX and nvidia-smi is installed here, installing
nothing. The rows, in the order they run (`--list` prints their keys; `--only KEYS` runs some):

  daemon              the daemon up: its version, the GPUs, where libfuse3 and the gate's native
                      part came from
  memsize shown       the card's memory as the instance sees it is its memsize
  oom                 allocating up to memsize, then an out-of-memory error (the process lives);
                      what it got is at least what it was told was free at its start, less the
                      headroom (3 % of memsize) and one allocation (on the H100 the context is
                      ~610 MiB: "1472 of 2048 MiB, then out-of-memory" passes)
  torch allocator     PyTorch's caching allocator with expandable_segments:True
  fill (issue 28)     JAX at its defaults (preallocation, a matmul, jit autotuning); PyTorch
                      capturing and replaying CUDA graphs beside a neighbour; ResNet-50 training
                      at doubling batches in a tight instance: each ends in out-of-memory or
                      runs, the process alive, never killed
  fill (issue 45)     where the driver grows on its own: a fragmented stream-ordered pool, the stack
                      limit raised, graph memory at a graph's first replay (PyTorch's cudaMallocAsync
                      backend), 200 lazily loaded modules: each ends in out-of-memory or runs, the
                      process alive, never killed
  nvidia-smi          memory.total inside the instance is its memsize; its process list (the
                      query and the default screen) inside an instance leaves out a neighbour
                      instance holding 3 GiB (listed outside)
  graphs              a CUDA graph captured in the global mode (PyTorch's; CuPy's with the mode
                      named) and replayed while the gate closes (a neighbour on the same GPU,
                      policy 1): no capture invalidated, replays correct
  share 1:2           two instances at weights 1 and 2 under policy 2, their kernels completed
                      over the same window (host timestamps at each synchronize) split 1:2
                      within 5 pp: PyTorch's deep queue (8 x 4096^2 fp32 matmul, then
                      synchronize) and CuPy's microsecond kernels
  high priority       a high-priority instance's small kernel, launch to completion, while a
                      weight-1 neighbour runs ahead (64 matmuls queued between synchronizes):
                      p50 and p99, p99 <= 5 ms
  alone               one instance alone under the gate against the same job without cgpud: >= 99 %
  mps                 NVIDIA's MPS (issue 37), a control daemon of the row's own: a client pinned to
                      512 MiB (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) gets at most that, then out-of-memory;
                      clients at CUDA_MPS_ACTIVE_THREAD_PERCENTAGE 25 and 50, both busy, complete
                      1:2 of their kernels over the same window (within 5 pp); SKIP without
                      nvidia-cuda-mps-control
  ResNet-50           torchvision's ResNet-50 (random weights and data): training with AMP at
                      batch 16, 64, 128 and fp16 inference at batch 1, 8, 64, each alone, then
                      as a pair at weights 1:2 under policy 2 (img/s over the same ~3 s
                      windows): the ratio 2.00 +- 0.04, the pair's sum >= 97 % of the job alone

Each row has a time budget: an instance still running at its end is killed (every process of
its cgroup) and the row fails with "timed out"; a row that fails says why (the instance's own
error, the daemon's log line about it). Rows print as they complete (a run stopped at a time limit
still shows what it measured), each with its seconds; the whole run keeps to --time-limit (450 s
by default: an 8-minute slot on one GPU, with the bundle's install and the daemon's start).
Instance names carry a token of the run (instance cgroups are host-wide). It exits 1 if any row
failed, else 0. On a machine without an NVIDIA GPU it says so in one line and exits 77 (nothing
checked: the "skipped" code of automake and meson, so that a CI job tells it from a pass).
docs/isolation.md, "Running the real-GPU check".

    make gpu-check                       (or: .venv/bin/python scripts/gpu_check.py [options])
    make gpu-check BUNDLE=gpu-bundle     on a GPU machine without cgpud's dependencies
                                         (scripts/gpu_check.sh; make gpu-bundle builds it)

`--gpus sim:T4` (with LD_LIBRARY_PATH naming the stand-in driver, native/stubs) runs the same
checks where there is no GPU: tests/test_gpu_check.py does.
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
NO_GPU = 77
MIB = 1 << 20
MEMSIZE = 2 << 30
HEADROOM = 0.03  # (of memsize: what libcgpu keeps for the driver's own growth, issue 28)
CONTEXT = 640 * MIB  # (a context where the process cannot say: the H100's is ~610 MiB)
TIME_LIMIT = 450.0
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclasses.dataclass
class Row:
    check: str
    result: str  # PASS, FAIL or SKIP
    detail: str
    seconds: float = 0.0


@dataclasses.dataclass
class Check:
    """One check: its key (for --only), the row it gives (or the rows: `rows`), its time budget in
    seconds, and what runs it: fn() gives (result, detail), or a list of Rows when it has several."""
    key: str
    name: str
    budget: float
    fn: Callable[[], tuple[str, str] | list[Row]]
    rows: Sequence[str] = ()

    def names(self) -> list[str]:
        return list(self.rows) or [self.name]


class CheckTimeout(Exception):
    pass


def no_gpu_reason(proc: Path = Path("/proc/driver/nvidia/version")) -> str | None:
    """Why this machine has no NVIDIA GPU to check (None: it has one)."""
    if not proc.exists():
        return f"no NVIDIA driver ({proc} is missing)"
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            n = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # (NVML missing or refusing: no GPU to check either way)
        return f"NVML: {exc}"
    return None if n else "NVML sees no GPU"


HEAD = ("check", "result", "time", "detail")


def cells(r: Row) -> tuple[str, str, str, str]:
    return r.check, r.result, f"{r.seconds:.1f} s", r.detail


def table(rows: Iterable[Row]) -> str:
    """The rows as one Markdown table (what docs/isolation.md keeps)."""
    rows = [cells(r) for r in rows]
    w = [max(len(h), *(len(c[i]) for c in rows)) if rows else len(h) for i, h in enumerate(HEAD)]
    line = lambda c: "| " + " | ".join(f"{v:<{w[i]}}" for i, v in enumerate(c)) + " |"  # noqa: E731
    return "\n".join([line(HEAD), "|" + "|".join("-" * (n + 2) for n in w) + "|"] + [line(c) for c in rows])


def exit_code(rows: Iterable[Row]) -> int:
    return 1 if any(r.result == FAIL for r in rows) else 0


def first_line(exc: BaseException) -> str:
    return (f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__])[0][:300]


class Report:
    """Rows as they complete: one Markdown line each on stdout, flushed (the check column as wide as
    the longest name to come), and the whole table rewritten into `out` after each."""

    def __init__(self, names: Sequence[str], out: Path | None = None, stream=None) -> None:
        self.w = max([len(HEAD[0]), *map(len, names)])
        self.out, self.stream, self.rows = out, stream or sys.stdout, []

    def line(self, c: Sequence[str]) -> str:
        return f"| {c[0]:<{self.w}} | {c[1]:<6} | {c[2]:>7} | {c[3]} |"

    def begin(self) -> None:
        print(self.line(HEAD), file=self.stream)
        print(f"|{'-' * (self.w + 2)}|--------|---------|--------|", file=self.stream, flush=True)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(self.line(cells(row)), file=self.stream, flush=True)
        if self.out:
            self.out.write_text(table(self.rows) + "\n")


def run_checks(checks: Iterable[Check], report: Report | None = None, limit: float | None = None,
               node=None) -> list[Row]:
    """Each check in turn, within its budget and what is left of `limit` seconds: a check that
    raises has failed, its error in the row; one that finds no time left is SKIP. After each, the
    node kills what the check left running."""
    checks = list(checks)
    report = report or Report([n for c in checks for n in c.names()], stream=open(os.devnull, "w"))
    end = time.monotonic() + limit if limit else None
    for c in checks:
        t0 = time.monotonic()
        budget = c.budget if end is None else min(c.budget, end - t0)
        if budget < min(10.0, c.budget):
            for n in c.names():
                report.add(Row(n, SKIP, f"no time left (--time-limit {limit:.0f} s)"))
            continue
        if node is not None:
            node.deadline = t0 + budget
        try:
            got = c.fn()
            rows = got if isinstance(got, list) else [Row(c.name, *got)]
        except Exception as exc:
            rows = [Row(n, FAIL, first_line(exc)) for n in c.names()]
        finally:
            left = node.reap() if node is not None else []
        if left:
            rows = [dataclasses.replace(r, detail=f"{r.detail}; killed what it left running: {', '.join(left)}")
                    for r in rows]
        took = time.monotonic() - t0
        for r in rows:
            r.seconds = r.seconds or took
            report.add(r)
    return report.rows


def select(checks: Sequence[Check], only: str | None) -> list[Check]:
    """The checks whose key matches one of the comma-separated patterns (a glob or a key's start)."""
    if not only:
        return list(checks)
    pats = [p.strip() for p in only.split(",") if p.strip()]
    return [c for c in checks if any(fnmatch.fnmatchcase(c.key, p) or c.key.startswith(p) for p in pats)]


# ---- the real GPU --------------------------------------------------------------------------------

class Pythons(dict):
    """module -> a Python here that imports it (None: none does), looked for when first asked."""

    def __missing__(self, module: str) -> str | None:
        self[module] = python_with(module)
        return self[module]


def python_with(module: str) -> str | None:
    """A Python here that imports `module`: this one, else python3 on PATH."""
    for py in dict.fromkeys([sys.executable, shutil.which("python3") or ""]):
        if py and subprocess.run([py, "-c", f"import {module}"], capture_output=True).returncode == 0:
            return py
    return None


def program(name: str) -> str:
    """cgpud's programs: beside this Python (.venv/bin), else on PATH (a bundle's site/bin)."""
    found = shutil.which(name, path=os.fspath(BIN)) or shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found beside {sys.executable} or on PATH")
    return found


def error_of(out: str, err: str, rc: int | None) -> str:
    """What an instance that failed said: a Python traceback's last line, cgpu's "Error: ...", else
    the last line on stderr, else its exit status."""
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^(Error: |[A-Za-z_.]*(Error|Exception|Exhausted|Interrupt)\b)", ln):
            return ln[:300]
    if lines:
        return lines[-1][:300]
    if rc is not None and rc >= 128:
        return f"exit {rc} (signal {rc - 128}{', SIGKILL' if rc == 137 else ''})"
    return f"exit {rc}"


def timing(gpus: str, quick: bool) -> tuple[float, float]:
    """The timed checks' (startup, window) in seconds: what an instance takes to come up (PyTorch and
    CUDA: seconds), then what is measured."""
    return (4, 6) if quick else ((12, 10) if gpus == "nvml" else (15, 20))


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (from /proc's parent links)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            kids.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


class Node:
    """The daemon on the real GPUs, and instances run through `cgpu run`, named with a token of
    this run; each started one is killed (its whole cgroup) at the end of its check if still there."""

    def __init__(self, work: Path, gpus: str = "nvml", quick: bool = False, libcgpu: str | None = None) -> None:
        self.work = work
        self.gpus = gpus
        self.quick = quick
        self.startup, self.seconds = timing(gpus, quick)
        self.token = secrets.token_hex(3)
        self.count = 0
        self.deadline = float("inf")
        self.started: list[tuple[str, subprocess.Popen]] = []
        if libcgpu:
            self.libcgpu = Path(libcgpu).resolve()
            if not self.libcgpu.is_file():
                raise RuntimeError(f"--libcgpu {libcgpu}: no such file")
        else:
            lib = work / "lib"
            r = subprocess.run(["make", "-s", "-C", os.fspath(ROOT / "native"), "libcgpu", f"LIB={lib}"],
                               capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"building libcgpu failed (a machine without zig: --libcgpu PATH): {r.stderr.strip()}")
            self.libcgpu = lib / "libcgpu.so"
        (work / "mnt").mkdir()
        self.socket = work / "cgpud.sock"
        self.log = work / "cgpud.log"
        self.cgpu = program("cgpu")
        self.proc = subprocess.Popen([program("cgpud"), "serve", "--gpus", gpus, "--compute", "gate",
                                      "--libcgpu", os.fspath(self.libcgpu), "--mount", os.fspath(work / "mnt"),
                                      "--state-dir", os.fspath(work / "state"), "--socket", os.fspath(self.socket),
                                      "--metrics-addr", "off",
                                      *([] if gpus == "nvml" else ["--dev-dir", os.fspath(work / "dev")])],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
        deadline = time.monotonic() + 30
        while not (work / "mnt" / "version").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cgpud did not start: {self.log.read_text().strip()[-300:]}")
            time.sleep(0.1)

    def name(self, role: str) -> str:
        """An instance name of this run: the run's token, three letters of the role, a count (12
        characters, what `cgpu run --name` takes)."""
        self.count += 1
        return f"{self.token}{(role + '___')[:3]}{self.count:03d}"

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def write(self, rel: str, value: str) -> None:
        (self.work / "mnt" / rel).write_text(value)

    def stats(self) -> dict:
        from cgpud.client import Client
        with Client(os.fspath(self.socket)) as c:
            return c.call("stats")[0]

    def daemon_says(self, name: str) -> str:
        """The daemon's last memory-watchdog line about an instance ('' if none)."""
        try:
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines()
                     if name in ln and "memory watchdog" in ln]
        except OSError:
            return ""
        return lines[-1].strip()[:300] if lines else ""

    def start(self, role: str, argv: list[str], weight: int = 1, env: dict | None = None, mem: int = MEMSIZE,
              highprio: bool = False, name: str | None = None) -> subprocess.Popen:
        name = name or self.name(role)
        e = {k: v for k, v in {**os.environ, "CGPUD_SOCKET": os.fspath(self.socket), **(env or {})}.items()
             if v is not None}  # (None: unset)
        if self.gpus != "nvml":  # the stand-in driver keeps the simulated GPU's device open, as a driver does
            argv = ["sh", "-c", 'CGPU_STUB_CUDA_DEVICE="$CGPU_DEVICE" exec "$@"', "sh", *argv]
        p = subprocess.Popen([self.cgpu, "run", "--name", name, "--gpu", "0", "--mem", str(mem),
                              "--weight", str(weight), *(["--highprio"] if highprio else []), "--", *argv],
                             env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        p.instance = name  # type: ignore[attr-defined]
        self.started.append((name, p))
        return p

    def wait(self, p: subprocess.Popen, timeout: float | None = None) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of a started instance, within the check's budget: past it,
        the instance is killed and CheckTimeout says so."""
        limit = self.remaining() if timeout is None else min(timeout, self.remaining())
        limit = None if limit == float("inf") else limit
        t0 = time.monotonic()
        try:
            out, err = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            name = getattr(p, "instance", "?")
            took = time.monotonic() - t0
            self.kill(p)
            out, err = p.communicate()
            self.keep_output(p, out, err)
            said = error_of("", err, None) if err.strip() else ""
            raise CheckTimeout(f"timed out after {took:.0f} s (its budget); instance {name} "
                               f"killed{': ' + said if said else ''}") from None
        return p.returncode, out, err

    def keep_output(self, p: subprocess.Popen, out: str, err: str) -> None:
        """An instance's whole output, into the working directory's instances/ (--keep keeps it)."""
        d = self.work / "instances"
        d.mkdir(exist_ok=True)
        (d / f"{getattr(p, 'instance', p.pid)}.log").write_text(f"exit {p.returncode}\n--- stdout\n{out}\n--- stderr\n{err}")

    def result(self, p: subprocess.Popen, timeout: float | None = None) -> dict:
        """The instance's last line of output that is a JSON object; its exit status as "rc", and
        when it failed or printed none, its error as "error"."""
        rc, out, err = self.wait(p, timeout)
        self.keep_output(p, out, err)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        try:
            res = json.loads(lines[-1]) if lines else {}
        except ValueError:
            res = {}
        res["rc"] = rc
        if (rc or not lines) and not res.get("error"):
            said = self.daemon_says(getattr(p, "instance", "?")) if rc else ""
            res["error"] = error_of(out, err, rc) + (f" (cgpud: {said.split('memory watchdog: ', 1)[-1]})" if said else "")
        return res

    def run(self, role: str, argv: list[str], timeout: float | None = None, **kw) -> dict:
        return self.result(self.start(role, argv, **kw), timeout)

    def direct(self, argv: list[str], timeout: float | None = None) -> dict:
        """The same job without cgpud: no instance, no libcgpu."""
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CGPU_PAGE_DIR")}
        p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        self.started.append(("(without cgpud)", p))
        return self.result(p, timeout)

    def kill(self, p: subprocess.Popen) -> None:
        """Every process of the instance: those below `cgpu run` and those of its cgroups (cgroup2's
        cgroup.kill where there is one; a v1 freezer group thawed so that they die), then `cgpu run`
        itself if it has not ended with them (it deregisters the instance when its command ends)."""
        from cgpud.sched import cgroupfs
        pids, groups = set(descendants(p.pid)), set()
        try:
            own = cgroupfs.proc_cgroups(p.pid)
            for kid in pids:
                try:
                    theirs = cgroupfs.proc_cgroups(kid)
                except cgroupfs.TargetGone:
                    continue
                groups |= {g for g, mine in ((theirs.v2, own.v2), (theirs.freezer, own.freezer)) if g and g != mine}
        except cgroupfs.TargetGone:
            pass
        for g in groups:
            pids.update(cgroupfs.cgroup_pids(g))
            for f, v in (("cgroup.kill", "1"), ("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
                try:
                    Path(g, f).write_text(v)
                except OSError:
                    pass
        for pid in pids - {p.pid, os.getpid()}:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for g in groups:  # (a v1 freezer: the gate may have frozen it again meanwhile)
            try:
                Path(g, "freezer.state").write_text("THAWED")
            except OSError:
                pass
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait(10)

    def reap(self) -> list[str]:
        """Kill what the last check left running; their names."""
        left = [(n, p) for n, p in self.started if p.poll() is None]
        for n, p in left:
            self.kill(p)
            p.communicate()
        self.started = []
        return [n for n, _ in left]

    def stop(self) -> None:
        self.reap()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def describe(self) -> tuple[str, str]:
        """The daemon row: its version, GPUs, and where libfuse3 and libcgpu-switch.so were loaded from."""
        try:
            maps = Path(f"/proc/{self.proc.pid}/maps").read_text()
        except OSError as exc:
            return FAIL, f"the daemon's maps: {exc}"
        libs = sorted({ln.split()[-1] for ln in maps.splitlines() if re.search(r"libfuse3|libcgpu-switch", ln)})
        serving = next((ln.split("serving", 1)[1].strip() for ln in self.log.read_text(errors="replace").splitlines()
                        if " serving " in ln), "")
        gpus = re.search(r"GPUs ([^;]*)", serving)
        version = (self.work / "mnt" / "version").read_text().strip()
        r = self.run("dmn", ["sh", "-c", 'printf \'{"preload": "%s", "instance": "%s"}\\n\' "$LD_PRELOAD" "$CGPU_INSTANCE"'])
        inst = (f"an instance ran ({r['instance']}, LD_PRELOAD {r['preload']})" if r.get("rc") == 0 and r.get("preload")
                else f"an instance did not run: {r.get('error') or r}")
        ok = (any("libfuse3" in x for x in libs) and any("libcgpu-switch" in x for x in libs) and r.get("rc") == 0
              and os.fspath(self.libcgpu) in r.get("preload", ""))
        return (PASS if ok else FAIL), (f"cgpud {version} on --gpus {self.gpus}: {gpus.group(1) if gpus else '?'}; "
                                         f"loaded {', '.join(libs) or 'no libfuse3?'}; {inst}")


PRELUDE = """import json, os, sys, time
MEMSIZE = %d
MIB = 1 << 20
def chain(exc):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__
def oom_of(exc):
    words = ("out of memory", "OUT_OF_MEMORY", "RESOURCE_EXHAUSTED", "ALLOC_FAILED", "OutOfMemory")
    return next((e for e in chain(exc) if any(w in type(e).__name__ + str(e) for w in words)), None)
def oomish(exc):
    return oom_of(exc) is not None
def progress(res):  # (the last line printed is the result: a kill leaves what was reached)
    print(json.dumps(res), flush=True)
def said(exc):  # (an out-of-memory error that another one followed, e.g. a capture ended by it: both)
    one = lambda e: (type(e).__name__ + ": " + (str(e).strip().splitlines() or [""])[0])[:200]
    first = oom_of(exc)
    return one(exc) if first is None or first is exc else one(first) + " (then " + one(exc) + ")"
""" % MEMSIZE


def code(body: str, memsize: int = MEMSIZE) -> list[str]:
    return ["-c", PRELUDE.replace(f"MEMSIZE = {MEMSIZE}", f"MEMSIZE = {memsize}") + textwrap.dedent(body)]


SHOWN = {
    "cuda-bindings": ("cuda.bindings", """
        from cuda.bindings import driver as d
        d.cuInit(0); dev = d.cuDeviceGet(0)[1]; ctx = d.cuDevicePrimaryCtxRetain(dev)[1]; d.cuCtxSetCurrent(ctx)
        total = d.cuDeviceTotalMem(dev)[1]; free, total2 = d.cuMemGetInfo()[1:]
        print(json.dumps({"total": [total, total2], "free": free}))"""),
    "torch": ("torch", """
        import torch
        free, total = torch.cuda.mem_get_info(0)
        print(json.dumps({"total": [total, torch.cuda.get_device_properties(0).total_memory], "free": free}))"""),
    "cupy": ("cupy", """
        import cupy
        free, total = cupy.cuda.runtime.memGetInfo()
        print(json.dumps({"total": [total], "free": free}))"""),
}

# Each fill reports what it got, the error it ended with, and (where it can) free0: what it was told
# was free once its context existed (memsize less the context's charge).
OOM = {
    "cuda-bindings": ("cuda.bindings", """
        from cuda.bindings import driver as d
        d.cuInit(0); dev = d.cuDeviceGet(0)[1]; ctx = d.cuDevicePrimaryCtxRetain(dev)[1]; d.cuCtxSetCurrent(ctx)
        free0 = d.cuMemGetInfo()[1]
        got, err = 0, None
        while got <= MEMSIZE:
            r = d.cuMemAlloc(64 * MIB)
            if r[0] != d.CUresult.CUDA_SUCCESS:
                err = r[0].name; break
            got += 64 * MIB
        print(json.dumps({"got": got, "error": err, "free0": free0}))"""),
    "torch": ("torch", """
        import torch
        free0 = torch.cuda.mem_get_info(0)[0]
        held, err = [], None
        try:
            while len(held) * 64 * MIB <= MEMSIZE:
                held.append(torch.empty(64 * MIB, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError as exc:
            err = "OutOfMemoryError"
        got = len(held) * 64 * MIB
        del held
        torch.cuda.empty_cache()
        again = torch.empty(MEMSIZE // 4, dtype=torch.uint8, device="cuda").numel()  # (all given back)
        print(json.dumps({"got": got, "error": err, "again": again, "free0": free0}))"""),
    "cupy": ("cupy", """
        import cupy
        free0 = cupy.cuda.runtime.memGetInfo()[0]
        held, err = [], None
        try:
            while len(held) * 64 * MIB <= MEMSIZE:
                held.append(cupy.empty(64 * MIB, dtype=cupy.uint8))
        except cupy.cuda.memory.OutOfMemoryError:
            err = "OutOfMemoryError"
        print(json.dumps({"got": len(held) * 64 * MIB, "error": err, "free0": free0}))"""),
    "jax": ("jax", """
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (the allocation itself is checked here)
        import jax, jax.numpy as jnp
        held, err = [], None
        try:
            while len(held) * 64 * MIB <= MEMSIZE:
                held.append(jnp.zeros(64 * MIB, dtype=jnp.uint8).block_until_ready())
        except Exception as exc:
            err = type(exc).__name__ if oomish(exc) else said(exc)
        print(json.dumps({"got": len(held) * 64 * MIB, "error": err}))"""),
}


def oom_floor(r: dict, memsize: int = MEMSIZE) -> int:
    """The least a fill must get before out-of-memory: what it was told was free at its start (else
    memsize less a context), less the headroom and one 64 MiB allocation."""
    free0 = r.get("free0") or memsize - CONTEXT
    return int(min(free0, memsize)) - int(HEADROOM * memsize) - 64 * MIB


# ---- issue 28's fills: each prints its JSON line whatever happens, so that only a kill loses it -----

FILL_JAX = """
    res = {"stage": "import"}
    try:
        import jax, jax.numpy as jnp  # (its defaults: preallocation of 75 % of what it is told is free)
        res["stage"] = "preallocation"
        progress(res)
        x = jnp.ones((4096, 4096), jnp.float32)
        res["stage"] = "matmul"
        progress(res)
        (x @ x).block_until_ready()
        res["stage"] = "jit"
        progress(res)
        f = jax.jit(lambda a, b: jnp.tanh(a @ b) @ b)  # (XLA autotunes its GEMMs at the first compile)
        f(x, x).block_until_ready()
        try:
            res["bytes_limit"] = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
        except Exception:
            pass
        res["stage"] = "fill"
        held = []
        while len(held) * 64 * MIB <= 2 * MEMSIZE:
            held.append(jnp.ones(16 * MIB, jnp.float32).block_until_ready())
            res["got"] = len(held) * 64 * MIB
            progress(res)
        res["stage"] = "done"
    except Exception as exc:
        res["error"], res["oom"] = said(exc), oomish(exc)
    print(json.dumps(res), flush=True)
"""

FILL_GRAPHS = """
    res = {"graphs": 0, "got": 0}
    graphs, held = [], []
    try:
        import torch
        res["free0"] = torch.cuda.mem_get_info(0)[0]
        x = torch.randn(512, 512, device="cuda")

        def work(x):
            y = x @ x
            for _ in range(4):
                y = torch.tanh(y @ x) * 0.5
            return y
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        res["stage"] = "warm-up"
        with torch.cuda.stream(s):  # (what is captured, run first on a side stream: PyTorch's docs)
            for _ in range(3):
                work(x)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        while len(held) * 64 * MIB <= 2 * MEMSIZE:
            g = torch.cuda.CUDAGraph()
            res["stage"] = f"capture {len(graphs) + 1}"
            try:
                with torch.cuda.graph(g, stream=s):
                    y = work(x)
            except Exception as exc:  # (one invalidated: counted, and the fill goes on)
                if oomish(exc):
                    raise
                res["invalidated"] = res.get("invalidated", 0) + 1
                res.setdefault("capture_error", said(exc))
                torch.cuda.synchronize()
            else:
                res["stage"] = f"replay {len(graphs) + 1}"
                g.replay()
                graphs.append((g, y))
            res["stage"] = f"64 MiB tensor {len(held) + 1}"
            held.append(torch.empty(64 * MIB, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
            res["graphs"], res["got"] = len(graphs), len(held) * 64 * MIB
            progress(res)
    except Exception as exc:
        res["error"], res["oom"] = said(exc), oomish(exc)
    try:  # (alive after it: the graphs it holds still replay)
        for g, y in graphs[:4]:
            g.replay()
        torch.cuda.synchronize()
        res["replayed_after"] = True
    except Exception as exc:
        res["after"] = said(exc)
    print(json.dumps(res), flush=True)
"""

# torchvision's ResNet-50 (random weights, no download) and one synchronized step of it: training with
# AMP (autocast, GradScaler, SGD), or inference in fp16
RESNET_STEP = """
    import torch, torchvision

    def resnet50(mode):
        m = torchvision.models.resnet50(weights=None).cuda()
        if mode != "train":
            m = m.half().eval()

            def infer(x, t):
                with torch.inference_mode():
                    m(x)
                torch.cuda.synchronize()
            return infer
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda")
        lossf = torch.nn.CrossEntropyLoss()

        def train(x, t):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = lossf(m(x), t)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            torch.cuda.synchronize()
        return train

    def batch(mode, b):
        x = torch.randn(b, 3, 224, 224, device="cuda")
        return (x if mode == "train" else x.half()), torch.randint(0, 1000, (b,), device="cuda")
"""

FILL_RESNET = RESNET_STEP + """
    res = {"ran": 0}
    try:
        res["free0"] = torch.cuda.mem_get_info(0)[0]
        step = resnet50("train")
        b = 4
        while b <= 1024:
            res["batch"] = b
            progress(res)
            x, t = batch("train", b)
            step(x, t)
            step(x, t)
            res["ran"] = b
            del x, t
            b *= 2
    except Exception as exc:
        res["error"], res["oom"] = said(exc), oomish(exc)
    try:  # (alive after it)
        torch.cuda.empty_cache()
        res["alive"] = float(torch.ones(1024, device="cuda").sum()) == 1024.0
    except Exception as exc:
        res["after"] = said(exc)
    print(json.dumps(res), flush=True)
"""

# a neighbour holding memory until told to stop: its pid into a file once it holds it
# ---- issue 45's fills: where the driver grows on its own; each ends in out-of-memory, never a kill ----
# (cuda-bindings unless named: module, body; each prints its JSON line as it goes, "oom" at the end)
FILLS_45 = {
    "fill-pool": ("fragmented pool", "cuda.bindings", """
        from cuda.bindings import driver as d
        d.cuInit(0); dev = d.cuDeviceGet(0)[1]; d.cuCtxSetCurrent(d.cuDevicePrimaryCtxRetain(dev)[1])
        s = d.cuStreamCreate(1)[1]; pool = d.cuDeviceGetMemPool(dev)[1]
        d.cuMemPoolSetAttribute(pool, d.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(2**64 - 1))
        res, blocks = {"stage": "eighths", "got": 0}, []
        while (r := d.cuMemAllocAsync(MEMSIZE // 8, s))[0] == d.CUresult.CUDA_SUCCESS:  # (PyTorch's async backend)
            blocks.append(r[1]); res["got"] += MEMSIZE // 8; progress(res)
        for b in blocks[::2]:  # (every other one freed: the pool keeps them, in pieces)
            d.cuMemFreeAsync(b, s); res["got"] -= MEMSIZE // 8
        d.cuStreamSynchronize(s); res["stage"] = "quarters"
        while (r := d.cuMemAllocAsync(MEMSIZE // 4, s))[0] == d.CUresult.CUDA_SUCCESS:
            res["got"] += MEMSIZE // 4; progress(res)
        res.update(error=r[0].name, oom=r[0] == d.CUresult.CUDA_ERROR_OUT_OF_MEMORY); time.sleep(1.5); progress(res)"""),
    "fill-stack": ("stack limit raised", "cuda.bindings", """
        from cuda.bindings import driver as d
        d.cuInit(0); dev = d.cuDeviceGet(0)[1]; d.cuCtxSetCurrent(d.cuDevicePrimaryCtxRetain(dev)[1])
        res, blocks = {"stage": "fill", "got": 0}, []
        while (r := d.cuMemAlloc(64 * MIB))[0] == d.CUresult.CUDA_SUCCESS:
            blocks.append(r[1]); res["got"] += 64 * MIB
        for b in blocks[:4]:
            d.cuMemFree(b); res["got"] -= 64 * MIB
        res["stage"], stack = "stack", d.cuCtxGetLimit(d.CUlimit.CU_LIMIT_STACK_SIZE)[1]
        while (r := d.cuCtxSetLimit(d.CUlimit.CU_LIMIT_STACK_SIZE, stack + 1024))[0] == d.CUresult.CUDA_SUCCESS:
            stack += 1024; res["stack"] = stack; progress(res)  # (an H100: ~264 MiB of local memory per KiB)
        res.update(error=r[0].name, oom=r[0] == d.CUresult.CUDA_ERROR_OUT_OF_MEMORY); time.sleep(1.5); progress(res)"""),
    "fill-lazy": ("200 lazily loaded modules", "cuda.bindings", """
        from cuda.bindings import driver as d
        d.cuInit(0); dev = d.cuDeviceGet(0)[1]; d.cuCtxSetCurrent(d.cuDevicePrimaryCtxRetain(dev)[1])
        res = {"stage": "modules", "got": 0, "modules": 0}
        for i in range(200):  # (each: its own module, its function asked for and launched, then 8 MiB)
            ptx = (".version 6.0\\n.target sm_52\\n.address_size 64\\n.visible .entry k%d()\\n{\\nret;\\n}\\n" % i).encode()
            r = d.cuModuleLoadData(ptx)
            r = d.cuModuleGetFunction(r[1], b"k%d" % i) if r[0] == d.CUresult.CUDA_SUCCESS else r
            r = d.cuLaunchKernel(r[1], 1, 1, 1, 1, 1, 1, 0, 0, 0, 0) if r[0] == d.CUresult.CUDA_SUCCESS else r
            r = d.cuMemAlloc(8 * MIB) if r[0] == d.CUresult.CUDA_SUCCESS else r
            if r[0] != d.CUresult.CUDA_SUCCESS:
                break
            res["modules"] += 1; res["got"] += 8 * MIB; progress(res)
        while r[0] == d.CUresult.CUDA_SUCCESS and (r := d.cuMemAlloc(64 * MIB))[0] == d.CUresult.CUDA_SUCCESS:
            res["got"] += 64 * MIB; progress(res)  # (then the rest filled: it ends in out-of-memory)
        res.update(error=r[0].name, oom=r[0] == d.CUresult.CUDA_ERROR_OUT_OF_MEMORY); time.sleep(1.5); progress(res)"""),
    "fill-graphmem": ("torch graph memory at first replay", "torch", """
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"  # (graph allocations: graph memory nodes)
        import torch
        res, held = {"stage": "fill", "got": 0}, []
        try:
            while res["got"] < MEMSIZE * 6 // 10:
                held.append(torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")); res["got"] += 64 * MIB
            res["stage"], g, s = "capture", torch.cuda.CUDAGraph(), torch.cuda.Stream()
            with torch.cuda.stream(s):
                x = torch.ones(MEMSIZE // 8, dtype=torch.uint8, device="cuda")
                with torch.cuda.graph(g, stream=s):  # (its memory comes at the first replay)
                    y = [x + 1 for _ in range(4)]
            res["stage"] = "replay"; progress(res)
            g.replay(); torch.cuda.synchronize(); res["stage"] = "replayed"
        except Exception as exc:
            res.update(error=said(exc), oom=oomish(exc))
        time.sleep(1.5); progress(res)"""),
}

HOLD = {"torch": ("torch", """
    import torch
    x = torch.empty(int(sys.argv[2]), dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
    open(sys.argv[1] + ".tmp", "w").write(json.dumps({"pid": os.getpid(), "held": x.numel()}))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(float(sys.argv[3]))
"""), "cupy": ("cupy", """
    import cupy
    x = cupy.empty(int(sys.argv[2]), dtype=cupy.uint8); cupy.cuda.Device().synchronize()
    open(sys.argv[1] + ".tmp", "w").write(json.dumps({"pid": os.getpid(), "held": x.nbytes}))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(float(sys.argv[3]))
""")}

GRAPHS = {"torch": ("torch", """
    import torch
    x = torch.randn(2048, 2048, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # (warm-up on a side stream before capturing)
        for _ in range(3):
            y = torch.tanh(x @ x) * 0.5
    torch.cuda.current_stream().wait_stream(s)
    end = time.monotonic() + float(sys.argv[1])
    captures = invalidated = wrong = 0
    while time.monotonic() < end:
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, stream=s):  # (global capture mode: PyTorch's default)
                y = x @ x
                for _ in range(20):
                    y = torch.tanh(y @ x) * 0.5
            captures += 1
        except RuntimeError as exc:
            invalidated += 1
            continue
        g.replay(); torch.cuda.synchronize()
        ref = x @ x
        for _ in range(20):
            ref = torch.tanh(ref @ x) * 0.5
        wrong += not torch.allclose(y, ref, atol=1e-3)
    print(json.dumps({"captures": captures, "invalidated": invalidated, "wrong": wrong}))
"""), "cupy": ("cupy", """
    import cupy
    x = cupy.arange(1 << 20, dtype=cupy.float32)
    y, z = cupy.empty_like(x), cupy.empty_like(x)
    s = cupy.cuda.Stream(non_blocking=True)
    end = time.monotonic() + float(sys.argv[1])
    captures = invalidated = wrong = 0
    while time.monotonic() < end:
        with s:
            s.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeGlobal)  # (as PyTorch captures)
            for _ in range(20):
                cupy.multiply(x, 0.5, out=y)
                cupy.add(y, 1.0, out=z)
                time.sleep(0.0005)
            try:
                g = s.end_capture()
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                invalidated += 1
                continue
            captures += 1
            z.fill(0)
            g.launch(stream=s)
            s.synchronize()
        if bool(x[3] == 3):  # (a device that keeps contents: not the stand-in driver)
            wrong += not bool(cupy.allclose(z, x * 0.5 + 1.0))
        else:
            wrong = None
    print(json.dumps({"captures": captures, "invalidated": invalidated, "wrong": wrong}))
""")}

# step() launches, sync() waits: argv t0 t1 [size [launches between synchronizes]]
BUSY = {"torch": ("torch", """
    import torch
    x = torch.randn(4096, 4096, device="cuda")
    step, sync = lambda: x @ x, torch.cuda.synchronize
"""), "cupy": ("cupy", """
    import cupy
    x = cupy.arange(int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "-" else 1 << 24, dtype=cupy.float32)
    y = cupy.empty_like(x)
    step, sync = lambda: cupy.sin(x, out=y), cupy.cuda.Device().synchronize  # (no cuBLAS needed)
""")}
BUSY_LOOP = """
    t0, t1 = float(sys.argv[1]), float(sys.argv[2])
    per = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    stamps = []
    step(); sync()
    while time.monotonic() < t1:
        for _ in range(per):
            step()
        sync()
        stamps.append((time.monotonic(), per))
    inside = [(t, n) for t, n in stamps if t0 <= t <= t1]
    rate = sum(n for t, n in inside[1:]) / (inside[-1][0] - inside[0][0]) if len(inside) > 2 else 0.0
    print(json.dumps({"kernels": sum(n for t, n in inside), "rate": rate, "late": stamps[0][0] > t0 if stamps else True}))
"""

# a high-priority instance: a small kernel, launch to completion, every 20 ms between t0 and t1
HIGHPRIO = """
    import torch
    a = torch.ones(1024, device="cuda"); b = torch.empty_like(a)
    torch.mul(a, 2, out=b); torch.cuda.synchronize()
    t0, t1 = float(sys.argv[1]), float(sys.argv[2])
    lat = []
    while time.monotonic() < t1:
        s = time.perf_counter()
        torch.mul(a, 2, out=b)
        torch.cuda.synchronize()
        e = time.perf_counter()
        if time.monotonic() >= t0:
            lat.append((e - s) * 1e3)
        time.sleep(0.02)
    lat.sort()
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None
    print(json.dumps({"n": len(lat), "p50": q(0.5), "p99": q(0.99), "max": lat[-1] if lat else None}))
"""

# ResNet-50 (torchvision, random weights and data): argv mode batches t0 warm window. For each batch in
# turn, from t0 + k * (warm + window): `warm` seconds at that batch, then images per second over the
# steps that end within the next `window` seconds (synchronized each step; timed between the first and
# the last of them).
RESNET = RESNET_STEP + """
    res = {"rates": {}}
    try:
        mode, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
        t0, warm, window = float(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
        step = resnet50(mode)
        x, t = batch(mode, batches[0])
        step(x, t)
        res["ready"] = time.monotonic() - t0  # (negative: ready before the first window's warm-up)
        for k, b in enumerate(batches):
            start = t0 + k * (warm + window)
            x, t = batch(mode, b)
            while True:
                step(x, t)
                if time.monotonic() >= start:
                    break
            ends = []
            while True:
                step(x, t)
                now = time.monotonic()
                if now >= start + warm:
                    ends.append(now)
                if now >= start + warm + window:
                    break
            ends = [e for e in ends if e <= start + warm + window] or ends
            res["rates"][str(b)] = b * (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 2 else 0.0
            del x, t
    except Exception as exc:
        res["error"] = said(exc)
    print(json.dumps(res), flush=True)
"""
RESNET_TABLE = {"train": ("ResNet-50 training AMP", (16, 64, 128)), "infer": ("ResNet-50 inference fp16", (1, 8, 64))}


def pids(csv: str) -> set[int]:
    """The pids of `nvidia-smi --query-compute-apps=pid,... --format=csv,noheader`."""
    return {int(m) for m in re.findall(r"^\s*(\d+)\s*,", csv, re.M)}


# The MPS row's client: libcuda through ctypes (no framework needed). `oom LIMIT_MIB`: 64 MiB
# allocations until one fails; `spin START END`: from START (monotonic), batches of 4 kernels of a
# dependent chain (8192 blocks of 128 threads: many waves on any GPU; on the stand-in, whose kernel
# takes its block count in µs, 8.2 ms) and a synchronize, until END: each batch's end.
MPS_PTX = (".version 6.0\n.target sm_52\n.address_size 64\n"
           ".visible .entry spin(.param .u32 n, .param .u64 out)\n{\n"
           "  .reg .pred %p;\n  .reg .b32 %r<5>;\n  .reg .b64 %rd<2>;\n"
           "  ld.param.u32 %r1, [n];\n  ld.param.u64 %rd1, [out];\n  mov.u32 %r2, 0;\n  mov.u32 %r3, %tid.x;\n"
           "L:\n  mad.lo.u32 %r3, %r3, 1664525, 1013904223;\n  add.u32 %r2, %r2, 1;\n"
           "  setp.lt.u32 %p, %r2, %r1;\n  @%p bra L;\n  setp.eq.u32 %p, %r3, 7;\n"
           "  @%p st.global.u32 [%rd1], %r3;\n  ret;\n}\n")
MPS_CLIENT = r"""
import ctypes, json, sys, time
cu = ctypes.CDLL("libcuda.so.1")
def ok(r, what):
    if r:
        print(json.dumps({"error": r, "at": what})); sys.exit(0)
ok(cu.cuInit(0), "cuInit")
ctx = ctypes.c_void_p()
ok(cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0), "cuCtxCreate")
if sys.argv[1] == "oom":
    got, p = 0, ctypes.c_uint64()
    while got < (int(sys.argv[2]) << 20) * 4:
        r = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(64 << 20))
        if r:
            print(json.dumps({"got": got, "error": r})); sys.exit(0)
        got += 64 << 20
    print(json.dumps({"got": got}))
else:
    mod, fn, out = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_uint64()
    ok(cu.cuModuleLoadData(ctypes.byref(mod), sys.argv[4].encode() + b"\0"), "cuModuleLoadData")
    ok(cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin"), "cuModuleGetFunction")
    ok(cu.cuMemAlloc_v2(ctypes.byref(out), ctypes.c_size_t(4)), "cuMemAlloc")
    n = ctypes.c_uint32(20000)
    args = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.byref(n), ctypes.c_void_p),
                                 ctypes.cast(ctypes.byref(out), ctypes.c_void_p))
    start, end, ends = float(sys.argv[2]), float(sys.argv[3]), []
    time.sleep(max(0.0, start - time.monotonic()))
    while time.monotonic() < end:
        for _ in range(4):
            ok(cu.cuLaunchKernel(fn, 8192, 1, 1, 128, 1, 1, 0, None, args, None), "cuLaunchKernel")
        ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        ends.append(time.monotonic())
    print(json.dumps({"ends": ends}))
"""


def mps_row(work: Path, control: str, budget: float, quick: bool = False) -> tuple[str, str]:
    """NVIDIA's MPS on this machine (issue 37, docs/mps.md): a control daemon with a pipe directory
    of the row's own; a client with CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=512M allocates until
    out-of-memory (it must get at most 512 MiB, then CUDA_ERROR_OUT_OF_MEMORY, 2); then clients at
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE 25 and 50, both busy: their batches completed over the same
    window split 1:2 (the 25 % client's share 0.333 within 5 pp)."""
    pipe, logs = work / "mps-pipe", work / "mps-log"
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=os.fspath(pipe), CUDA_MPS_LOG_DIRECTORY=os.fspath(logs))
    for k in ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        env.pop(k, None)
    r = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, timeout=30)
    if r.returncode:
        return FAIL, f"nvidia-cuda-mps-control -d: {error_of(r.stdout, r.stderr, r.returncode)}"

    def client(args: list[str], **extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", MPS_CLIENT, *args], env={**env, **extra}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    def result(p: subprocess.Popen, timeout: float) -> dict:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            return {"error": "timed out"}
        try:
            return json.loads(o.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"error": error_of(o, e, p.returncode)}

    try:
        limit = 512
        m = result(client(["oom", str(limit)], CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=f"0={limit}M"), 30)
        mem_ok = m.get("error") == 2 and 0 < m.get("got", 0) <= limit << 20
        said = f"pinned 0={limit}M: {m.get('got', 0) >> 20} MiB, then " + (
            f"error {m['error']}" + (f" at {m['at']}" if m.get("at") else "") if m.get("error") else "no error")
        start = time.monotonic() + 2.0
        end = start + min(2.0 if quick else 6.0, max(1.0, budget - 10))
        pair = [client(["spin", str(start), str(end), MPS_PTX], CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=pct)
                for pct in ("25", "50")]
        a, b = (result(p, end - time.monotonic() + 30) for p in pair)
        if "ends" not in a or "ends" not in b:
            bad = a if "ends" not in a else b
            return FAIL, f"{said}; a busy client failed: {bad.get('error')} at {bad.get('at')}"
        lo, hi = start + (end - start) * 0.2, min(a["ends"][-1], b["ends"][-1])
        na, nb = (sum(lo <= t <= hi for t in x["ends"]) for x in (a, b))
        share = na / (na + nb) if na + nb else 0.0
        thr_ok = na > 0 and nb > 0 and abs(share - 1 / 3) <= 0.05
        return (PASS if mem_ok and thr_ok else FAIL), (
            f"{said}; threads 25 % : 50 %: {na} : {nb} batches over the same {hi - lo:.1f} s, "
            f"share {share:.3f} (want 0.333 +- 0.05)")
    finally:
        subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True, timeout=30)


def checks(node: Node) -> list[Check]:
    out: list[Check] = []
    mib = MEMSIZE >> 20
    nvml = node.gpus == "nvml"
    py = Pythons()  # (looked for as the rows run: listing them imports nothing)

    def add(key: str, name: str, budget: float, fn, needs: str | Callable[[], str | None] | None = None,
            rows: Sequence[str] = ()) -> None:
        """A check; `needs`: the module it needs (SKIP without it), or what says what is missing."""
        def run():
            lacking = needs() if callable(needs) else needs if needs and not py[needs] else None
            if lacking:
                why = f"{lacking} not installed"
                return [Row(n, SKIP, why) for n in rows] if rows else (SKIP, why)
            return fn()
        out.append(Check(key, name, budget, run, rows))

    add("daemon", "daemon", 10, node.describe)

    def shown(py: str, body: str) -> tuple[str, str]:
        r = node.run("mem", [py, *code(body)])
        ok = r.get("rc") == 0 and all(t == MEMSIZE for t in r.get("total", [None])) and r.get("free", MEMSIZE + 1) <= MEMSIZE
        total = [t >> 20 for t in r.get("total", [])]
        return (PASS if ok else FAIL), (f"total {total} MiB, free {r.get('free', 0) >> 20} MiB; "
                                        f"memsize {mib} MiB {r.get('error') or ''}").strip()

    def oom(py: str, body: str, env: dict | None = None) -> tuple[str, str]:
        r = node.run("oom", [py, *code(body)], env=env)
        got, floor = r.get("got", 0), oom_floor(r)
        ok = r.get("rc") == 0 and r.get("error") and floor <= got <= MEMSIZE
        told = f" (told {r['free0'] >> 20} MiB free at its start)" if r.get("free0") else ""
        return (PASS if ok else FAIL), (f"{got >> 20} MiB of {mib}{told}, then {r.get('error')}; at least "
                                        f"{floor >> 20} MiB wanted; exit {r.get('rc')}")

    for client, (module, body) in SHOWN.items():
        add(f"mem-{client}", f"memsize shown ({client})", 60, lambda m=module, b=body: shown(py[m], b), module)
    for client, (module, body) in OOM.items():
        add(f"oom-{client}", f"oom at memsize ({client})", 90, lambda m=module, b=body: oom(py[m], b), module)
    add("oom-torch-expandable", "torch allocator, expandable_segments", 90,
        lambda: oom(py["torch"], OOM["torch"][1], {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}), "torch")

    # ---- issue 28: fills that end in out-of-memory, never in a kill ----
    def filled(r: dict, what: str) -> tuple[str, str]:
        killed = r.get("rc") in (137, -9) or "SIGKILL" in str(r.get("error"))
        ran = r.get("rc") == 0 and ("error" not in r or r.get("oom"))
        alive = r.get("alive", True) and "after" not in r
        ok = ran and alive and not killed
        end = (f"then out-of-memory ({r['error']})" if r.get("oom") else
               f"then {r['error']}" if r.get("error") else "ran to its end")
        state = "KILLED" if killed else "alive" if alive else f"not alive: {r.get('after')}"
        return (PASS if ok else FAIL), f"{what}, {end}; {state}; exit {r.get('rc')}"

    def fill_jax() -> tuple[str, str]:  # (its stage: where a kill found it)
        env = dict.fromkeys(("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                             "XLA_PYTHON_CLIENT_ALLOCATOR"))  # (unset: its defaults)
        r = node.run("jax", [py["jax"], *code(FILL_JAX)], env=env)
        lim = f"preallocated {r['bytes_limit'] >> 20} MiB, " if r.get("bytes_limit") else ""
        return filled(r, f"{lim}reached {r.get('stage')}, filled {r.get('got', 0) >> 20} MiB of {mib}")
    add("fill-jax", "fill: JAX at its defaults (issue 28)", 120, fill_jax, "jax")

    def fill_graphs() -> tuple[str, str]:
        node.write("0/policy", "1")
        neighbour = node.start("nbr", [py["torch"], *code(BUSY["torch"][1] + BUSY_LOOP), "0",
                                       str(time.monotonic() + min(node.remaining(), 90))])
        try:
            r = node.run("gfl", [py["torch"], *code(FILL_GRAPHS)])
        finally:
            node.kill(neighbour)
        result, detail = filled(r, f"{r.get('graphs', 0)} graphs captured and replayed, "
                                   + (f"{r['invalidated']} invalidated ({r.get('capture_error')}), " if r.get("invalidated")
                                      else "") + f"{r.get('got', 0) >> 20} MiB held of {mib} (told "
                                   f"{r.get('free0', 0) >> 20} free), a neighbour running"
                                   + (f", stopped at {r['stage']}" if r.get("error") or r.get("rc") else ""))
        return (result if r.get("graphs") else FAIL), detail
    add("fill-graphs", "fill: torch CUDA graphs, neighbour (issue 28)", 120, fill_graphs, "torch")

    def fill_resnet() -> tuple[str, str]:
        r = node.run("rfl", [py["torch"], *code(FILL_RESNET)])
        return filled(r, f"ResNet-50 AMP training ran to batch {r.get('ran')} in {mib} MiB"
                         + (f" (at batch {r['batch']})" if r.get("rc") and r.get("batch") else ""))
    add("fill-resnet", "fill: ResNet-50 training, tight (issue 28)", 150, fill_resnet, "torchvision")

    # ---- issue 45: fills where the driver grows on its own (pools, stack, graph memory, lazy loads) ----
    for key, (what, module, body) in FILLS_45.items():
        def fill_45(w=what, m=module, b=body, k=key) -> tuple[str, str]:
            r = node.run(k[5:9], [py[m], *code(b)])
            return filled(r, f"{w}: reached {r.get('stage')}, {r.get('got', 0) >> 20} MiB held of {mib}")
        add(key, f"fill: {what} (issue 45)", 90, fill_45, module)

    smi = shutil.which("nvidia-smi")

    def nvidia_smi() -> tuple[str, str]:
        p = node.start("smi", [smi, "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits"])
        rc, o, e = node.wait(p)
        if rc or not o.strip():
            return FAIL, f"nvidia-smi: {error_of(o, e, rc)}"
        total, used = (int(v) for v in o.strip().splitlines()[0].split(","))
        return (PASS if total == mib and used <= mib else FAIL), f"memory.total {total} MiB, used {used} MiB (memsize {mib})"
    add("smi-view", "nvidia-smi's view", 30, nvidia_smi, lambda: None if smi else "nvidia-smi")

    def smi_procs() -> tuple[str, str]:
        client = "torch" if py["torch"] else "cupy"
        ready = node.work / f"hold-{node.token}.json"
        neighbour = node.start("hld", [py[HOLD[client][0]], *code(HOLD[client][1]), os.fspath(ready), str(3 << 30), "120"],
                               mem=4 << 30)
        end = time.monotonic() + min(60, node.remaining())
        while not ready.exists():
            if neighbour.poll() is not None or time.monotonic() > end:
                r = node.result(neighbour, 5)
                return FAIL, f"the neighbour never held its 3 GiB: {r.get('error')}"
            time.sleep(0.2)
        pid = json.loads(ready.read_text())["pid"]
        query = ["--query-compute-apps=pid,used_memory", "--format=csv,noheader"]
        outside = subprocess.run([smi, *query], capture_output=True, text=True, timeout=30)
        p = node.start("sml", ["sh", "-c", f'"$0" {" ".join(query)}; echo "== screen"; "$0"', smi])
        rc, o, e = node.wait(p)
        node.kill(neighbour)
        listed_out = pid in pids(outside.stdout)
        q, _, screen = o.partition("== screen")
        in_query, in_screen = pid in pids(q), bool(re.search(rf"\b{pid}\b", screen.split("Processes", 1)[-1]))
        seen = ", ".join(w for w, b in (("--query-compute-apps", in_query), ("the default screen", in_screen)) if b)
        seen = seen or "neither"
        ok = rc == 0 and "Processes" in screen and not (in_query or in_screen) and listed_out
        return (PASS if ok else FAIL), (f"neighbour pid {pid} (3 GiB) listed inside by: {seen}; outside the instances "
                                        f"{'listed' if listed_out else 'NOT listed either (nothing checked)'}"
                                        + (f"; exit {rc}: {error_of(o, e, rc)}" if rc else ""))
    add("smi-procs", "nvidia-smi's process list, a neighbour (issue 28)", 90,
        smi_procs, lambda: "nvidia-smi" if not smi else None if py["torch"] or py["cupy"] else "torch or cupy")

    # ---- compute: graphs across closings, shares ----
    def graphs(py: str, body: str, busy: str) -> tuple[str, str]:
        node.write("0/policy", "1")  # (a neighbour on the same GPU: the gate closes every slice)
        before = node.stats().get("drains", 0)
        size = [str(1 << 17)] if not nvml else []
        neighbour = node.start("bsy", [py, *code(busy + BUSY_LOOP), "0",
                                       str(time.monotonic() + node.startup + node.seconds + 5), *size])
        r = node.run("grf", [py, *code(body), str(node.seconds)])
        nb = node.result(neighbour)
        closings = node.stats().get("drains", 0) - before
        ok = r.get("rc") == 0 and r.get("invalidated") == 0 and r.get("wrong", 1) in (0, None) and r.get("captures", 0) > 0 \
            and closings > 0
        replays = ("replays not compared (no contents kept)" if r.get("wrong", 1) is None
                   else f"{r.get('wrong')} wrong replays")
        return (PASS if ok else FAIL), (f"{r.get('captures')} captured, {r.get('invalidated')} invalidated, "
                                        f"{replays}, {closings} closings {r.get('error') or ''}"
                                        + (f"; the neighbour: {nb['error']}" if nb.get("error") else "")).strip()

    def pair(py: str, body: str, args: Sequence[str] = (), weights=(1, 2), window: float | None = None,
             role: str = "shr") -> list[dict]:
        """Instances at `weights` under policy 2 running `body` over the same window; their results."""
        node.write("0/policy", "2")
        t0 = time.monotonic() + node.startup  # (all started: PyTorch and CUDA take seconds to come up)
        t1 = t0 + (window or node.seconds)
        procs = [node.start(f"{role}{w}", [py, *code(body), str(t0), str(t1), *args], weight=w) for w in weights]
        return [node.result(p) for p in procs]

    def share(py: str, busy: str) -> tuple[str, str]:
        size = [str(1 << 17)] if not nvml else []  # (the stand-in: a kernel of 1 ms, 1024 blocks)
        rs = pair(py, busy + BUSY_LOOP, size)
        errors = [f"weight {w}: {r['error']}" for w, r in zip((1, 2), rs) if r.get("error") or "kernels" not in r]
        if errors:
            return FAIL, "; ".join(errors)
        got = [r["kernels"] for r in rs]
        s = got[0] / max(sum(got), 1)
        return (PASS if abs(s - 1 / 3) <= 0.05 else FAIL), f"weight 1 got {s:.3f} of the kernels (want 0.333), {got}"

    for client, (module, body) in GRAPHS.items():
        add(f"graphs-{client}", f"graph capture while the gate closes ({client})", node.startup + node.seconds + 60,
            lambda m=module, b=body, c=client: graphs(py[m], b, BUSY[c][1]), module)
    add("share-torch", "share 1:2 policy 2, deep queue: 8 x 4096^2 matmul, sync (torch)", node.startup + node.seconds + 60,
        lambda: share(py["torch"], BUSY["torch"][1]), "torch")
    add("share-cupy", "share 1:2 policy 2, us kernels: sin 16M, sync every 8 (cupy)", node.startup + node.seconds + 60,
        lambda: share(py["cupy"], BUSY["cupy"][1]), "cupy")

    def highprio() -> tuple[str, str]:
        node.write("0/policy", "2")
        t0 = time.monotonic() + node.startup
        t1 = t0 + node.seconds
        nb = node.start("ahd", [py["torch"], *code(BUSY["torch"][1] + BUSY_LOOP), str(t0), str(t1 + 1), "-", "64"])
        r = node.run("hpr", [py["torch"], *code(HIGHPRIO), str(t0), str(t1)], highprio=True)
        n = node.result(nb)
        if r.get("error") or r.get("p99") is None:
            return FAIL, f"high priority: {r.get('error') or 'no samples'}"
        return (PASS if r["p99"] <= 5.0 else FAIL), (
            f"launch to completion p50 {r['p50']:.2f} ms, p99 {r['p99']:.2f} ms, max {r['max']:.1f} ms over {r['n']} "
            f"kernels (want p99 <= 5 ms) while a weight-1 neighbour queued 64 matmuls a sync "
            + (f"({n['rate']:.0f} matmuls/s)" if n.get("rate") else f"(neighbour: {n.get('error')})"))
    add("highprio", "high priority: launch to completion, neighbour ahead (torch)", node.startup + node.seconds + 60,
        highprio, "torch")

    def alone() -> tuple[str, str]:
        argv = [py["torch"], *code(BUSY["torch"][1] + BUSY_LOOP)]
        def times() -> list[str]:
            t0 = time.monotonic() + node.startup / 2
            return [str(t0), str(t0 + node.seconds / 2)]
        d = node.direct(argv + times())
        g = node.run("aln", argv + times())
        if not d.get("rate") or not g.get("rate"):
            return FAIL, (f"without cgpud: {d.get('error') or d.get('rate')}; "
                          f"under the gate: {g.get('error') or g.get('rate')}")
        q = g["rate"] / d["rate"]
        return (PASS if q >= 0.99 else FAIL), (f"{g['rate']:.1f} matmuls/s under the gate against {d['rate']:.1f} without "
                                               f"cgpud: {100 * q:.1f} % (want >= 99 %)")
    add("alone", "alone under the gate vs without cgpud (torch)", node.startup + node.seconds + 60, alone, "torch")

    # ---- issue 37: NVIDIA's MPS itself (a control daemon of the row's own, its clients plain processes) ----
    mps_control = shutil.which("nvidia-cuda-mps-control")
    add("mps", "MPS: pinned limit, thread percentages 1:2 (issue 37)", 90,
        lambda: mps_row(node.work, mps_control, min(node.remaining() - 5, 60), quick=node.quick),
        lambda: None if mps_control else "nvidia-cuda-mps-control")

    warm, window = (2.5, 3.0) if nvml else (1.0, 1.0)
    big = 24 << 30 if nvml else MEMSIZE  # (ResNet-50 training at batch 128 takes ~10 GiB; two beside each other)

    def resnet_rows(mode: str) -> list[Row]:
        title, batches = RESNET_TABLE[mode]
        args = [mode, ",".join(map(str, batches))]
        names = [f"{title} b{b} 1:2" for b in batches]
        t = time.monotonic()
        a = node.run(f"r{mode[0]}a", [py["torchvision"], *code(RESNET), *args, str(time.monotonic() + node.startup),
                                      str(warm), str(window)], mem=big)
        node.write("0/policy", "2")
        t0 = str(time.monotonic() + node.startup)
        procs = [node.start(f"r{mode[0]}{w}", [py["torchvision"], *code(RESNET), *args, t0, str(warm), str(window)],
                            weight=w, mem=big) for w in (1, 2)]
        p1, p2 = (node.result(p) for p in procs)
        took = (time.monotonic() - t) / len(batches)
        rows = []
        for b, n in zip(batches, names):
            alone_r, r1, r2 = (x.get("rates", {}).get(str(b)) for x in (a, p1, p2))
            errs = [f"{w}: {x['error']}" for w, x in (("alone", a), ("weight 1", p1), ("weight 2", p2)) if x.get("error")]
            if not (alone_r and r1 and r2):
                rows.append(Row(n, FAIL, "; ".join(errs) or f"no rate (alone {alone_r}, pair {r1} : {r2})", took))
                continue
            ratio, total = r2 / r1, (r1 + r2) / alone_r
            ok = abs(ratio - 2) <= 0.04 and total >= 0.97
            late = [w for w, x in (("alone", a), ("weight 1", p1), ("weight 2", p2)) if (x.get("ready") or 0) > warm]
            rows.append(Row(n, PASS if ok else FAIL,
                            f"alone {alone_r:.0f} img/s; pair {r1:.0f} : {r2:.0f} img/s = {ratio:.2f} (want 2.00 +- 0.04); "
                            f"sum {r1 + r2:.0f} = {100 * total:.1f} % of alone (want >= 97 %)"
                            + (f"; started late: {', '.join(late)}" if late else ""), took))
        return rows

    for mode, (title, batches) in RESNET_TABLE.items():
        budget = 2 * (node.startup + len(batches) * (warm + window)) + 60
        add(f"resnet-{mode}", title, budget, lambda m=mode: resnet_rows(m), "torchvision",
            rows=[f"{title} b{b} 1:2" for b in batches])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", action="store_true", help="keep the working directory (the daemon's log)")
    ap.add_argument("--quick", action="store_true", help="the timed checks over 6 s")
    ap.add_argument("--gpus", default="nvml", help="the daemon's --gpus (default nvml; another, e.g. sim:T4 with "
                    "LD_LIBRARY_PATH naming the stand-in driver, tries the checks where there is no GPU)")
    ap.add_argument("--libcgpu", metavar="PATH", help="libcgpu.so built elsewhere (default: built here by zig)")
    ap.add_argument("--only", metavar="KEYS", help="run only these rows: keys or globs, comma-separated (--list)")
    ap.add_argument("--list", action="store_true", help="print the rows' keys and names, run nothing")
    ap.add_argument("--out", metavar="FILE", type=Path, help="also write the table into FILE (after each row)")
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT, metavar="S",
                    help=f"the whole run's seconds (default {TIME_LIMIT:.0f}): rows with no time left are SKIP")
    a = ap.parse_args(argv)
    if a.list:
        for c in checks(_Listing(a.gpus, a.quick)):
            print(f"{c.key:<22} {' / '.join(c.names())}")
        return 0
    if a.only and not select(checks(_Listing(a.gpus, a.quick)), a.only):
        print(f"gpu-check: no row matches --only {a.only} (--list shows their keys)", file=sys.stderr)
        return 2
    reason = no_gpu_reason() if a.gpus == "nvml" else None
    if reason:
        print(f"gpu-check: no NVIDIA GPU on this machine ({reason}); nothing checked")
        return NO_GPU
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(128 + s))  # (a time limit's TERM: instances killed, daemon stopped)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="cgpu-gpu-check-"))
    node = None
    rows: list[Row] = []
    try:
        node = Node(work, a.gpus, a.quick, a.libcgpu)
        every = checks(node)
        todo = every[:1] + [c for c in select(every[1:], a.only)]  # (the daemon's row always)
        report = Report([n for c in todo for n in c.names()], a.out)
        report.begin()
        rows = run_checks(todo, report, a.time_limit - (time.monotonic() - t0), node)
    except RuntimeError as exc:
        rows = [Row(f"daemon on --gpus {a.gpus}", FAIL, str(exc)[:300])]
        report = Report([rows[0].check], a.out)
        report.begin()
        report.add(rows[0])
    finally:
        if node:
            node.stop()
        if a.keep:
            print(f"gpu-check: kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    n = {k: sum(r.result == k for r in rows) for k in (PASS, FAIL, SKIP)}
    print(f"\ngpu-check: {n[PASS]} passed, {n[FAIL]} failed, {n[SKIP]} skipped in {time.monotonic() - t0:.0f} s", flush=True)
    return exit_code(rows)


class _Listing:
    """What checks() needs to list the rows without a daemon."""

    def __init__(self, gpus: str, quick: bool) -> None:
        self.gpus, self.quick = gpus, quick
        self.startup, self.seconds = timing(gpus, quick)
        self.describe = None


if __name__ == "__main__":
    sys.exit(main())
