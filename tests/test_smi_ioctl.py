"""nvidia-smi's process list inside an instance (issue 28, docs/isolation.md "What nvidia-smi
shows"): the real nvidia-smi reads it through nvmlInternalGetExportTable's private table, not
through an exported process function (issue 28, on an H100), and every NVML way ends in an RM control
ioctl on /dev/nvidiactl (NV2080_CTRL_CMD_GPU_GET_PIDS). The NVML stand-in lists processes the same
way (native/stubs/libnvidia-ml.c), so libcgpu's ioctl filter is what stands between a `cgpu run`
instance (no PID namespace of its own) and its neighbours' pids."""
from __future__ import annotations

from test_growth import cgpu_run, finish, libs, name, neighbour, watched  # noqa: F401 (fixtures)

LIST = """
import ctypes
ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
mine = ok(d.cuMemAlloc(64 * 2**20))
nvml = ctypes.CDLL("libnvidia-ml.so.1")
assert nvml.nvmlInit_v2() == 0
dev = ctypes.c_void_p()
assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev)) == 0

class Info(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong), ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]

def listed(fn):
    count = ctypes.c_uint(64)
    infos = (Info * 64)()
    assert fn(dev, ctypes.byref(count), infos) == 0
    return sorted(infos[k].pid for k in range(count.value))

# nvidia-smi's way: the private table (the stand-in's: {size, compute processes})
table = ctypes.c_void_p()
assert nvml.nvmlInternalGetExportTable(ctypes.byref(table), b"cgpud-nvml-procs") == 0
PROCS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p)
entry = PROCS(ctypes.cast(table.value + 8, ctypes.POINTER(ctypes.c_void_p))[0])
print(os.getpid(), *listed(entry), flush=True)
print(os.getpid(), *listed(nvml.nvmlDeviceGetComputeRunningProcesses_v3), flush=True)
# the table's other entry: one pid's memory (GET_PID_INFO asked directly), the neighbour's and its own
PID_MEMORY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(ctypes.c_ulonglong))
pid_memory = PID_MEMORY(ctypes.cast(table.value + 16, ctypes.POINTER(ctypes.c_void_p))[0])
for pid in (NEIGHBOUR, os.getpid()):
    held = ctypes.c_ulonglong()
    print(pid_memory(dev, pid, ctypes.byref(held)), held.value >> 20, flush=True)
"""


def test_nvidia_smis_export_table_lists_no_neighbour_without_a_pid_namespace(watched):
    """A neighbour instance holds 1 GiB. An instance's process asks for the compute processes as
    nvidia-smi does (the export table's entry) and as NVML's clients do (the exported _v3): each
    lists that process alone; asked for the neighbour's pid directly (GET_PID_INFO), the driver's
    answer is "not found", while its own 64 MiB is shown. On main the export table listed the
    neighbour (the H100 showed its pid and 3590 MiB under `cgpu run`): only the exported names were
    wrapped."""
    with neighbour(watched) as pid:
        rc, out, err = finish(cgpu_run(watched, name("smi"), "2G", "import os\n" + LIST,
                                       first=f"NEIGHBOUR = {pid}\n"))
    assert rc == 0, (rc, out, err)
    (me, *table), (_, *exported), theirs, mine = (line.split() for line in out.strip().split("\n"))
    assert table == [me] and exported == [me], out
    assert theirs == ["6", "0"] and mine[0] == "0" and int(mine[1]) >= 64, out  # (NVML_ERROR_NOT_FOUND)
