"""The stand-in NVML library for tests: built with gcc from
tests/nvml_stub/libnvidia-ml.c into a directory of its own, loaded by the real
pynvml in a child process through LD_LIBRARY_PATH, scripted through a text
file ($CGPU_NVML_STUB) that the library reads again at every call.

    stub = NvmlStub.build(tmp_path)
    stub.gpus = [StubGpu(uuid="GPU-…", name="Tesla T4", total=15843721216)]
    stub.procs = {(0, pid): 1 << 30}
    stub.write()                         # atomically: the daemon may be reading
    env = stub.env()                     # for subprocess.Popen(env=…)
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SOURCE = Path(__file__).parent / "nvml_stub" / "libnvidia-ml.c"
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


@dataclass
class NvmlStub:
    libdir: Path
    config: Path
    gpus: list[StubGpu] = field(default_factory=list)
    procs: dict[tuple[int, int], int] = field(default_factory=dict)  # (gpu, pid) -> bytes
    init_rc: int = 0
    driver: str = "550.54.15"

    @classmethod
    def build(cls, where: Path, old_driver: bool = False) -> "NvmlStub":
        """old_driver: without nvmlDeviceGetComputeRunningProcesses_v3 (_v2 instead), as before R510."""
        gcc = shutil.which("gcc")
        if gcc is None:
            pytest.fail("gcc is missing (scripts/setup.sh installs it): the NVML stand-in cannot be built")
        libdir = where / "nvml-lib"
        libdir.mkdir(parents=True, exist_ok=True)
        lib = libdir / "libnvidia-ml.so.1"
        r = subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wl,-soname,libnvidia-ml.so.1",
                            *(["-DSTUB_OLD_DRIVER"] if old_driver else []), "-o", str(lib), str(SOURCE)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.fail(f"building the NVML stand-in failed:\n{r.stderr}")
        (libdir / "libnvidia-ml.so").symlink_to("libnvidia-ml.so.1")
        return cls(libdir, where / "nvml-stub.conf")

    def text(self) -> str:
        lines = [f"init {self.init_rc}", f"driver {self.driver}"]
        for i, g in enumerate(self.gpus):
            minor = i if g.minor is None else g.minor
            lines.append(f"gpu {i} {minor} {g.total} {g.used} {g.util} {g.memutil} {g.uuid} {g.name}")
            lines += [f"fail {i} {fn} {rc}" for fn, rc in g.fail.items()]
        lines += [f"proc {gpu} {pid} {n}" for (gpu, pid), n in self.procs.items()]
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
