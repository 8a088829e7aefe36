"""make gpu-check: cgpud on a machine with an NVIDIA GPU, with the real driver (issue 23, part 4).

It builds libcgpu, starts the daemon on the real GPUs (`cgpud serve --gpus nvml --compute gate`,
in a temporary directory of its own), and runs through `cgpu run` (so through libcgpu, held to a
memsize of 2 GiB) whatever of cuda-bindings, PyTorch, CuPy, JAX and nvidia-smi is installed here,
installing nothing:

  memsize shown       the card's memory as the instance sees it is its memsize
  oom                 allocating up to memsize, then an out-of-memory error (the process lives)
  torch allocator     PyTorch's caching allocator, with and without expandable_segments:True
  graphs              a CUDA graph captured in the global mode (PyTorch's; CuPy's with the mode
                      named) and replayed while the gate closes (a neighbour on the same GPU,
                      policy 1): no capture invalidated, replays correct
  share 1:2           two instances at weights 1 and 2 under policy 2 (PyTorch, CuPy): their
                      kernels completed over the same window (host timestamps at each
                      synchronize) split 1:2, within 5 pp
  nvidia-smi          memory.total inside the container is its memsize

It prints one table (check, result, detail) and exits 1 if any check failed, else 0. On a
machine without an NVIDIA GPU it says so in one line and exits 77 (nothing checked: the "skipped"
code of automake and meson, so that a CI job tells it from a pass). docs/isolation.md, "Running
the real-GPU check".

    make gpu-check            (or: .venv/bin/python scripts/gpu_check.py [--keep] [--quick])

`--gpus sim:T4` (with LD_LIBRARY_PATH naming the stand-in driver, native/stubs) runs the same
checks where there is no GPU: tests/test_gpu_check.py does.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
NO_GPU = 77
MEMSIZE = 2 << 30
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclasses.dataclass
class Row:
    check: str
    result: str  # PASS, FAIL or SKIP
    detail: str


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


def table(rows: Iterable[Row]) -> str:
    """The rows as one Markdown table (what docs/isolation.md keeps)."""
    rows = list(rows)
    w = [max(len(h), *(len(getattr(r, f)) for r in rows)) if rows else len(h)
         for h, f in (("check", "check"), ("result", "result"), ("detail", "detail"))]
    line = lambda a, b, c: f"| {a:<{w[0]}} | {b:<{w[1]}} | {c:<{w[2]}} |"  # noqa: E731
    return "\n".join([line("check", "result", "detail"), f"|{'-' * (w[0] + 2)}|{'-' * (w[1] + 2)}|{'-' * (w[2] + 2)}|"]
                     + [line(r.check, r.result, r.detail) for r in rows])


def exit_code(rows: Iterable[Row]) -> int:
    return 1 if any(r.result == FAIL for r in rows) else 0


def run_checks(checks: Iterable[tuple[str, Callable[[], tuple[str, str]]]]) -> list[Row]:
    """Each check gives (result, detail); one that raises has failed, the error its detail."""
    rows = []
    for name, fn in checks:
        try:
            result, detail = fn()
        except Exception as exc:
            result, detail = FAIL, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        rows.append(Row(name, result, detail))
    return rows


# ---- the real GPU --------------------------------------------------------------------------------

def python_with(module: str) -> str | None:
    """A Python here that imports `module`: this one, else python3 on PATH."""
    for py in dict.fromkeys([sys.executable, shutil.which("python3") or ""]):
        if py and subprocess.run([py, "-c", f"import {module}"], capture_output=True).returncode == 0:
            return py
    return None


class Node:
    """The daemon on the real GPUs, and instances run through `cgpu run`."""

    def __init__(self, work: Path, gpus: str = "nvml", quick: bool = False) -> None:
        self.work = work
        self.gpus = gpus
        self.startup, self.seconds = (4, 6) if quick else (15, 20)  # (the timed checks)
        self.lib = work / "lib"
        r = subprocess.run(["make", "-s", "-C", os.fspath(ROOT / "native"), "libcgpu", f"LIB={self.lib}"],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"building libcgpu failed: {r.stderr.strip()}")
        (work / "mnt").mkdir()
        self.socket = work / "cgpud.sock"
        self.log = work / "cgpud.log"
        self.proc = subprocess.Popen([os.fspath(BIN / "cgpud"), "serve", "--gpus", gpus, "--compute", "gate",
                                      "--libcgpu", os.fspath(self.lib / "libcgpu.so"), "--mount", os.fspath(work / "mnt"),
                                      "--state-dir", os.fspath(work / "state"), "--socket", os.fspath(self.socket),
                                      "--metrics-addr", "off",
                                      *([] if gpus == "nvml" else ["--dev-dir", os.fspath(work / "dev")])],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
        deadline = time.monotonic() + 30
        while not (work / "mnt" / "version").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cgpud did not start: {self.log.read_text().strip()[-300:]}")
            time.sleep(0.1)

    def write(self, rel: str, value: str) -> None:
        (self.work / "mnt" / rel).write_text(value)

    def stats(self) -> dict:
        from cgpud.client import Client
        with Client(os.fspath(self.socket)) as c:
            return c.call("stats")[0]

    def start(self, name: str, argv: list[str], weight: int = 1, env: dict | None = None) -> subprocess.Popen:
        e = dict(os.environ, CGPUD_SOCKET=os.fspath(self.socket), **(env or {}))
        if self.gpus != "nvml":  # the stand-in driver keeps the simulated GPU's device open, as a driver does
            argv = ["sh", "-c", 'CGPU_STUB_CUDA_DEVICE="$CGPU_DEVICE" exec "$@"', "sh", *argv]
        return subprocess.Popen([os.fspath(BIN / "cgpu"), "run", "--name", name, "--gpu", "0", "--mem", str(MEMSIZE),
                                 "--weight", str(weight), "--", *argv], env=e, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def run(self, name: str, argv: list[str], timeout: float = 300, **kw) -> dict:
        """The instance's last line of output, a JSON object; its exit status as "rc"."""
        p = self.start(name, argv, **kw)
        out, err = p.communicate(timeout=timeout)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        res = json.loads(lines[-1]) if lines else {}
        res["rc"] = p.returncode
        if p.returncode and "error" not in res:
            res["error"] = (err.strip().splitlines() or [f"exit {p.returncode}"])[-1][:200]
        return res

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


PRELUDE = "import json, os, sys, time\nMEMSIZE = %d\nMIB = 1 << 20\n" % MEMSIZE

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

OOM = {
    "cuda-bindings": ("cuda.bindings", """
        from cuda.bindings import driver as d
        d.cuInit(0); dev = d.cuDeviceGet(0)[1]; ctx = d.cuDevicePrimaryCtxRetain(dev)[1]; d.cuCtxSetCurrent(ctx)
        got, err = 0, None
        while got <= MEMSIZE:
            r = d.cuMemAlloc(64 * MIB)
            if r[0] != d.CUresult.CUDA_SUCCESS:
                err = r[0].name; break
            got += 64 * MIB
        print(json.dumps({"got": got, "error": err}))"""),
    "torch": ("torch", """
        import torch
        held, err = [], None
        try:
            while len(held) * 64 * MIB <= MEMSIZE:
                held.append(torch.empty(64 * MIB, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError as exc:
            err = "OutOfMemoryError"
        got = len(held) * 64 * MIB
        del held
        torch.cuda.empty_cache()
        again = torch.empty(MEMSIZE // 2, dtype=torch.uint8, device="cuda").numel()  # (all given back)
        print(json.dumps({"got": got, "error": err, "again": again}))"""),
    "cupy": ("cupy", """
        import cupy
        held, err = [], None
        try:
            while len(held) * 64 * MIB <= MEMSIZE:
                held.append(cupy.empty(64 * MIB, dtype=cupy.uint8))
        except cupy.cuda.memory.OutOfMemoryError:
            err = "OutOfMemoryError"
        print(json.dumps({"got": len(held) * 64 * MIB, "error": err}))"""),
    "jax": ("jax", """
        import jax, jax.numpy as jnp
        held, err = [], None
        try:
            while len(held) * 64 * MIB <= MEMSIZE:
                held.append(jnp.zeros(64 * MIB, dtype=jnp.uint8).block_until_ready())
        except Exception as exc:
            err = type(exc).__name__ if "RESOURCE_EXHAUSTED" in str(exc) or "out of memory" in str(exc).lower() else repr(exc)[:100]
        print(json.dumps({"got": len(held) * 64 * MIB, "error": err}))"""),
}

GRAPHS = {"torch": ("torch", """
    import torch
    x = torch.randn(2048, 2048, device="cuda")
    s = torch.cuda.Stream()
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

BUSY = {"torch": ("torch", """
    import torch
    x = torch.randn(4096, 4096, device="cuda")
    step, sync = lambda: x @ x, torch.cuda.synchronize
"""), "cupy": ("cupy", """
    import cupy
    x = cupy.arange(int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 24, dtype=cupy.float32)
    y = cupy.empty_like(x)
    step, sync = lambda: cupy.sin(x, out=y), cupy.cuda.Device().synchronize  # (no cuBLAS needed)
""")}
BUSY_LOOP = """
    t0, t1 = float(sys.argv[1]), float(sys.argv[2])
    stamps = []
    while time.monotonic() < t1:
        for _ in range(8):
            step()
        sync()
        stamps.append((time.monotonic(), 8))
    print(json.dumps({"kernels": sum(n for t, n in stamps if t0 <= t <= t1)}))
"""


def code(body: str) -> list[str]:
    return ["-c", PRELUDE + textwrap.dedent(body)]


def checks(node: Node) -> list[tuple[str, Callable[[], tuple[str, str]]]]:
    out: list[tuple[str, Callable[[], tuple[str, str]]]] = []
    mib = MEMSIZE >> 20

    def shown(py: str, body: str) -> tuple[str, str]:
        r = node.run("gpucheckmem1", [py, *code(body)])
        ok = r.get("rc") == 0 and all(t == MEMSIZE for t in r.get("total", [None])) and r.get("free", MEMSIZE + 1) <= MEMSIZE
        return (PASS if ok else FAIL), f"total {[t >> 20 for t in r.get('total', [])]} MiB, free {r.get('free', 0) >> 20} MiB; memsize {mib} MiB {r.get('error', '')}".strip()

    def oom(py: str, body: str, env: dict | None = None) -> tuple[str, str]:
        r = node.run("gpucheckoom1", [py, *code(body)], env=env)
        got = r.get("got", 0)
        ok = r.get("rc") == 0 and r.get("error") and MEMSIZE - 512 * (1 << 20) <= got <= MEMSIZE
        return (PASS if ok else FAIL), f"{got >> 20} MiB of {mib}, then {r.get('error')}; exit {r.get('rc')}"

    for client, (module, body) in SHOWN.items():
        py = python_with(module)
        out.append((f"memsize shown ({client})",
                    (lambda py=py, body=body: shown(py, body)) if py else (lambda m=module: (SKIP, f"{m} not installed"))))
    for client, (module, body) in OOM.items():
        py = python_with(module)
        out.append((f"oom at memsize ({client})",
                    (lambda py=py, body=body: oom(py, body)) if py else (lambda m=module: (SKIP, f"{m} not installed"))))
    torch = python_with("torch")
    out.append(("torch allocator, expandable_segments",
                (lambda: oom(torch, OOM["torch"][1], {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}))
                if torch else (lambda: (SKIP, "torch not installed"))))

    def graphs(py: str, body: str, busy: str) -> tuple[str, str]:
        node.write("0/policy", "1")  # (a neighbour on the same GPU: the gate closes every slice)
        before = node.stats().get("drains", 0)
        size = [str(1 << 17)] if node.gpus != "nvml" else []
        neighbour = node.start("gpucheckbusy", [py, *code(busy + BUSY_LOOP), "0",
                                                str(time.monotonic() + node.startup + node.seconds + 5), *size])
        r = node.run("gpucheckgrph", [py, *code(body), str(node.seconds)])
        neighbour.communicate(timeout=120)
        closings = node.stats().get("drains", 0) - before
        ok = r.get("rc") == 0 and r.get("invalidated") == 0 and r.get("wrong", 1) in (0, None) and r.get("captures", 0) > 0 \
            and closings > 0
        replays = "replays not compared (no contents kept)" if r.get("wrong", 1) is None else f"{r.get('wrong')} wrong replays"
        return (PASS if ok else FAIL), (f"{r.get('captures')} captured, {r.get('invalidated')} invalidated, "
                                        f"{replays}, {closings} closings {r.get('error', '')}").strip()

    def share(py: str, busy: str) -> tuple[str, str]:
        node.write("0/policy", "2")
        t0 = time.monotonic() + node.startup  # (both started: PyTorch and CUDA take seconds to come up)
        t1 = t0 + node.seconds
        size = [str(1 << 17)] if node.gpus != "nvml" else []  # (the stand-in: a kernel of 1 ms, 1024 blocks)
        procs = [node.start(f"gpucheckshr{w}", [py, *code(busy + BUSY_LOOP), str(t0), str(t1), *size], weight=w)
                 for w in (1, 2)]
        got = []
        for p in procs:
            o, e = p.communicate(timeout=120)
            lines = [ln for ln in o.splitlines() if ln.startswith("{")]
            got.append(json.loads(lines[-1])["kernels"] if lines else 0)
        s = got[0] / max(sum(got), 1)
        return (PASS if abs(s - 1 / 3) <= 0.05 else FAIL), f"weight 1 got {s:.3f} of the kernels (want 0.333), {got}"

    for client, (module, body) in GRAPHS.items():
        py = python_with(module)
        out.append((f"graph capture while the gate closes ({client})",
                    (lambda py=py, body=body, c=client: graphs(py, body, BUSY[c][1])) if py
                    else (lambda m=module: (SKIP, f"{m} not installed"))))
    for client, (module, body) in BUSY.items():
        py = python_with(module)
        out.append((f"share 1:2 under policy 2 ({client})",
                    (lambda py=py, body=body: share(py, body)) if py else (lambda m=module: (SKIP, f"{m} not installed"))))

    smi = shutil.which("nvidia-smi")

    def nvidia_smi() -> tuple[str, str]:
        p = node.start("gpuchecksmi1", [smi, "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits"])
        o, e = p.communicate(timeout=60)
        total, used = (int(v) for v in o.strip().splitlines()[0].split(","))
        return (PASS if total == mib and used <= mib else FAIL), f"memory.total {total} MiB, used {used} MiB (memsize {mib})"
    out.append(("nvidia-smi's view", nvidia_smi if smi else (lambda: (SKIP, "nvidia-smi not installed"))))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", action="store_true", help="keep the working directory (the daemon's log)")
    ap.add_argument("--quick", action="store_true", help="the timed checks over 6 s, not 20")
    ap.add_argument("--gpus", default="nvml", help="the daemon's --gpus (default nvml; another, e.g. sim:T4 with "
                    "LD_LIBRARY_PATH naming the stand-in driver, tries the checks where there is no GPU)")
    a = ap.parse_args(argv)
    reason = no_gpu_reason() if a.gpus == "nvml" else None
    if reason:
        print(f"gpu-check: no NVIDIA GPU on this machine ({reason}); nothing checked")
        return NO_GPU
    work = Path(tempfile.mkdtemp(prefix="cgpu-gpu-check-"))
    node = None
    try:
        node = Node(work, a.gpus, a.quick)
        rows = run_checks(checks(node))
    except RuntimeError as exc:
        rows = [Row("daemon on --gpus nvml", FAIL, str(exc)[:300])]
    finally:
        if node:
            node.stop()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
