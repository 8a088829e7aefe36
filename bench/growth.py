"""bench/growth: the driver's own memory as it grows (issue 28, docs/memory.md).

The daemon runs with `--gpus nvml` on the tests' stand-in libnvidia-ml.so.1, whose processes are
the stand-in libcuda's (native/stubs/: its driver memory grows as the H100's did — 2 MiB per module
load and per function's first launch, 70 MiB per instantiated graph; contexts of 500 MiB here),
with libcgpu for `cgpu run` and the memory watchdog killing past memsize (2 GiB instances). The
programs are tests/test_growth.py's. Each figure is printed against a reference measured in the
same run:

1. processes through libcgpu killed while filling their instance, per fill kind (PyTorch's
   caching allocator, JAX, TensorFlow, vLLM, a graph loop), against the same programs through
   the libcgpu of before issue 28 (built from git, BEFORE) in an instance whose usage page has
   the older layout (the watchdog then judges as it did before);
2. what an instance can allocate before out-of-memory, against memsize − the context − 3 %;
3. a process that goes around the library (LD_PRELOAD unset) past memsize: the time until it is
   killed, against the 1 s bound and the watchdog's period;
4. neighbour processes in the export-table process list (nvidia-smi's way), and the neighbour's memory
   its per-pid entry shows, against the same calls
   made without libcgpu in the same instance.

    .venv/bin/python bench/growth.py [--trials 5]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import textwrap
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from common import daemon, pct  # noqa: E402
from nvml_stub import NvmlStub, StubGpu  # noqa: E402
from test_growth import (AFTER, CONTEXT, CONTEXT_MIB, FILLS, GRAPH_LOOP, PYTORCH_FILL, TOP_UP, USE_FIRST, cgpu_run,  # noqa: E402
                         finish, name, neighbour)
from test_libcgpu import build_libs  # noqa: E402
from test_smi_ioctl import LIST  # noqa: E402

from cgpud.gpus import pages  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30
MEMSIZE = 2 * GIB
PERIOD = 0.5

KINDS = {
    "pytorch (fill, then cuBLAS-like first use)": PYTORCH_FILL + "mod = first_use()\n" + TOP_UP,
    **{f"{k} (its defaults)": textwrap.dedent(FILLS[k]) + TOP_UP for k in ("jax", "tensorflow", "vllm")},
    "graph loop after a fill": USE_FIRST + PYTORCH_FILL + GRAPH_LOOP + AFTER,
}
BEFORE = "4a11ec3"  # the commit issue 28's work started from


def before_issue(lib: str) -> str:
    """Code that runs the program again through the libcgpu of before issue 28 (`lib`), its
    instance's page cut to the older layout first (no room for the driver's readings)."""
    return f"""
import os, sys
if os.environ.get("LD_PRELOAD") != {lib!r}:
    os.truncate(os.path.join(os.environ["CGPU_PAGE_DIR"], "usage"), {pages.USAGE_V2_SIZE})
    os.environ["LD_PRELOAD"] = {lib!r}
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[-1], sys.argv[-1]])
"""


def build_before(where: Path) -> str:
    """libcgpu.so as it was at BEFORE, built into `where`."""
    src = where / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", os.path.dirname(HERE), "archive", BEFORE, "native"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", os.fspath(src)], input=archive, check=True)
    subprocess.run(["make", "-s", "-C", os.fspath(src / "native"), "libcgpu", f"LIB={where}",
                    f"ZIG={os.path.join(os.path.dirname(sys.executable), 'python-zig')}"], check=True)
    return os.fspath(where / "libcgpu.so")


def killed(rc: int) -> bool:
    return rc in (137, -9)


def outcome(rc: int, out: str) -> str:
    """killed; alive (it printed so: it ended in out-of-memory); or the program failed."""
    return "killed" if killed(rc) else "alive" if "alive" in out else f"failed (rc {rc})"


def fills(run, old_lib: str) -> None:
    print("1. processes killed while filling a 2 GiB instance (stand-in growth: +2 MiB per load and first launch, "
          "+70 MiB per graph)")
    print(f"   {'fill':44} {'through libcgpu':>16} {f'libcgpu at {BEFORE}':>18}")
    total = [0, 0]
    for kind, code in KINDS.items():
        now = outcome(*finish(cgpu_run(run, name("f"), "2G", CONTEXT + code))[:2])
        before = outcome(*finish(cgpu_run(run, name("o"), "2G", CONTEXT + code, first=before_issue(old_lib)))[:2])
        total[0] += now == "killed"
        total[1] += before == "killed"
        print(f"   {kind:44} {now:>16} {before:>18}")
    now, before = (f"{n} of {len(KINDS)}" for n in total)
    print(f"   {'killed, all kinds (goal 0)':44} {now:>16} {before:>18}")


def room(run) -> None:
    rc, out, err = finish(cgpu_run(run, name("r"), "2G", CONTEXT + PYTORCH_FILL + "print(sum(blocks))\n"))
    if rc or not out.split():
        raise SystemExit(f"the fill failed (rc {rc}): {err.strip()[-600:]}")
    filled = int(out.split()[0])
    floor = MEMSIZE - CONTEXT_MIB * MIB - MEMSIZE * 3 // 100
    print("2. what a 2 GiB instance can allocate before out-of-memory (1 MiB steps, context 500 MiB)")
    print(f"   allocated {filled >> 20} MiB; reference memsize - context - 3 % = {floor >> 20} MiB "
          f"({'at least' if filled >= floor else 'BELOW'}); memsize - context = {(MEMSIZE >> 20) - CONTEXT_MIB} MiB")


def around(run, trials: int) -> None:
    waits = []
    for _ in range(trials):
        p = cgpu_run(run, name("a"), "2G", """
            ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
            big = ok(d.cuMemAlloc(2**31 + 2**28))
            print("past", flush=True)
            import time; time.sleep(20)
        """, around=True)
        line = p.stdout.readline()
        past = time.monotonic()
        rc, _, _ = finish(p)
        if line.strip() == "past" and killed(rc):
            waits.append(time.monotonic() - past)
    print("3. a process around the library (LD_PRELOAD unset) past memsize: time until killed")
    if waits:
        print(f"   {len(waits)} of {trials} killed; p50 {pct(waits, 50):.2f} s, max {max(waits):.2f} s; "
              f"reference: the bound 1 s, the watchdog's period {PERIOD} s")
    else:
        print(f"   none of {trials} killed (reference: all, within 1 s)")


def smi(run) -> None:
    def ask(pid: int, around: bool) -> tuple[int, int]:
        """(neighbours listed by the export table's entry, MiB its per-pid entry shows of the neighbour)"""
        out = finish(cgpu_run(run, name("s"), "2G", "import os\n" + LIST, around=around,
                              first=f"NEIGHBOUR = {pid}\n"))[1].split("\n")
        me, *listed = out[0].split()
        return len([p for p in listed if p != me]), int(out[2].split()[1])

    with neighbour(run) as pid:
        (listed, shown), (bare, bare_shown) = ask(pid, False), ask(pid, True)
    print("4. neighbour processes in the export-table process list (nvidia-smi's way), a neighbour holding 1 GiB")
    print(f"   through libcgpu: {listed} listed, {shown} MiB of its memory shown; the same calls without libcgpu: "
          f"{bare} listed, {bare_shown} MiB shown (goal 0, 0)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cgpud-growth-") as tmp:
        libs = build_libs(Path(tmp) / "libs")
        old_lib = build_before(Path(tmp) / "before")
        stub = NvmlStub(libs, Path(tmp) / "nvml.conf", cuda_state=Path(tmp) / "card.state")
        stub.gpus = [StubGpu("GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789ab")]
        stub.write()
        os.environ.update({**stub.env({}), "CGPU_STUB_CUDA_STATE": os.fspath(Path(tmp) / "card.state"),
                           "CGPU_STUB_CTX_MIB": str(CONTEXT_MIB)})
        with daemon("nvml", ["--libcgpu", os.fspath(libs / "libcgpu.so")], handle=True, devices=("nvidia0",)) as run:
            fills(run, old_lib)
            room(run)
            around(run, args.trials)
            smi(run)


if __name__ == "__main__":
    main()
