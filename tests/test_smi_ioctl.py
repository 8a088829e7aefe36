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
# GET_PID_INFO asked directly, by the driver's own ioctl (NVIDIA's open kernel modules: nv_escape.h's
# NV_ESC_RM_CONTROL 0x2a on magic 'F', nvos.h's NVOS54_PARAMETERS, ctrl2080gpu.h's
# NV2080_CTRL_CMD_GPU_GET_PID_INFO 0x2080018e and its 72-byte entries), about the neighbour's pid
# and its own, each entry as a driver that knows both would fill it: NV_OK and 1 GiB of video
# memory. (Here the ioctl reaches /dev/null, which leaves them so: what comes back is libcgpu's.)
U32, U64 = ctypes.c_uint32, ctypes.c_uint64
class PidInfo(ctypes.Structure):
    _fields_ = [("pid", U32), ("index", U32), ("result", U32), ("pad", U32), ("data", U64 * 6), ("ci", U32), ("gi", U32)]
class PidInfoParams(ctypes.Structure):
    _fields_ = [("count", U32), ("pad", U32), ("entries", PidInfo * 200)]
class Nvos54(ctypes.Structure):
    _fields_ = [("hClient", U32), ("hObject", U32), ("cmd", U32), ("flags", U32), ("params", U64),
                ("paramsSize", U32), ("status", U32)]
assert ctypes.sizeof(PidInfo) == 72 and ctypes.sizeof(Nvos54) == 32
q = PidInfoParams(count=2)
for k, pid in enumerate((NEIGHBOUR, os.getpid())):
    q.entries[k].pid, q.entries[k].result, q.entries[k].data[0] = pid, 0, 1 << 30
rm = Nvos54(cmd=0x2080018E, params=ctypes.addressof(q), paramsSize=ctypes.sizeof(q))
fd = os.open("/dev/null", os.O_RDWR)
ctypes.CDLL(None).ioctl(fd, (3 << 30) | (ctypes.sizeof(Nvos54) << 16) | (ord("F") << 8) | 0x2A, ctypes.byref(rm))
for k in range(2):
    print(q.entries[k].pid, q.entries[k].result, sum(q.entries[k].data) >> 20, flush=True)
"""


def test_nvidia_smis_export_table_lists_no_neighbour_without_a_pid_namespace(watched):
    """A neighbour instance holds 1 GiB. An instance's process asks for the compute processes as
    nvidia-smi does (the export table's entry) and as NVML's clients do (the exported _v3): each
    lists that process alone; asked for the neighbour's pid directly (GET_PID_INFO, the RM control
    itself), the entry comes back failed with no memory in it however the driver filled it, while
    its own is left as the driver gave it. On main the export table listed the neighbour (the H100
    showed its pid and 3590 MiB under `cgpu run`): only the exported names were wrapped."""
    with neighbour(watched) as pid:
        rc, out, err = finish(cgpu_run(watched, name("smi"), "2G", "import os\n" + LIST,
                                       first=f"NEIGHBOUR = {pid}\n"))
    assert rc == 0, (rc, out, err)
    (me, *table), (_, *exported), theirs, mine = (line.split() for line in out.strip().split("\n"))
    assert table == [me] and exported == [me], out
    assert theirs[0] == str(pid) and theirs[1] != "0" and theirs[2] == "0", out  # (a failed entry, nothing in it)
    assert mine == [me, "0", "1024"], out  # (its own: NV_OK, as the driver answered)
