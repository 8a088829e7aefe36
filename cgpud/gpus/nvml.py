"""Real GPUs through NVML (the `nvidia-ml-py` package's `pynvml`): `--gpus nvml`.

    with Nvml() as nv:
        infos = nv.gpus()              # [GpuInfo]: index, UUID, name, total memory, minor
        nv.processes(0)                # {pid: bytes} of the compute processes on GPU 0
        nv.sample()                    # [GpuSample]: the above plus utilisation, per GPU

pynvml loads `libnvidia-ml.so.1` with the dynamic loader's search (the driver
installs it; LD_LIBRARY_PATH can point elsewhere, which is how the tests load
their stand-in). Every NVML failure becomes an `NvmlError` whose message is
one line naming the NVML_ERROR_* constant, what failed and what to do; a
failure at start (no library, no driver, a device that does not answer) is
a `BadSpec`, so the daemon refuses to start with that line.

In a container (the DaemonSet, docs/kubernetes.md) the library is there when
NVIDIA's container toolkit put it in (NVIDIA_VISIBLE_DEVICES=all,
NVIDIA_DRIVER_CAPABILITIES=utility); on a node without the toolkit the host's
root is mounted and $CGPUD_DRIVER_ROOT (`cgpud serve --driver-root`) names it:
when the loader finds no libnvidia-ml.so.1, it is looked for in the driver's
usual directories below that root (DRIVER_LIB_DIRS) and loaded from there.

NVML numbers GPUs by PCI bus order, as `nvidia-smi` does; that is our index.
A GPU's device file is `/dev/nvidia<minor>` (the minor is not always the index).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from cgpud.core.model import GpuInfo
from cgpud.gpus.sim import MAX_GPUS, BadSpec

NVIDIA_MAJOR = 195  # the char-device major of /dev/nvidia* (fixed by the driver)
HINT = "install the NVIDIA driver or use --gpus sim:T4"
PROCS_V3 = "nvmlDeviceGetComputeRunningProcesses"  # pynvml: _v3, or NVMLLibraryMismatchError without it
PROCS_V2 = "nvmlDeviceGetComputeRunningProcesses_v2"


# where drivers put libnvidia-ml.so.1, below a host's root: Debian/Ubuntu, RHEL and others, NVIDIA's GPU
# operator's driver container, GKE's COS nodes
DRIVER_LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib", "lib/x86_64-linux-gnu", "lib64",
                   "run/nvidia/driver/usr/lib/x86_64-linux-gnu", "run/nvidia/driver/usr/lib64",
                   "home/kubernetes/bin/nvidia/lib64", "usr/local/nvidia/lib64", "usr/lib/aarch64-linux-gnu")
LIBRARY = "libnvidia-ml.so.1"


def find_in_driver_root(root: str) -> str | None:
    """The host's libnvidia-ml.so.1 below `root` (None: none there)."""
    from cgpud.core.hostroot import resolve

    for d in DRIVER_LIB_DIRS:
        found = resolve(root, os.path.join(d, LIBRARY))
        if found:
            return found
    return None


def _load_from_driver_root(nv) -> str | None:
    """Load the host's library for pynvml (what it would have found itself); its path, or None."""
    root = os.environ.get("CGPUD_DRIVER_ROOT")
    if not root or getattr(nv, "nvmlLib", None) is not None:
        return None
    path = find_in_driver_root(root)
    if path is None:
        return None
    import ctypes

    try:
        nv.nvmlLib = ctypes.CDLL(path)
    except OSError:
        return None
    return path


class NvmlError(BadSpec):
    """An NVML call failed; str() is one line for a person."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


def _pynvml():
    with warnings.catch_warnings():  # the deprecated `pynvml` wrapper package warns on import
        warnings.simplefilter("ignore")
        try:
            import pynvml
        except ImportError:
            raise NvmlError(f"NVML not available: the Python binding (package nvidia-ml-py) is not installed; {HINT}") from None
    return pynvml


def error_name(code: int) -> str:
    """NVML_ERROR_* name of a return code (the number if unknown)."""
    nv = _pynvml()
    for name in dir(nv):
        if name.startswith("NVML_ERROR_") and getattr(nv, name) == code:
            return name
    return f"NVML error {code}"


# What to do about the errors a person can do something about.
_ADVICE = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": HINT,
    "NVML_ERROR_DRIVER_NOT_LOADED": "load the NVIDIA kernel driver (modprobe nvidia), install it, or use --gpus sim:T4",
    "NVML_ERROR_NO_PERMISSION": "run cgpud as root",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": "the NVIDIA library and kernel module differ in version: reload the driver or reboot",
    "NVML_ERROR_FUNCTION_NOT_FOUND": "the NVIDIA driver is older than this call: update the driver",
    "NVML_ERROR_GPU_IS_LOST": "the GPU fell off the bus: check it (nvidia-smi, dmesg) and reset or reboot",
    "NVML_ERROR_RESET_REQUIRED": "reset the GPU (nvidia-smi -r) or reboot",
}


def describe(exc: BaseException, what: str) -> NvmlError:
    """One line for a pynvml exception raised while doing `what`."""
    nv = _pynvml()
    code = getattr(exc, "value", None)
    if isinstance(exc, nv.NVMLError) and isinstance(code, int):
        name = error_name(code)
        try:
            text = str(exc)
        except Exception:  # str() asks the library itself for unknown codes
            text = ""
        line = f"{what}: {name}" + (f" ({text})" if text and text != name else "")
        advice = _ADVICE.get(name)
        if name in ("NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED", "NVML_ERROR_LIB_RM_VERSION_MISMATCH"):
            line = f"NVML not available: {line}"
            if name == "NVML_ERROR_LIBRARY_NOT_FOUND":
                line += ", libnvidia-ml.so.1 is not on this machine"
        return NvmlError(line + (f"; {advice}" if advice else ""), code)
    return NvmlError(f"{what}: {type(exc).__name__}: {exc}")


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class GpuSample:
    """One look at one GPU: its compute processes, memory and utilisation."""

    index: int
    procs: dict[int, int]  # pid -> bytes (None from NVML, e.g. no permission: 0)
    memory_used: int
    memory_total: int
    utilization: int  # % of the last sample period a kernel ran
    memory_utilization: int  # % of it memory was read or written


class Nvml:
    """One NVML session (nvmlInit .. nvmlShutdown). Not thread-safe by itself;
    NVML is, so separate sessions may run in separate threads."""

    def __init__(self) -> None:
        self._nv = _pynvml()
        self._handles: list = []
        self._open = False
        self._procs_fn = PROCS_V3

    def open(self) -> "Nvml":
        nv = self._nv
        try:
            nv.nvmlInit()
        except Exception as exc:
            err = describe(exc, "nvmlInit")
            if err.code != getattr(nv, "NVML_ERROR_LIBRARY_NOT_FOUND", None) or not _load_from_driver_root(nv):
                root = os.environ.get("CGPUD_DRIVER_ROOT")
                if root and err.code == getattr(nv, "NVML_ERROR_LIBRARY_NOT_FOUND", None):
                    err = NvmlError(f"{err} (nor below --driver-root {root}: looked in "
                                    f"{', '.join(DRIVER_LIB_DIRS[:3])}, …)", err.code)
                raise err from None
            try:
                nv.nvmlInit()
            except Exception as exc2:
                raise describe(exc2, "nvmlInit") from None
        self._open = True
        try:
            count = nv.nvmlDeviceGetCount()
        except Exception as exc:
            self.close()
            raise describe(exc, "nvmlDeviceGetCount") from None
        handles = []
        for i in range(count):
            try:
                handles.append(nv.nvmlDeviceGetHandleByIndex(i))
            except Exception as exc:
                self.close()
                raise describe(exc, f"GPU {i}: nvmlDeviceGetHandleByIndex") from None
        self._handles = handles
        return self

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                self._nv.nvmlShutdown()
            except Exception:
                pass

    def __enter__(self) -> "Nvml":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def count(self) -> int:
        return len(self._handles)

    def _call(self, index: int, fn: str, *args):
        try:
            return getattr(self._nv, fn)(self._handles[index], *args)
        except Exception as exc:
            raise describe(exc, f"GPU {index}: {fn}") from None

    def driver_version(self) -> str:
        try:
            return _text(self._nv.nvmlSystemGetDriverVersion())
        except Exception as exc:
            raise describe(exc, "nvmlSystemGetDriverVersion") from None

    def gpu(self, index: int) -> GpuInfo:
        mem = self._call(index, "nvmlDeviceGetMemoryInfo")
        return GpuInfo(
            index=index,
            uuid=_text(self._call(index, "nvmlDeviceGetUUID")),
            name=_text(self._call(index, "nvmlDeviceGetName")),
            memory=int(mem.total),
            major=NVIDIA_MAJOR,
            minor=int(self._call(index, "nvmlDeviceGetMinorNumber")),
        )

    def gpus(self) -> list[GpuInfo]:
        return [self.gpu(i) for i in range(self.count)]

    def processes(self, index: int) -> dict[int, int]:
        """The compute processes on GPU `index` and the memory each uses (bytes).
        Drivers before R510 have no _v3 of the call: then _v2 (same fields)."""
        out: dict[int, int] = {}
        fn = self._procs_fn
        try:
            found = self._call(index, fn)
        except NvmlError as exc:
            if fn != PROCS_V3 or exc.code not in (None, self._nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                raise
            self._procs_fn = PROCS_V2
            found = self._call(index, PROCS_V2)
        for p in found:
            out[int(p.pid)] = out.get(int(p.pid), 0) + int(p.usedGpuMemory or 0)
        return out

    def sample_gpu(self, i: int) -> GpuSample:
        mem = self._call(i, "nvmlDeviceGetMemoryInfo")
        util = self._call(i, "nvmlDeviceGetUtilizationRates")
        return GpuSample(i, self.processes(i), int(mem.used), int(mem.total), int(util.gpu), int(util.memory))

    def sample(self) -> list[GpuSample]:
        return [self.sample_gpu(i) for i in range(self.count)]

    def look(self) -> tuple[list[GpuSample], list[NvmlError]]:
        """Every GPU that answers, and the errors of those that do not."""
        out, errors = [], []
        for i in range(self.count):
            try:
                out.append(self.sample_gpu(i))
            except NvmlError as exc:
                errors.append(exc)
        return out, errors


def discover_nvml() -> list[GpuInfo]:
    """`--gpus nvml`: every GPU NVML sees (at most MAX_GPUS)."""
    with Nvml() as nv:
        if nv.count == 0:
            raise NvmlError(f"NVML sees no GPU on this machine (driver {nv.driver_version()}); use --gpus sim:T4")
        if nv.count > MAX_GPUS:
            raise NvmlError(f"NVML sees {nv.count} GPUs; at most {MAX_GPUS} (inst_ctl names a GPU with one digit)")
        return nv.gpus()


def device_files(infos: list[GpuInfo], dev_dir: str = "/dev") -> list[str]:
    """Each GPU's device file, `<dev_dir>/nvidia<minor>`, by index: what a
    process using the GPU holds open (the activity monitor watches it).
    A missing one is an NvmlError (the daemon's start fails with it)."""
    out = []
    for g in infos:
        minor = g.index if g.minor is None else g.minor
        path = os.path.join(dev_dir, f"nvidia{minor}")
        if not os.path.exists(path):
            raise NvmlError(f"GPU {g.index} ({g.uuid}) has minor number {minor}, but {path} does not exist: "
                            f"load the NVIDIA driver (nvidia-modprobe -c {minor}), or give --dev-dir where its "
                            f"nvidiaN files are")
        out.append(path)
    return out
