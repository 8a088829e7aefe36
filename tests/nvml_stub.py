"""The stand-in NVML library for tests: built by native/Makefile (`stubs`) from
native/stubs/libnvidia-ml.c into a directory of its own, loaded by the real
pynvml in a child process through LD_LIBRARY_PATH, scripted through a text
file ($CGPU_NVML_STUB) that the library reads again at every call.

    stub = NvmlStub.build(tmp_path)
    stub.gpus = [StubGpu(uuid="GPU-…", name="Tesla T4", total=15843721216)]
    stub.procs = {(0, pid): 1 << 30}     # compute processes; .graphics and .mps the others
    stub.putil = {(0, pid): (70, 20, 0, 0)}  # a process's utilisation sample: sm, mem, enc, dec %
    stub.write()                         # atomically: the daemon may be reading
    stub.xid(0, 79); stub.write()        # a critical Xid event on GPU 0 (stub.ecc(0): a double-bit ECC error)
    stub.gpus[0].lost = True; stub.write()   # GPU 0 fell off the bus (False again: reset)
    env = stub.env()                     # for subprocess.Popen(env=…)
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parent.parent / "native"
MIB = 1 << 20
T4_TOTAL = 15360 * MIB  # what NVML reports as a T4's total (nvidia-smi shows 15109 MiB usable)


@dataclass
class StubGpu:
    uuid: str
    name: str = "Tesla T4"
    total: int = T4_TOTAL
    minor: int | None = None  # None: the index
    used: int = 0  # besides the processes'
    util: int = 0
    memutil: int = 0
    fail: dict[str, int] = field(default_factory=dict)  # NVML function -> return code
    # the sensors: power (mW), temperature (C), fan (%), performance state, SM clock (MHz),
    # energy since the driver loaded (mJ), encoder and decoder utilisation (%)
    sensors: tuple[int, int, int, int, int, int, int, int] = (70000, 45, 30, 0, 1590, 10**9, 0, 0)
    lost: bool = False  # fallen off the bus: every call on it is NVML_ERROR_GPU_IS_LOST
    ecc: bool = True  # False: no ECC event types supported (a GeForce)


@dataclass
class NvmlStub:
    libdir: Path
    config: Path
    gpus: list[StubGpu] = field(default_factory=list)
    procs: dict[tuple[int, int], int] = field(default_factory=dict)  # (gpu, pid) -> bytes: compute
    graphics: dict[tuple[int, int], int] = field(default_factory=dict)  # graphics processes
    mps: dict[tuple[int, int], int] = field(default_factory=dict)  # MPS clients
    putil: dict[tuple[int, int], tuple[int, int, int, int]] = field(default_factory=dict)  # sm, mem, enc, dec
    init_rc: int = 0
    driver: str = "550.54.15"
    cuda_state: Path | None = None  # the stand-in libcuda's state file: its processes shown too
    cuda_pid_offset: int = 0  # ... by their PID plus this (NVML names a container's processes by host PIDs)
    events: list[tuple[int, str, int]] = field(default_factory=list)  # (gpu, "xid"|"ecc", xid): append only

    def xid(self, gpu: int, code: int) -> None:
        """A critical Xid error on `gpu` (delivered to event sets registered before it; write() to send)."""
        self.events.append((gpu, "xid", code))

    def ecc(self, gpu: int) -> None:
        """A double-bit ECC error on `gpu`."""
        self.events.append((gpu, "ecc", 0))

    @classmethod
    def build(cls, where: Path, old_driver: bool = False) -> "NvmlStub":
        """old_driver: without nvmlDeviceGetComputeRunningProcesses_v3 (_v2 instead), as before R510."""
        if shutil.which("gcc") is None or shutil.which("make") is None:
            pytest.fail("gcc or make is missing (scripts/setup.sh installs them): the NVML stand-in cannot be built")
        libdir = where / "nvml-lib"
        r = subprocess.run(["make", "-s", "-B", "-C", str(NATIVE), "stubs", f"STUBS={libdir}",
                            f"STUB_FLAGS={'-DSTUB_OLD_DRIVER' if old_driver else ''}"],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.fail(f"building the NVML stand-in failed:\n{r.stderr}")
        return cls(libdir, where / "nvml-stub.conf")

    def text(self) -> str:
        lines = [f"init {self.init_rc}", f"driver {self.driver}"]
        for i, g in enumerate(self.gpus):
            minor = i if g.minor is None else g.minor
            lines.append(f"gpu {i} {minor} {g.total} {g.used} {g.util} {g.memutil} {g.uuid} {g.name}")
            lines += [f"fail {i} {fn} {rc}" for fn, rc in g.fail.items()]
            lines.append(f"sensors {i} {' '.join(map(str, g.sensors))}")
            lines += [f"lost {i}"] if g.lost else []
            lines += [] if g.ecc else [f"noecc {i}"]
        lines += [f"proc {gpu} {pid} {n}" for (gpu, pid), n in self.procs.items()]
        lines += [f"proc {gpu} {pid} {n} graphics" for (gpu, pid), n in self.graphics.items()]
        lines += [f"proc {gpu} {pid} {n} mps" for (gpu, pid), n in self.mps.items()]
        lines += [f"putil {gpu} {pid} {' '.join(map(str, u))}" for (gpu, pid), u in self.putil.items()]
        if self.cuda_state is not None:
            lines.append(f"cuda {self.cuda_state} {self.cuda_pid_offset}")
        lines += [f"event {gpu} {kind} {code}" for gpu, kind, code in self.events]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(self.text())
        os.replace(tmp, self.config)

    def env(self, base: dict | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["LD_LIBRARY_PATH"] = str(self.libdir)
        env["CGPU_NVML_STUB"] = str(self.config)
        return env
