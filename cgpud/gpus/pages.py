"""The per-container pages the daemon shares with libcgpu (docs/isolation.md),
in the layout of native/libcgpu/cgpu_page.h (a test compiles the header and
compares): `limits` (the container's memsize per GPU and its compute gates,
one per GPU and the container's, read-only to it), `usage` (what its processes hold, per GPU and per process,
and which processes answer the gate) and `drained` (a FIFO: a byte from a
process that has finished its queued work after the gate closed).
cgpud.sched.gate drives the gate."""
from __future__ import annotations

import errno
import os
import stat
import struct
import uuid
from typing import NamedTuple

MAGIC = 0x55504743  # "CGPU"
VERSION = 2
MAX_GPUS = 16
MAX_PROCS = 256
LIMITS = struct.Struct(f"<4I{MAX_GPUS}Q2I2I{MAX_GPUS}I{16 * MAX_GPUS}s")
GATE_OFFSET = 16 + 8 * MAX_GPUS  # uint32 gate, the container's: odd open, even closed
QUEUE_BUDGET_OFFSET = GATE_OFFSET + 4  # uint32: µs of GPU work a process may queue ahead on a shared GPU (0: default)
QUEUE_BUDGET_US_DEFAULT = 2000
SHARED_GATE_SIZE = GATE_OFFSET + 8  # a page made by an older cgpud ends here: its container has that one gate
CLOSINGS_OFFSET = SHARED_GATE_SIZE  # uint32: how many times any GPU's gate closed
SHARED_OFFSET = CLOSINGS_OFFSET + 4  # uint32: bit k, the scheduler may stop the container on GPU k's node GPU
SHARED_ALL = (1 << MAX_GPUS) - 1  # what a page starts with: bounded until the scheduler says it runs alone
GPU_GATE_OFFSET = CLOSINGS_OFFSET + 8  # uint32 per GPU of the page: its gate
UUID_OFFSET = GPU_GATE_OFFSET + 4 * MAX_GPUS  # 16 bytes per GPU of the page: its UUID (zero: not known)
GATE_OPEN = 1
PROC = struct.Struct(f"<i3I{MAX_GPUS}Q")
PROC_HEAD = struct.Struct("<i3I")  # a slot's pid, gated (1: the container's gate, 2: per GPU), acked, gpus
GATED_SHARED, GATED_PER_GPU = 1, 2
PROC_DRAINING = 1 << 31  # in a slot's `gpus`: its helper thread is draining a closing now
USAGE_HEAD = struct.Struct(f"<2I{MAX_GPUS}Q{MAX_PROCS // 32}I")  # magic, version, used, gated_slots
GATED_OFFSET = 8 + 8 * MAX_GPUS
GATED = struct.Struct(f"<{MAX_PROCS // 32}I")
USAGE_V2_SIZE = USAGE_HEAD.size + MAX_PROCS * PROC.size  # struct cgpu_usage (an older cgpud's page ends here)
# struct cgpu_usage_driver: the driver's own memory, after it (docs/memory.md)
WATCHED_OFFSET = USAGE_V2_SIZE  # uint32: 1 once the daemon's watchdog reads NVML for the container
STEP = struct.Struct(f"<{MAX_GPUS}Q")  # libcgpu: the largest growth between two readings, per GPU
DRIVER = struct.Struct(f"<Ii{3 * MAX_GPUS}Q")  # seq, pid, nvml[], allocs[], driver[]: per slot
DRIVER_OFFSET = USAGE_V2_SIZE + 8 + STEP.size
DRIVER_SIZE = DRIVER_OFFSET + MAX_PROCS * DRIVER.size  # (an older cgpud's page ends here)
# struct cgpu_usage_busy: the GPU time each slot's process got, per GPU (docs/scheduler.md, "The charge")
BUSY = struct.Struct(f"<Ii{MAX_GPUS}Q")  # timed, pid, ns[]: per slot
BUSY_OFFSET = DRIVER_SIZE
USAGE_SIZE = BUSY_OFFSET + MAX_PROCS * BUSY.size
# struct cgpu_usage_gang: a gang's launches per slot, libcgpu's own (docs/isolation.md, "Gangs");
# the file is made this long, the daemon reads only the first USAGE_SIZE bytes
GANG = struct.Struct(f"<{2 * MAX_GPUS}Q")  # launched[], base[]: per slot
GANG_OFFSET = USAGE_SIZE
# struct cgpu_usage_ident: who each slot's process is beyond its pid (issue 34, item 6): libcgpu's, but
# read_claim, the daemon's (written inside a reading's seq: the claim of the slot the reading is for)
IDENT = struct.Struct("<iIQQQQ")  # pid, reserved, start (clock ticks after boot), pidns (inode), claim, read_claim
IDENT_OFFSET = GANG_OFFSET + MAX_PROCS * GANG.size
IDENT_END = IDENT_OFFSET + MAX_PROCS * IDENT.size  # (an older cgpud's page ends here)
# struct cgpu_usage_follow: how far the daemon's readings were applied to each slot (issue 45, item 7),
# libcgpu's own: any process of the instance applies a sleeping sibling's reading
FOLLOW = struct.Struct(f"<IIQII{MAX_GPUS}Q")  # lock, applied, claim, read_before, reserved, last_want[]
FOLLOW_OFFSET = IDENT_END
USAGE_FILE_SIZE = FOLLOW_OFFSET + MAX_PROCS * FOLLOW.size


def create(directory: str, memsizes: list[int], uuids: list[str] | None = None) -> None:
    """Make a container's pages: its limits (mode 0444) and an empty usage page (0666)."""
    limits = _limits(memsizes, uuids)
    os.makedirs(directory, exist_ok=True)
    _write(os.path.join(directory, "limits"), limits, 0o444)
    _write(os.path.join(directory, "usage"), _empty_usage(), 0o666)
    _fifo(directory)


def _limits(memsizes: list[int], uuids: list[str] | None = None) -> bytes:
    if not 0 < len(memsizes) <= MAX_GPUS:
        raise ValueError(f"1 to {MAX_GPUS} GPUs, not {len(memsizes)}")
    if uuids is not None and len(uuids) != len(memsizes):
        raise ValueError(f"{len(uuids)} UUIDs for {len(memsizes)} GPUs")
    return LIMITS.pack(MAGIC, VERSION, len(memsizes), 0, *memsizes, *[0] * (MAX_GPUS - len(memsizes)),
                       GATE_OPEN, 0, 0, SHARED_ALL, *[GATE_OPEN] * MAX_GPUS, b"".join(map(uuid_bytes, uuids or [])))


def uuid_bytes(text: str | None) -> bytes:
    """A GPU's UUID as NVML writes it ("GPU-8-4-4-4-12" hex digits) in its 16 bytes; zeros when it
    is not one (the library then goes by CUDA's device numbers)."""
    try:
        return uuid.UUID(text.removeprefix("GPU-")).bytes if text else bytes(16)
    except ValueError:
        return bytes(16)


def _empty_usage() -> bytes:
    return USAGE_HEAD.pack(MAGIC, VERSION, *[0] * (MAX_GPUS + MAX_PROCS // 32)) + bytes(USAGE_FILE_SIZE - USAGE_HEAD.size)


def _fifo(directory: str) -> None:
    path = os.path.join(directory, "drained")
    try:
        os.mkfifo(path, 0o622)
    except FileExistsError:
        return
    os.chmod(path, 0o622)  # (not the umask's: any user of the container writes to it)


def _write(path: str, data: bytes, mode: int) -> None:
    tmp = f"{path}.tmp"
    try:  # (a name the container may have made in its pages' directory: never followed, never written through)
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def open_page(directory: str, name: str, flags: int = os.O_RDONLY) -> int:
    """The page `name` of the pages' directory, opened with `flags`, only when it is a regular file:
    never through a symbolic link, and nothing else is opened at all (the directory is writable from
    the container: a FIFO put there would block the daemon's open, a link would take its reads and
    writes to a file of the host's, a device node would be opened on the host). Its type is read from
    an O_PATH descriptor first, then that same file is opened. OSError (ELOOP, EINVAL) otherwise."""
    path = os.path.join(directory, name)
    at = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        mode = os.fstat(at).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.ELOOP if stat.S_ISLNK(mode) else errno.EINVAL,
                          "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file", path)
        return os.open(f"/proc/self/fd/{at}", flags | os.O_CLOEXEC | os.O_NOCTTY)
    finally:
        os.close(at)


def _read(directory: str, name: str, size: int, offset: int = 0) -> bytes:
    fd = open_page(directory, name)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def used(directory: str) -> list[int]:
    """What the container's processes hold now, per GPU."""
    head = USAGE_HEAD.unpack(_read(directory, "usage", USAGE_HEAD.size))
    return list(head[2:2 + MAX_GPUS])


def used_on(directory: str, gpu_uuid: str, default: int) -> int:
    """What the container's processes hold on the GPU with UUID `gpu_uuid`: the page's GPU that
    names it, or, in a page that names none (an older cgpud's), its GPU `default`."""
    return used(directory)[gpu_index(directory, gpu_uuid, default)]


def gpu_index(directory: str, gpu_uuid: str, default: int) -> int:
    """The page's GPU with UUID `gpu_uuid`; in a page that names none (an older cgpud's), `default`."""
    limits = _read(directory, "limits", LIMITS.size)
    named = [limits[UUID_OFFSET + 16 * i:UUID_OFFSET + 16 * (i + 1)] for i in range(MAX_GPUS)]
    want = uuid_bytes(gpu_uuid)
    return named.index(want) if want != bytes(16) and want in named else default


def held_by(directory: str) -> dict[int, list[int]]:
    """pid -> bytes per GPU, for each process slot in use."""
    raw = _read(directory, "usage", MAX_PROCS * PROC.size, USAGE_HEAD.size)
    out = {}
    for k in range(MAX_PROCS):
        pid, _, _, _, *held = PROC.unpack_from(raw, k * PROC.size)
        if pid > 0:
            out[pid] = held
    return out


class Slot(NamedTuple):
    index: int
    pid: int  # in the container's PID namespace
    held: list[int]  # per GPU of the page: what libcgpu charges for it
    driver: list[int]  # of it, the driver's own memory (none in an older cgpud's page)
    start: int = 0  # its process's start time (/proc/<pid>/stat field 22; 0: not recorded, an older page)
    claim: int = 0  # the taking's token: a reading for the slot carries it (cgpu_page.h, struct cgpu_ident)


def started(pid: int) -> int | None:
    """Process `pid`'s start time as this process's /proc shows it (field 22 of its stat: clock ticks after
    boot), None when there is no such process or it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return int(raw[raw.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _ns(pid: int | str, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def same_process(slot: Slot, pid: int) -> bool:
    """Is process `pid` (in this process's namespace) the one that took `slot`? By its start time where
    the slot records one and the process's clock of boot is this one's (a time namespace shifts it); a
    slot without a record (an older libcgpu's) is the pid's."""
    if not slot.start or _ns(pid, "time") != _ns("self", "time"):
        return True
    return started(pid) == slot.start


def slots(directory: str) -> tuple[dict[int, Slot], bool]:
    """The process slots in use, by pid, and whether the page has room for the driver's readings
    (an older cgpud's page has not)."""
    raw = _read(directory, "usage", USAGE_FILE_SIZE)
    readings = len(raw) >= DRIVER_SIZE
    idents = len(raw) >= IDENT_END
    out = {}
    for k in range(MAX_PROCS):
        pid, _, _, _, *held = PROC.unpack_from(raw, USAGE_HEAD.size + k * PROC.size)
        if pid > 0:
            driver = list(DRIVER.unpack_from(raw, DRIVER_OFFSET + k * DRIVER.size)[2 + 2 * MAX_GPUS:]) if readings \
                else [0] * MAX_GPUS
            ipid, _, start, _, claim, _ = IDENT.unpack_from(raw, IDENT_OFFSET + k * IDENT.size) if idents \
                else (0, 0, 0, 0, 0, 0)
            out[pid] = Slot(k, pid, held, driver, *((start, claim) if ipid == pid else (0, 0)))
    return out, readings


def mark_watched(directory: str) -> bool:
    """Say in the page that the daemon's watchdog reads NVML for the container (libcgpu then keeps a
    headroom for the driver's growth); False for an older cgpud's page, which has no room for it."""
    fd = open_page(directory, "usage", os.O_RDWR)
    try:
        if os.fstat(fd).st_size < DRIVER_SIZE:
            return False
        if os.pread(fd, 4, WATCHED_OFFSET) != struct.pack("<I", 1):
            os.pwrite(fd, struct.pack("<I", 1), WATCHED_OFFSET)
        return True
    finally:
        os.close(fd)


SLOT_FLAGS_OFFSET = WATCHED_OFFSET + 4  # uint32 (cgpu_usage_driver.flags): libcgpu's
SLOTS_LOCKED = 1  # in it: every live slot's process holds an OFD read lock on its slot's LIVENESS_BYTE
LIVENESS_BYTE = 4
_FLOCK = struct.Struct("=hh4xqqi4x")  # struct flock (x86_64, aarch64): type, whence, start, len, pid
_atomic = None


def _libatomic():
    """libatomic's lock-free __atomic_* entry points (the same instructions libcgpu's builtins are), or
    None where it is not installed: the daemon then leaves dead slots to libcgpu's processes."""
    global _atomic
    if _atomic is None:
        import ctypes
        import ctypes.util
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("atomic") or "libatomic.so.1")
            for fn, ret, args in (("__atomic_compare_exchange_4", ctypes.c_bool,
                                   [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_int]),
                                  ("__atomic_exchange_8", ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]),
                                  ("__atomic_fetch_sub_8", ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]),
                                  ("__atomic_fetch_and_4", ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int]),
                                  ("__atomic_store_4", None, [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int])):
                getattr(lib, fn).restype = ret
                getattr(lib, fn).argtypes = args
            _atomic = lib
        except OSError:
            _atomic = False
    return _atomic or None


def _reused(idents: bytes, k: int, pid: int) -> bool:
    """Slot k's record says its process was another than the one `pid` is now in this process's PID
    namespace (gone, or a reused pid); False where that cannot be told (no record, another namespace's)."""
    if not idents:
        return False
    ipid, _, start, pidns, _, _ = IDENT.unpack_from(idents, k * IDENT.size)
    if ipid != pid or not start or not pidns or pidns != _ns("self", "pid"):
        return False
    if _ns(pid, "time") not in (None, _ns("self", "time")):
        return False  # (its clock of boot is another's: its start time is not comparable)
    return started(pid) != start


def reclaim_dead(directory: str) -> list[tuple[int, int, list[int]]]:
    """What dead processes' slots held, given back to the container: (slot, pid, held per GPU) for each.
    Only in a page whose processes hold their slots' liveness locks (CGPU_SLOTS_LOCKED, cgpu_page.h):
    a slot whose byte nobody locks is dead, whatever its pid (the daemon does not share the container's
    PID namespace); so is one whose process shares the daemon's PID namespace and whose pid is gone or
    started at another time than the slot records (a reused pid; its byte locked by a descriptor that
    outlived it). The same steps as libcgpu's release, with the same atomic instructions: the pid
    taken first (one reclaimer wins), then its held out of the container's total, then the slot free."""
    import ctypes
    import fcntl
    import mmap

    lib = _libatomic()
    if lib is None:
        return []
    fd = open_page(directory, "usage", os.O_RDWR)
    try:
        if os.fstat(fd).st_size < DRIVER_SIZE:
            return []
        if not struct.unpack("<I", os.pread(fd, 4, SLOT_FLAGS_OFFSET))[0] & SLOTS_LOCKED:
            return []
        idents = os.pread(fd, MAX_PROCS * IDENT.size, IDENT_OFFSET) \
            if os.fstat(fd).st_size >= IDENT_END else b""
        mm = mmap.mmap(fd, DRIVER_SIZE)
    finally:
        os.close(fd)
    out = []
    try:
        lfd = open_page(directory, "usage", os.O_RDONLY)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        try:
            for k in range(MAX_PROCS):
                at = USAGE_HEAD.size + k * PROC.size
                pid = struct.unpack_from("<i", mm, at)[0]
                if pid <= 0:
                    continue
                got = fcntl.fcntl(lfd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET,
                                                                       at + LIVENESS_BYTE, 1, 0))
                if _FLOCK.unpack(got)[0] != fcntl.F_UNLCK and not _reused(idents, k, pid):
                    continue  # (alive)
                expected = ctypes.c_int32(pid)
                if not lib.__atomic_compare_exchange_4(base + at, ctypes.addressof(expected), 0xFFFFFFFF, 4, 2):
                    continue  # (another reclaimer, or the slot changed)
                lib.__atomic_fetch_and_4(base + GATED_OFFSET + 4 * (k // 32), ~(1 << (k % 32)) & 0xFFFFFFFF, 4)
                struct.pack_into(f"<{MAX_GPUS}Q", mm, DRIVER_OFFSET + k * DRIVER.size + 8 + 16 * MAX_GPUS,
                                 *[0] * MAX_GPUS)
                held = []
                for g in range(MAX_GPUS):
                    h = lib.__atomic_exchange_8(base + at + PROC_HEAD.size + 8 * g, 0, 4)
                    if h:
                        lib.__atomic_fetch_sub_8(base + 8 + 8 * g, h, 4)
                    held.append(h)
                lib.__atomic_store_4(base + at, 0, 3)
                out.append((k, pid, held))
        finally:
            os.close(lfd)
            del base
    finally:
        mm.close()
    return out


def write_reading(directory: str, index: int, pid: int, nvml: list[int], allocs: list[int],
                  claim: int | None = None) -> None:
    """NVML's figure for the process of slot `index` (per GPU of the page) and what it had allocated
    through libcgpu just before NVML was read, into its record: odd `seq` while written, even after
    (libcgpu reads a record whose seq did not change while it read it). The daemon is the only writer.
    `claim`: the claim of the slot as read with the slot (Slot.claim), so that a reading made for a
    process is never taken by the slot's next one (an exec'd image, a reused pid); None: the slot's now."""
    at = DRIVER_OFFSET + index * DRIVER.size
    fd = open_page(directory, "usage", os.O_RDWR)
    try:
        idents = os.fstat(fd).st_size >= IDENT_END
        claim_at = IDENT_OFFSET + index * IDENT.size + 32
        if claim is None and idents:
            claim = struct.unpack("<Q", os.pread(fd, 8, claim_at - 8))[0]
        seq = struct.unpack("<I", os.pread(fd, 4, at))[0]
        os.pwrite(fd, struct.pack("<I", (seq + 1) | 1), at)
        os.pwrite(fd, struct.pack(f"<i{2 * MAX_GPUS}Q", pid, *nvml, *allocs), at + 4)
        if idents:
            os.pwrite(fd, struct.pack("<Q", claim or 0), claim_at)
        os.pwrite(fd, struct.pack("<I", ((seq + 1) | 1) + 1), at)
    finally:
        os.close(fd)


def prepare(directory: str, preload: str | None = None) -> None:
    """A container's pages before it exists (cgpu-runtime's `prepare`): the files
    its mounts need, the limits not yet valid (magic 0: libcgpu refuses them)
    until `fill` writes them at the hook, in place, so the container's mount of
    the same file sees them. The gate is there from the start (open), so the
    scheduler may drive it before `fill`. With `preload` (the library's path in
    the container), also `ld.so.preload` naming it: what the container's
    /etc/ld.so.preload shows (mounted over it), so a process that clears its
    environment still loads the library."""
    os.makedirs(directory, mode=0o755, exist_ok=True)
    if not os.path.exists(os.path.join(directory, "limits")):
        _write(os.path.join(directory, "limits"), bytes(4) + _limits([0])[4:], 0o444)
    if not os.path.exists(os.path.join(directory, "usage")):
        _write(os.path.join(directory, "usage"), _empty_usage(), 0o666)
    _fifo(directory)
    if preload is not None:
        _write(os.path.join(directory, "ld.so.preload"), f"{preload}\n".encode(), 0o444)


def fill(directory: str, memsizes: list[int], uuids: list[str] | None = None) -> None:
    """The limits the daemon decided, written into the existing file: memsizes and the GPUs' UUIDs
    first, the magic last; the gates are left as they are (the scheduler's)."""
    data = _limits(memsizes, uuids)
    fd = open_page(directory, "limits", os.O_WRONLY)
    try:
        os.pwrite(fd, data[4:GATE_OFFSET], 4)
        if os.fstat(fd).st_size >= LIMITS.size:
            os.pwrite(fd, data[UUID_OFFSET:], UUID_OFFSET)
        os.fsync(fd)
        os.pwrite(fd, data[:4], 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(directory: str) -> None:
    for name in ("limits", "usage", "drained", "ld.so.preload"):
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(directory)
    except OSError:
        pass

