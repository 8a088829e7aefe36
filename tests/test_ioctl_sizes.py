"""libcgpu's filter of the kernel driver's process lists (native/libcgpu/nvml.c, issue 34 item 6):
it reads GET_PIDS and GET_PID_INFO only at their exact known sizes (ctrl2080gpu.h: 3812 and 14408
bytes) — another size is another driver's layout: refused (NV_ERR_INVALID_ARGUMENT), its buffer
wiped, never read at a guessed 72-byte stride — and it leaves `errno` as the ioctl set it."""
from __future__ import annotations

import ctypes
import errno
import os
import struct
import subprocess
import sys
import textwrap

import pytest

from cgpud.gpus import pages
from test_libcgpu import build_libs

NVOS54 = struct.Struct("<4IQ2I")  # hClient, hObject, cmd, flags, params, paramsSize, status
RM_CONTROL = (3 << 30) | (NVOS54.size << 16) | (ord("F") << 8) | 0x2A  # _IOWR('F', NV_ESC_RM_CONTROL, NVOS54)
GET_PIDS, GET_PID_INFO = 0x2080018D, 0x2080018E
PID_INFO = struct.Struct("<4I6Q2I")  # pid, index, result, (pad), data[6], ci, gi: 72 bytes


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    return build_libs(tmp_path_factory.mktemp("ioctl"))


def call(libs, tmp_path, code: str, slot_pids: tuple[int, ...] = ()) -> subprocess.CompletedProcess:
    """`code` in a process of a container (libcgpu preloaded, its page made here with slots for
    `slot_pids`), with `rm(cmd, buffer)`: the RM control ioctl on /dev/null (ENOTTY: the filter runs
    on what the buffer holds, as on a driver's answer), giving (return, errno, status, buffer)."""
    where = tmp_path / "pages"
    pages.create(os.fspath(where), [1 << 30])
    with open(where / "usage", "r+b") as f:
        for k, pid in enumerate(slot_pids):
            f.seek(pages.USAGE_HEAD.size + k * pages.PROC.size)
            f.write(struct.pack("<i", pid))
    env = {"LD_LIBRARY_PATH": os.fspath(libs), "LD_PRELOAD": os.fspath(libs / "libcgpu.so"),
           "CGPU_PAGE_DIR": os.fspath(where), "PATH": os.environ["PATH"]}
    prog = textwrap.dedent(f"""
        import ctypes, os, struct
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open("/dev/null", os.O_RDWR)
        NVOS54 = struct.Struct("<4IQ2I")
        def rm(cmd, data):
            buf = ctypes.create_string_buffer(bytes(data), len(data))
            p = ctypes.create_string_buffer(NVOS54.pack(1, 2, cmd, 0, ctypes.addressof(buf), len(data), 0), NVOS54.size)
            ctypes.set_errno(0)
            r = libc.ioctl(fd, ctypes.c_ulong({RM_CONTROL}), p)
            e = ctypes.get_errno()
            return r, e, NVOS54.unpack(p.raw)[6], buf.raw
    """) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=60)


def test_an_unknown_parameter_size_is_refused_and_wiped(libs, tmp_path):
    """GET_PID_INFO at 8 + 2 x 80 bytes (a driver whose entries are 80 bytes): the neighbour's memory
    in it is wiped and the control refused; at its known size the same entries are filtered by pid
    (the neighbour's wiped, its own kept). On main the 80-byte entries were read at a 72-byte
    stride: the status stayed NV_OK and the own entry's figures were clobbered."""
    r = call(libs, tmp_path, """
        me, theirs = os.getpid(), 1
        def entry(pid, size, mem):  # pid, index, result, pad, data[6] (memPrivate first), ci, gi, padded to size
            return struct.pack("<4I6Q2I", pid, 0, 0, 0, mem, 0, 0, 0, 0, 0, 0, 0).ljust(size, b"\\0")
        odd = struct.pack("<2I", 2, 0) + entry(theirs, 80, 3 << 30) + entry(me, 80, 5 << 20)
        r, e, status, out = rm(0x2080018E, odd)
        print(status, out.count(b"\\0") == len(out))
        known = (struct.pack("<2I", 2, 0) + entry(theirs, 72, 3 << 30) + entry(me, 72, 5 << 20)).ljust(14408, b"\\0")
        r, e, status, out = rm(0x2080018E, known)
        print(status, struct.unpack_from("<4I6Q", out, 8)[4], struct.unpack_from("<4I6Q", out, 80)[4])
    """, slot_pids=())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0].split() == [str(0x1F), "True"], r.stdout
    # the known layout: the neighbour's 3 GiB gone; its own... not in a slot here (no CUDA use): gone too
    assert r.stdout.split("\n")[1].split() == ["0", "0", "0"], r.stdout


def test_errno_is_the_ioctls_after_the_filter(libs, tmp_path):
    """A GET_PIDS that fails (ENOTTY) naming a pid with a slot whose /proc entry is gone: the filter's
    own look at /proc fails (ENOENT) but the caller still reads the ioctl's ENOTTY (on main: ENOENT)."""
    gone = 4194000  # (above any pid this machine has handed out: no /proc entry)
    assert not os.path.exists(f"/proc/{gone}")
    r = call(libs, tmp_path, f"""
        table = struct.pack("<3I", 0, 0, 1) + struct.pack("<I", {gone})
        r, e, status, out = rm(0x2080018D, table.ljust(3812, b"\\0"))
        print(r, e)
    """, slot_pids=(gone,))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["-1", str(errno.ENOTTY)]
