"""Activity: an instance is active while one of its processes holds its GPU
open (SPEC §5).

The GPU, seen from a process, is a device file:
- a real GPU N is `/dev/nvidiaN` (a char device; CUDA opens it when it makes a
  context and keeps it open);
- a simulated GPU N is the plain file `simgpuN` the daemon keeps in its
  `--dev-dir` (`/run/cgpud/dev/` as root: `cgpud.state.paths.default_dev_dir`,
  made by `cgpud.daemon.main.sim_devices`, never replaced, so containers that hold
  one across a daemon restart stay visible). A container gets it
  bind-mounted (same inode) anywhere, with its name unchanged; a workload
  holds it open for as long as it "uses the GPU" (`cgpu workload` does).

How we see it (numbers in docs/enforcement.md):
- **fanotify** (CAP_SYS_ADMIN) marks each device inode for FAN_OPEN and
  FAN_CLOSE; events carry no file descriptor (FAN_REPORT_FID: the daemon never
  opens a GPU itself). An event only says *who* to look at: the instances the
  event's process belongs to are marked dirty. The kernel merges the events of
  one process on one file (open+close can arrive as one), and queues an open
  before the descriptor is installed, so events are never counted, only used
  as triggers; after an open, its instances are looked at again at each call
  for OPEN_RECHECK s until the descriptor shows.
- **The truth** comes from /proc: an instance holds the device if a process in
  its cgroups (cgroup.procs, recursively), its process groups or its pid list
  has a descriptor whose link names the device's file (basename match; then
  the stat is compared: same rdev for a char device, same inode for a file —
  never a stat of anything else, which could be a file on our own FUSE mount).
  The holder found last is checked first (a readlink and a stat).
- **A slow round robin** looks at one instance at a time so that each is
  looked at every `rescan_interval` s: it catches what no mark sees (a
  container whose /dev/nvidia0 is its own mknod'd inode: or mark it, with
  `watch(…, root_pid=)`), and is the only mechanism without fanotify.

The scheduler calls `active(gpu, name)` (cgpud.sched.enforce_api.Activity) at
each slice boundary: it drains the fanotify queue (one poll(2) when nothing
happened), looks at what is dirty, and answers from a dict. The trio
task `run(on_change)` wakes on the fanotify descriptor and calls
`on_change(gpu)` for a GPU whose instances changed between boundaries (the
daemon passes the GPU's `GpuScheduler.poke`). Single-threaded: call it from
the trio thread only.
"""
from __future__ import annotations

import ctypes
import os
import select
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from cgpud.sched.cgroupfs import KIND_CGROUP2, KIND_FREEZER, KIND_SIGNAL, TargetGone, cgroup_pids, proc_cgroups, stat_fields
from cgpud.sched.enforce import group_members

RESCAN_WAKES = 2  # the round robin wakes at most this many times a rescan_interval
MEMBER_RECHECK = 4.0  # s: how long a holder seen in the instance is taken to stay in it (see _holding)

# fanotify(7)
_FAN_CLOEXEC = 0x1
_FAN_NONBLOCK = 0x2
_FAN_CLASS_NOTIF = 0x0
_FAN_REPORT_FID = 0x200
_FAN_MARK_ADD = 0x1
_FAN_OPEN = 0x20
_FAN_CLOSE = 0x08 | 0x10
_FAN_Q_OVERFLOW = 0x4000
_AT_FDCWD = -100
_EVENT = struct.Struct("<IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
OPEN_RECHECK = 0.05  # s: how long an open event keeps its instances looked at

Key = tuple[int, str]  # (gpu, instance name)


def nvidia_device_path(index: int) -> str:
    return f"/dev/nvidia{index}"


# ---- fanotify through ctypes ------------------------------------------------------------


class _Fanotify:
    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
        self._libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
        fd = self._libc.fanotify_init(_FAN_CLASS_NOTIF | _FAN_CLOEXEC | _FAN_NONBLOCK | _FAN_REPORT_FID,
                                      os.O_RDONLY | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fanotify_init: {os.strerror(err)}")
        self.fd = fd
        self._poll = select.poll()  # (an empty queue is the usual case: seen without a failing read)
        self._poll.register(fd, select.POLLIN)

    def mark(self, path: str) -> None:
        if self._libc.fanotify_mark(self.fd, _FAN_MARK_ADD, _FAN_OPEN | _FAN_CLOSE, _AT_FDCWD, os.fsencode(path)) < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fanotify_mark: {os.strerror(err)}", path)

    def read(self) -> list[tuple[int, int]]:
        """(mask, pid) of every queued event; [] when none."""
        out: list[tuple[int, int]] = []
        if not self._poll.poll(0):
            return out
        for _ in range(64):  # a bounded drain: a storm of events waits for the next call
            try:
                buf = os.read(self.fd, 16384)
            except BlockingIOError:
                break
            off = 0
            while off + _EVENT.size <= len(buf):
                length, _, _, _, mask, fd, pid = _EVENT.unpack_from(buf, off)
                if fd >= 0:  # not with FAN_REPORT_FID, but never leak one
                    os.close(fd)
                out.append((mask, pid))
                off += max(length, _EVENT.size)
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ---- the monitor ------------------------------------------------------------------------


@dataclass
class _Device:
    names: set[str] = field(default_factory=set)  # basenames a descriptor's link may end with
    ids: set[tuple] = field(default_factory=set)   # ("rdev", n) or ("ino", st_dev, st_ino)
    marked: set[tuple] = field(default_factory=set)


@dataclass
class _Watch:
    cgroups: tuple[str, ...]
    pgids: frozenset[int]
    pids: frozenset[int]
    active: bool = False
    holder: tuple[int, int] | None = None  # (pid, fd) that held the device at the last look
    member_at: float = float("-inf")  # when the holder was last seen to be the instance's (its /proc/PID/cgroup)


def _identity(st: os.stat_result) -> tuple:
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        return ("rdev", st.st_rdev)
    return ("ino", st.st_dev, st.st_ino)


class ActivityMonitor:
    """Which instances hold their GPU open.

        mon = ActivityMonitor({0: "/run/cgpud/dev/simgpu0"})       # or {0: "/dev/nvidia0"}
        mon.watch(0, "abc", cgroups=["/sys/fs/cgroup/unified/cgpud/abc"])
        mon.watch_target(0, "abc", instance.target)                # the same, from the model
        mon.active(0, "abc")    # at each slice boundary
        mon.unwatch(0, "abc")

    `fanotify=None` uses fanotify when it can (root), True insists (OSError
    otherwise), False never does. `rescan_interval`: how often each instance
    is looked at regardless (default 1 s with fanotify, 0.1 s without).
    """

    def __init__(self, devices: Mapping[int, str | Iterable[str]] = {}, *, fanotify: bool | None = None,
                 rescan_interval: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._fan: _Fanotify | None = None
        if fanotify is not False:
            try:
                self._fan = _Fanotify()
            except OSError:
                if fanotify:
                    raise
        self.rescan_interval = rescan_interval if rescan_interval is not None else (1.0 if self._fan else 0.1)
        self._clock = clock
        self._devices: dict[int, _Device] = {}
        self._watches: dict[Key, _Watch] = {}
        self._dirty: set[Key] = set()
        self._recheck: dict[Key, float] = {}  # key -> until when an open event is looked for
        self._changed: set[Key] = set()       # changed since the last update()
        self._ring: list[Key] = []
        self._generation = 0  # moves whenever an answer or the set of instances changes
        self._snap: dict[Key, bool] = {}
        self._snap_seen = -1
        self._next_rescan = clock()
        self.stats = {"events": 0, "scans": 0, "fds_read": 0}
        for gpu, paths in devices.items():
            for path in [paths] if isinstance(paths, str) else paths:
                self.add_device(gpu, path)

    @property
    def using_fanotify(self) -> bool:
        return self._fan is not None

    def fileno(self) -> int | None:
        return self._fan.fd if self._fan else None

    def close(self) -> None:
        if self._fan:
            self._fan.close()
            self._fan = None

    # ---- what to watch ----

    def add_device(self, gpu: int, path: str) -> None:
        """`path` is (one of) GPU `gpu`'s device files: a device node, or a
        simulated GPU's plain file. Marked for fanotify if in use."""
        st = os.stat(path)
        dev = self._devices.setdefault(gpu, _Device())
        dev.ids.add(_identity(st))
        dev.names.add(os.path.basename(path))
        self._mark(dev, path, st)

    def _mark(self, dev: _Device, path: str, st: os.stat_result) -> None:
        node = (st.st_dev, st.st_ino)
        if self._fan is not None and node not in dev.marked:
            self._fan.mark(path)
            dev.marked.add(node)

    def watch(self, gpu: int, name: str, *, cgroups: Iterable[str] = (), pgids: Iterable[int] = (),
              pids: Iterable[int] = (), root_pid: int | None = None) -> None:
        """Instance `name` on GPU `gpu`: its processes are those of `cgroups`
        (directories, with the groups below them), of the process groups
        `pgids`, and `pids`. With `root_pid` (a container's init), the GPU's
        device node as that process sees it (/dev/<name>) is marked too.
        Watching an instance again replaces what it was."""
        if gpu not in self._devices:
            raise KeyError(f"GPU {gpu} has no device file (add_device first)")
        key = (gpu, name)
        self._generation += 1
        self._watches[key] = _Watch(tuple(os.path.realpath(c) for c in cgroups), frozenset(pgids), frozenset(pids))
        if key not in self._ring:
            self._ring.append(key)
        if root_pid is not None:
            self._mark_in_root(gpu, root_pid)
        self._look(key)

    def watch_target(self, gpu: int, name: str, target: Mapping[str, Any], **kwargs: Any) -> None:
        """watch() from a target as the model keeps it (`Instance.target`)."""
        kind = target.get("kind")
        if kind in (KIND_CGROUP2, KIND_FREEZER):
            self.watch(gpu, name, cgroups=[target["path"]], **kwargs)
        elif kind == KIND_SIGNAL:
            self.watch(gpu, name, pgids=[int(target["pgid"])], **kwargs)
        else:
            raise ValueError(f"instance {name}: cannot watch a target of kind {kind!r}")

    def unwatch(self, gpu: int, name: str) -> None:
        key = (gpu, name)
        self._generation += 1
        self._watches.pop(key, None)
        self._dirty.discard(key)
        self._recheck.pop(key, None)
        self._changed.discard(key)
        if key in self._ring:
            self._ring.remove(key)

    def _mark_in_root(self, gpu: int, root_pid: int) -> None:
        dev = self._devices[gpu]
        for name in sorted(dev.names):
            path = f"/proc/{root_pid}/root/dev/{name}"
            try:
                st = os.stat(path)
            except OSError:
                continue
            if _identity(st) in dev.ids:
                self._mark(dev, path, st)

    # ---- the answer ----

    def active(self, gpu: int, name: str) -> bool:
        """Whether instance `name` on GPU `gpu` holds its GPU open, as of now
        (cheap: see the module's doc). An instance not watched is idle."""
        self.update()
        w = self._watches.get((gpu, name))
        return w is not None and w.active

    def snapshot(self) -> dict[Key, bool]:
        """Every instance's answer (the same dict while none changed: do not change it)."""
        self.update()
        if self._snap_seen != self._generation:
            self._snap = {k: w.active for k, w in self._watches.items()}
            self._snap_seen = self._generation
        return self._snap

    def update(self) -> set[Key]:
        """Drain events, look at dirty instances, advance the round robin.
        Returns the instances whose answer changed since the last update()."""
        if self._fan is not None:
            events = self._fan.read()
            if events:
                self.stats["events"] += len(events)
                self._attribute(events)
        now = self._clock()
        for key, until in list(self._recheck.items()):
            if now > until or key not in self._watches or self._watches[key].active:
                del self._recheck[key]
            else:
                self._dirty.add(key)
        if self._dirty:
            dirty, self._dirty = self._dirty, set()
            for key in dirty:
                if key in self._watches:
                    self._look(key)
        if self._ring and now >= self._next_rescan:
            n = self._rescan_group()
            for _ in range(min(n, len(self._ring))):
                key = self._ring.pop(0)
                self._ring.append(key)
                self._look(key)
            self._next_rescan = now + self.rescan_interval * n / len(self._ring)
        changed, self._changed = self._changed, set()
        return changed

    def _rescan_group(self) -> int:
        """How many instances the round robin looks at a wake-up: each is due every
        rescan_interval, looked at in groups so that the monitor wakes at most
        RESCAN_WAKES times an interval however many there are."""
        return max(1, -(-len(self._ring) // RESCAN_WAKES))

    async def run(self, on_change: Callable[[int], Any], *, task_status: Any = None) -> None:
        """A trio task: wake when a marked device is opened or closed (and for
        the round robin), and call `on_change(gpu)` for each GPU whose
        instances changed. Runs until cancelled."""
        import trio

        if task_status is not None:
            task_status.started()
        while True:
            step = self.rescan_interval * self._rescan_group() / max(1, len(self._ring))
            with trio.move_on_after(step):
                if self._fan is not None:
                    await trio.lowlevel.wait_readable(self._fan.fd)
                else:
                    await trio.sleep_forever()
            for gpu in sorted({gpu for gpu, _ in self.update()}):
                on_change(gpu)

    # ---- internals ----

    def _attribute(self, events: list[tuple[int, int]]) -> None:
        me = os.getpid()
        for mask, pid in {(m, p) for m, p in events}:
            if mask & _FAN_Q_OVERFLOW or pid <= 0:
                self._dirty.update(self._watches)
                continue
            if pid == me:
                continue
            keys = self._keys_of(pid)
            # a process we cannot place any more (it exited) may have passed
            # its descriptor to children we cannot see from here: look at all
            keys = list(self._watches) if keys is None else keys
            self._dirty.update(keys)
            if mask & _FAN_OPEN:
                until = self._clock() + OPEN_RECHECK
                for key in keys:
                    self._recheck[key] = until

    def _keys_of(self, pid: int) -> list[Key] | None:
        """The instances `pid` belongs to; None if it cannot be placed (gone)."""
        try:
            pc = proc_cgroups(pid)
            pgid = int(stat_fields(pid)[2])
        except (TargetGone, IndexError, ValueError):
            return None
        return [key for key, w in self._watches.items() if self._member(w, pid, pgid, pc.v2, pc.freezer)]

    @staticmethod
    def _member(w: _Watch, pid: int, pgid: int, *groups: str | None) -> bool:
        return pid in w.pids or pgid in w.pgids or any(
            g is not None and (g == c or g.startswith(c + "/")) for c in w.cgroups for g in groups)

    def _still_member(self, w: _Watch, pid: int) -> bool:
        try:
            pc = proc_cgroups(pid)
            # (its process group is read only when it could decide: a cgroup's member needs no /proc/PID/stat)
            pgid = int(stat_fields(pid)[2]) if w.pgids and pid not in w.pids else -1
            return self._member(w, pid, pgid, pc.v2, pc.freezer)
        except (TargetGone, IndexError, ValueError):
            return False

    def _pids(self, w: _Watch) -> list[int]:
        pids = set(w.pids)
        for c in w.cgroups:
            pids.update(cgroup_pids(c))
        for pgid in w.pgids:
            pids.update(group_members(pgid))
        return sorted(pids)

    @staticmethod
    def _holds(pid: int, fd: str | int, dev: _Device, dir_fd: int | None = None) -> bool:
        link = str(fd) if dir_fd is not None else f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(link, dir_fd=dir_fd).rpartition("/")[2] not in dev.names:
                return False
            return _identity(os.stat(link, dir_fd=dir_fd)) in dev.ids
        except OSError:
            return False

    def _look(self, key: Key) -> None:
        w = self._watches[key]
        was = w.active
        w.active = self._holding(w, self._devices[key[0]])
        if w.active != was:
            self._changed.add(key)
            self._generation += 1

    def _holding(self, w: _Watch, dev: _Device) -> bool:
        self.stats["scans"] += 1
        # The holder found last, first: does it still hold the device (a readlink and a stat)? Whether it
        # is still the instance's (its /proc/PID/cgroup: twice the cost of the rest) is looked at again
        # every MEMBER_RECHECK s only: a process moves out of its container's cgroups seldom, and one
        # that does while holding the GPU keeps the instance active that long at most.
        if w.holder is not None and self._holds(*w.holder, dev):
            now = self._clock()
            if now - w.member_at < MEMBER_RECHECK:
                return True
            if self._still_member(w, w.holder[0]):
                w.member_at = now
                return True
        w.holder = None
        for pid in self._pids(w):
            try:
                dir_fd = os.open(f"/proc/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                names = os.listdir(dir_fd)
                self.stats["fds_read"] += len(names)
                for name in names:
                    if self._holds(pid, name, dev, dir_fd):
                        w.holder, w.member_at = (pid, int(name)), self._clock()  # (listed as the instance's)
                        return True
            except OSError:
                continue
            finally:
                os.close(dir_fd)
        return False
