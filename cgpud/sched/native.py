"""The daemon's native part of the compute gate: libcgpu-switch.so
(native/switch/cgpu-switch.c), through ctypes.

    lib = load()                 # None: not built (`make -C native`); why: missing()
    page = Page("/run/cgpud/pages/abc", gpus=[0])
    page.freeze(0); page.undrained(0); page.thaw(0)
    sw = Switcher(gpu=0, bound=0.020, cap=5.0)
    sw.submit(batch_id, [page, ...], [True, ...], [(0.010, 0, NOTIFY), ...])
    await trio.lowlevel.wait_readable(sw.fileno()); sw.ack(); sw.take()

`Page` is one container's pages (the gate words, the closings, the drained
FIFO), shared by reference count between the GateFreezer that owns it and the
switcher threads carrying out a batch: a page closed by the GateFreezer while a
switcher still uses it stays open until the switcher lets go. Its usage page is
never mapped, only read (a container can cut it: docs/isolation.md, "The pages").

`Switcher` is one GPU's thread: it carries out the steps of a batch (close the
gates of the active instances that do not run, wait for their queued work,
open the runner's, sleep to the step's end) and reports each step's times.
Each time `bound` passes in a wait, the processes that cannot answer (dead,
stopped, or alive and not draining) are given up on; a live one that drains
is waited for, up to `cap`. It never decides: cgpud.sched.loop plans, and charges the reported times.

Where to find the library: $CGPUD_NATIVE, else beside the Python that runs the
daemon (`.venv/bin`, where scripts/setup.sh builds it), else
/usr/local/libexec (scripts/install-service.sh).
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Sequence

log = logging.getLogger("cgpud")

NOTIFY = 1  # a step flag: the switcher says when the step starts
SWITCHES = ("drain", "ahead", "overlap")  # when the next gate opens (Switcher.mode)
# why a process was not waited for (Report.why, Page.give_up): native/switch/page.h's reasons
GAVE_UP = {1: "dead", 2: "stopped", 3: "alive but not answering", 4: "still draining at the cap",
           5: "forged (its lock is no live process's)"}
NAME = "libcgpu-switch.so"


class Report(ctypes.Structure):
    _fields_ = [("begin", ctypes.c_int64), ("start", ctypes.c_int64), ("end", ctypes.c_int64),
                ("owned", ctypes.c_int64), ("drained", ctypes.c_int64), ("drain_ns", ctypes.c_int64), ("late_ns", ctypes.c_int64), ("batch", ctypes.c_int32),
                ("step", ctypes.c_int32), ("gave_up", ctypes.c_int32), ("closed", ctypes.c_int32),
                ("why", ctypes.c_int32), ("longer", ctypes.c_int32), ("run", ctypes.c_int32),
                ("gpu_ns", ctypes.c_int64), ("gpu_at", ctypes.c_int64), ("runner", ctypes.c_void_p)]


class Step(ctypes.Structure):
    _fields_ = [("len_ns", ctypes.c_int64), ("run", ctypes.c_int32), ("flags", ctypes.c_uint32)]


_lib: ctypes.CDLL | None = None
_why: str | None = None


def candidates() -> list[str]:
    env = os.environ.get("CGPUD_NATIVE")
    if env:
        return [env]
    return [os.path.join(os.path.dirname(sys.executable), NAME), os.path.join("/usr/local/libexec", NAME)]


def load() -> ctypes.CDLL | None:
    """The library, loaded once; None when it cannot be (`missing()` says why)."""
    global _lib, _why
    if _lib is not None or _why is not None:
        return _lib
    tried = []
    for path in candidates():
        if not os.path.exists(path):
            tried.append(path)
            continue
        try:
            lib = ctypes.CDLL(path, use_errno=True)
        except OSError as exc:
            _why = f"{path} does not load ({exc}); rebuild it with `make -C native`"
            return None
        if lib.cg_sizeof_report() != ctypes.sizeof(Report) or lib.cg_sizeof_step() != ctypes.sizeof(Step):
            _why = f"{path} is of another cgpud version; rebuild it with `make -C native`"
            return None
        _declare(lib)
        _lib = lib
        return lib
    _why = f"{NAME} is not built (looked in {', '.join(tried)}); build it with `make -C native` (scripts/setup.sh does)"
    return None


def missing(warn: str | None = None) -> str | None:
    """Why the library is not there (None: it is); logged as a warning after `warn`."""
    load()
    if _why is not None and warn:
        log.warning("%s, not gated: %s", warn, _why)
    return _why


def _declare(lib: ctypes.CDLL) -> None:
    P, I, VP = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)
    sig = {
        "cg_page_open": (P, [ctypes.c_char_p, VP, I, ctypes.c_char_p, ctypes.c_size_t, VP]),
        "cg_page_ref": (None, [P]), "cg_page_release": (None, [P]),
        "cg_page_per_gpu": (I, [P]), "cg_page_drives": (I, [P]), "cg_page_fifo": (I, [P]),
        "cg_page_freeze": (None, [P, I]), "cg_page_thaw": (None, [P, I]), "cg_page_frozen": (I, [P]),
        "cg_page_closed_on": (I, [P, I]), "cg_page_undrained": (I, [P, I, VP, I]),
        "cg_page_give_up": (I, [P, I, I, VP, VP, I]), "cg_page_consume": (None, [P]),
        "cg_page_share": (None, [P, I, I, ctypes.c_uint32]),
        "cg_page_bound": (None, [P, ctypes.c_uint32]), "cg_page_gpu_ns": (ctypes.c_int64, [P, I]),
        "cg_page_damage": (I, [P, ctypes.c_char_p, ctypes.c_size_t]),
        "cg_page_distrust": (I, [P, ctypes.c_char_p]), "cg_page_holds": (I, [P, I]),
        "cg_page_hold": (I, [P, I, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p]),
        "cg_sw_new": (P, [I, ctypes.c_int64, ctypes.c_int64]), "cg_sw_fd": (I, [P]),
        "cg_sw_mode": (None, [P, I, ctypes.c_int64]), "cg_sw_ack": (None, [P]),
        "cg_sw_align": (None, [P, ctypes.c_int64]),
        "cg_sw_submit": (I, [P, ctypes.c_int32, I, ctypes.POINTER(P), ctypes.POINTER(ctypes.c_uint8), I,
                             ctypes.POINTER(Step)]),
        "cg_sw_cancel": (None, [P]), "cg_sw_idle": (I, [P]),
        "cg_sw_take": (I, [P, ctypes.POINTER(Report), I, ctypes.POINTER(Report), VP]),
        "cg_sw_free": (None, [P]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


class PageError(Exception):
    """The pages cannot be opened: `gone` when they are not there."""

    def __init__(self, why: str, gone: bool) -> None:
        super().__init__(why)
        self.gone = gone


class Page:
    """One container's pages, opened by the library (see the module's text)."""

    def __init__(self, directory: str, gpus: Sequence[int] | None = None) -> None:
        lib = load()
        if lib is None:
            raise PageError(f"the compute gate needs the daemon's native part: {_why}", False)
        self._lib = lib
        g = list(gpus or [])
        arr = (ctypes.c_int * max(1, len(g)))(*g)
        why = ctypes.create_string_buffer(4400)
        gone = ctypes.c_int(0)
        h = lib.cg_page_open(os.fsencode(directory), arr, len(g), why, len(why), ctypes.byref(gone))
        if not h:
            raise PageError(why.value.decode(errors="replace"), bool(gone.value))
        self.handle = h
        self.per_gpu = bool(lib.cg_page_per_gpu(h))
        self.drives = bool(lib.cg_page_drives(h))
        self.fifo = lib.cg_page_fifo(h)
        self._slots = (ctypes.c_int * 256)()
        self._why = (ctypes.c_int * 256)()

    def freeze(self, gpu: int | None) -> None:
        self._lib.cg_page_freeze(self.handle, -1 if gpu is None else gpu)

    def thaw(self, gpu: int | None) -> None:
        self._lib.cg_page_thaw(self.handle, -1 if gpu is None else gpu)

    def frozen(self) -> bool:
        return bool(self._lib.cg_page_frozen(self.handle))

    def gpu_ns(self, gpu: int) -> int | None:
        """The GPU time (ns) its processes got on node GPU `gpu`, as libcgpu counts it (read as a
        difference); None when not known (an older page or library, no launching process)."""
        if self.handle is None:
            return None
        n = self._lib.cg_page_gpu_ns(self.handle, gpu)
        return n if n >= 0 else None

    def distrust(self, why: str) -> bool:
        """Its GPU time count is not believed from now on (the daemon measured more: gputime.ChargeCheck):
        gpu_ns None, so its instance is charged the time its gate is open. True the first time."""
        if self.handle is None:
            return False
        return bool(self._lib.cg_page_distrust(self.handle, why.encode(errors="replace")[:300]))

    def closed_on(self, gpu: int) -> bool:
        return bool(self._lib.cg_page_closed_on(self.handle, gpu))

    def holds(self, pid: int) -> bool:
        """Whether process `pid` holds a slot's lock: it runs libcgpu with a live slot (the kernel's word)."""
        return self.handle is not None and bool(self._lib.cg_page_holds(self.handle, pid))

    def hold(self, fd: int, on: bytes, off: bytes, why: str) -> bool:
        """From now on its instance's cgroup (the freeze file `fd`; `on`/`off` its values) is frozen
        whenever a gate of the page is closed, and the page damaged (`why`). True the first time."""
        if self.handle is None:
            return False
        return bool(self._lib.cg_page_hold(self.handle, fd, on, off, why.encode(errors="replace")[:300]))

    def damage(self) -> str | None:
        """Why the usage page is damaged (cut, replaced, a foreign head, a count past any possible),
        the first time it is asked after it was found so; else None. A damaged page is not read
        again: its processes' queued work is not waited for, its GPU time is not known."""
        if self.handle is None:
            return None
        why = ctypes.create_string_buffer(320)
        return why.value.decode(errors="replace") if self._lib.cg_page_damage(self.handle, why, len(why)) else None

    def undrained(self, gpu: int | None) -> list[int]:
        n = self._lib.cg_page_undrained(self.handle, -1 if gpu is None else gpu, self._slots, 256)
        return list(self._slots[:min(n, 256)])

    def give_up(self, gpu: int | None, every: bool = False) -> list[tuple[int, str]]:
        """Past the bound: the undrained slots that cannot answer (dead, stopped, or alive and not
        draining; `every`: all of them), not waited for again until they answer: (slot, why)."""
        n = self._lib.cg_page_give_up(self.handle, -1 if gpu is None else gpu, 1 if every else 0, self._slots,
                                      self._why, 256)
        return [(self._slots[i], GAVE_UP.get(self._why[i], "?")) for i in range(min(n, 256))]

    def set_shared(self, gpu: int | None, on: bool, budget_us: int) -> None:
        """Whether another instance is active on node GPU `gpu` now (the container's processes keep
        at most `budget_us` of GPU work queued ahead there while it is)."""
        self._lib.cg_page_share(self.handle, -1 if gpu is None else gpu, 1 if on else 0, budget_us)

    def set_bound(self, bound_us: int) -> None:
        """The daemon's drain bound (µs): the container's libcgpu answers a closing within three
        quarters of it (docs/isolation.md, "The drain bound")."""
        self._lib.cg_page_bound(self.handle, bound_us)

    def consume(self) -> None:
        self._lib.cg_page_consume(self.handle)

    def share(self) -> "Page":
        """Another reference to the same page (it stays mapped until both are released)."""
        other = object.__new__(Page)
        other.__dict__.update(self.__dict__)
        other._slots = (ctypes.c_int * 256)()
        other._why = (ctypes.c_int * 256)()
        self._lib.cg_page_ref(self.handle)
        return other

    def release(self) -> None:
        if self.handle:
            self._lib.cg_page_release(self.handle)
            self.handle = None
            self.fifo = -1


class Switcher:
    """One GPU's switcher thread (see the module's text)."""

    def __init__(self, gpu: int, bound: float, cap: float | None = 5.0) -> None:
        # (cap: how long a process still draining is waited for in all; None: one bound, once)
        lib = load()
        if lib is None:
            raise RuntimeError(_why)
        h = lib.cg_sw_new(gpu, int(bound * 1e9), int((bound if cap is None else max(cap, bound)) * 1e9))
        if not h:
            raise OSError(ctypes.get_errno(), "cannot start the switcher thread")
        self._lib, self.handle, self.gpu = lib, h, gpu
        self._fd = lib.cg_sw_fd(h)
        self._out = (Report * 256)()
        self._cur = Report()
        self._has = ctypes.c_int(0)

    def fileno(self) -> int:
        return self._fd

    def mode(self, switch: str, lead: float = 0.0) -> None:
        """When the next gate opens at a switch: "drain", once the stopped ones' queued work is
        done (the default); "ahead", `lead` s before their drain is expected to end (the mean of
        theirs); "overlap", at the closing (their tail drains meanwhile)."""
        self._lib.cg_sw_mode(self.handle, SWITCHES.index(switch), int(lead * 1e9))

    def align(self, most: float) -> None:
        """A gang's turns aligned across its GPUs: the step before a gang's runs on at most `most` s
        until the gang's other GPUs' switchers are ready to open it too (0: not aligned;
        docs/isolation.md, "Gangs")."""
        self._lib.cg_sw_align(self.handle, int(most * 1e9))

    def ack(self) -> None:
        self._lib.cg_sw_ack(self.handle)

    def submit(self, batch: int, pages: Sequence[Page], active: Sequence[bool],
               steps: Sequence[tuple[float, int, int]]) -> bool:
        """Hand over a batch: steps of (seconds, the index in `pages` that runs or -1, flags).
        False when one is already waiting."""
        n = len(pages)
        uni = (ctypes.c_void_p * max(1, n))(*[p.handle for p in pages])
        act = (ctypes.c_uint8 * max(1, n))(*[1 if a else 0 for a in active])
        st = (Step * len(steps))(*[Step(int(s * 1e9), r, f) for s, r, f in steps])
        return self._lib.cg_sw_submit(self.handle, batch, n, uni, act, len(steps), st) == 0

    def cancel(self) -> None:
        self._lib.cg_sw_cancel(self.handle)

    def idle(self) -> bool:
        return bool(self._lib.cg_sw_idle(self.handle))

    def take(self) -> tuple[list[Report], Report | None]:
        """The reports of the steps that ended since the last call, and the step in force."""
        out: list[Report] = []
        while True:
            n = self._lib.cg_sw_take(self.handle, self._out, 256, ctypes.byref(self._cur), ctypes.byref(self._has))
            out += [Report.from_buffer_copy(self._out[i]) for i in range(n)]
            if n < 256:
                break
        return out, (Report.from_buffer_copy(self._cur) if self._has.value else None)

    def close(self) -> None:
        if self.handle:
            self._lib.cg_sw_free(self.handle)
            self.handle = None
