"""Memory isolation on simulated GPUs (SPEC §3, docs/memory.md): real daemon,
real processes inside `cgpu run` instances allocating through cgpud.gpus.gpumem,
the tree's meminfo read over FUSE."""
from __future__ import annotations

import errno
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cgpud.containers.cgroups import v2_root
from cgpud.client import Client, ControlError
from cgpud.gpus.gpumem import NotInInstanceError, SimGpu
from test_cgpu_run import cgpu, wait_for

GiB = 1 << 30
MiB = 1 << 20

# A process that allocates on command: one request line in, one answer line out.
HOLDER = r"""
import json, os, sys
from cgpud.client import ControlError
from cgpud.gpus.gpumem import NotInInstanceError, OutOfMemoryError, SimGpu
g = SimGpu()
held = {}
print("ready", os.getpid(), flush=True)
for line in sys.stdin:
    cmd, *args = line.split(maxsplit=1)
    try:
        if cmd == "alloc":
            a = g.alloc(int(args[0]))
            held[a.handle] = a
            out = f"ok {a.handle}"
        elif cmd == "free":
            g.free(held.pop(int(args[0])))
            out = "ok"
        elif cmd == "info":
            out = "ok %d %d" % g.mem_info()
        elif cmd == "raw":  # an op on this process's own connection
            op, kw = json.loads(args[0])
            out = "ok " + json.dumps(g._client.call(op, **kw))
        elif cmd == "close":
            g.close()
            out = "ok"
        elif cmd == "exit":  # exit without freeing anything
            os._exit(0)
    except OutOfMemoryError as e:
        out = f"OutOfMemoryError memoryerror={isinstance(e, MemoryError)} {e}"
    except NotInInstanceError as e:
        out = f"NotInInstanceError errno={e.errno} {e}"
    except ControlError as e:
        out = f"{e.error} {e}"
    print(out, flush=True)
"""


class Holder:
    """One holder process. Under `cgpu run` (a new instance) by default, or
    joined to an existing instance's cgroup (`join=`), as a second process."""

    def __init__(self, daemon, name: str, mem: str = "2G", *, gpu: int = 0, join: str | None = None) -> None:
        env = dict(os.environ, CGPUD_SOCKET=str(daemon.socket))
        py = [sys.executable, "-c", HOLDER]
        if join is None:
            cmd = [str(Path(sys.executable).parent / "cgpu"), "run", "--name", name, "--mem", mem,
                   "--gpu", str(gpu), "--", *py]
            preexec = None
        else:
            procs = os.path.join(join, "cgroup.procs")
            env["CGPU_GPUS"] = str(gpu)
            cmd = py

            def preexec() -> None:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))

        self.name = name
        self.p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  bufsize=1, preexec_fn=preexec)
        first = self._line()
        assert first.startswith("ready "), first
        self.pid = int(first.split()[1])  # the pid of the allocating process, as it sees itself

    def _line(self, timeout: float = 10.0) -> str:
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        assert ready, f"holder {self.name} did not answer within {timeout} s"
        line = self.p.stdout.readline()
        assert line, f"holder {self.name} exited ({self.p.poll()})"
        return line.rstrip("\n")

    def ask(self, line: str) -> str:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self._line()

    def alloc(self, nbytes: int) -> int:
        answer = self.ask(f"alloc {nbytes}")
        assert answer.startswith("ok "), answer
        return int(answer.split()[1])

    def raw(self, op: str, **kw) -> str:
        return self.ask("raw " + json.dumps([op, kw]))

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()
            self.p.wait(10)

    def cgroup(self) -> str:
        with open(f"/proc/{self.pid}/cgroup") as f:
            return next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))


@pytest.fixture
def holders():
    made: list[Holder] = []
    yield made
    for h in made:
        try:  # the holder itself (under `cgpu run` it is cgpu run's child: killing cgpu run orphans it)
            os.kill(h.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if h.p.poll() is None:
            h.p.kill()
            h.p.wait(10)


def meminfo(daemon, name: str, gpu: int = 0) -> str:
    return daemon.read(f"{gpu}/{name}/meminfo")


def expected(memsize: int, procs: dict[int, int]) -> str:
    return f"Free: {memsize - sum(procs.values())}\n" + "".join(
        f"PID: {pid} Mem: {n}\n" for pid, n in sorted(procs.items()))


def test_allocations_up_to_memsize_succeed_and_one_byte_past_fails_changing_nothing(daemon, holders):
    holders.append(h := Holder(daemon, "memtest00001", "2G"))
    state = daemon.state_dir / "state.json"
    saved = (state.stat().st_ino, state.stat().st_mtime_ns, state.read_text())
    assert meminfo(daemon, h.name) == expected(2 * GiB, {})
    assert h.ask("info") == f"ok {2 * GiB} {2 * GiB}"  # the instance's memsize is its total
    a = h.alloc(GiB)
    b = h.alloc(GiB - 1)
    assert meminfo(daemon, h.name) == expected(2 * GiB, {h.pid: 2 * GiB - 1})
    before = daemon.snapshot()
    answer = h.ask("alloc 2")
    assert answer.startswith("OutOfMemoryError memoryerror=True ") and "memsize 2147483648" in answer
    assert h.raw("gpu_alloc", gpu=0, bytes=2).startswith("ENOMEM ")  # the daemon's errno
    assert daemon.snapshot() == before
    assert h.ask("info") == f"ok 1 {2 * GiB}"
    h.alloc(1)  # the last byte fits
    assert meminfo(daemon, h.name) == expected(2 * GiB, {h.pid: 2 * GiB})
    assert h.ask("alloc 1").startswith("OutOfMemoryError")
    assert daemon.write_errno(f"0/{h.name}/memsize", str(GiB)) == errno.EBUSY  # below what is held
    assert daemon.value(f"0/{h.name}/memsize") == str(2 * GiB)
    assert h.ask(f"free {a}") == "ok"
    assert meminfo(daemon, h.name) == expected(2 * GiB, {h.pid: GiB})
    assert h.ask(f"free {b}") == "ok"
    assert meminfo(daemon, h.name) == expected(2 * GiB, {h.pid: 1})
    # Process memory is not durable state: state.json was not even rewritten.
    assert (state.stat().st_ino, state.stat().st_mtime_ns, state.read_text()) == saved


def test_meminfo_lists_each_process_and_memory_returns_on_close_exit_and_kill9(daemon, holders):
    memsize = 4 * GiB
    name = "memtest00002"
    holders.append(h := Holder(daemon, name, "4G"))
    group = os.path.join(v2_root(), "cgpud", name)
    holders.append(h2 := Holder(daemon, name, join=group))  # two more processes in the same instance
    holders.append(h3 := Holder(daemon, name, join=group))
    # The pids are the host's: the processes the daemon sees in the instance's cgroup.
    assert h2.pid == h2.p.pid and h3.pid == h3.p.pid
    assert h.cgroup() == f"/cgpud/{name}" == h2.cgroup() == h3.cgroup()
    h.alloc(GiB)
    h2.alloc(100 * MiB)
    h2.alloc(28 * MiB + 5)
    h3.alloc(512 * MiB)
    assert meminfo(daemon, name) == expected(memsize, {h.pid: GiB, h2.pid: 128 * MiB + 5, h3.pid: 512 * MiB})

    # Closing the context returns its memory, and has done so when close() returns.
    assert h.ask("close") == "ok"
    assert meminfo(daemon, name) == expected(memsize, {h2.pid: 128 * MiB + 5, h3.pid: 512 * MiB})

    # Exiting without freeing anything.
    h2.p.stdin.write("exit\n")
    h2.p.stdin.flush()
    h2.p.wait(10)
    wait_for(lambda: meminfo(daemon, name) == expected(memsize, {h3.pid: 512 * MiB}), timeout=3,
             what="the exited process's memory to be returned")

    # kill -9.
    t0 = time.monotonic()
    os.kill(h3.pid, signal.SIGKILL)
    wait_for(lambda: meminfo(daemon, name) == expected(memsize, {}), timeout=3,
             what="the killed process's memory to be returned")
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("daemon", ["sim:2xT4"], indirect=True)
def test_a_failed_allocation_leaves_other_instances_untouched(daemon, holders):
    holders.append(a := Holder(daemon, "memtestAAAAA", "1G"))
    holders.append(b := Holder(daemon, "memtestBBBBB", "1G"))
    handle = a.alloc(512 * MiB)
    b.alloc(GiB)
    before = daemon.snapshot()
    assert b.ask("alloc 1").startswith("OutOfMemoryError")
    assert b.ask(f"alloc {2 * GiB}").startswith("OutOfMemoryError")
    # Another instance's free memory is not the caller's: B stays full though A has 512 MiB free.
    assert daemon.snapshot() == before
    assert meminfo(daemon, a.name) == expected(GiB, {a.pid: 512 * MiB})
    # B may not touch A's memory: A's handle means nothing on B's connection.
    assert b.raw("gpu_free", gpu=0, handle=handle).startswith("ENOENT ")
    # Nor a GPU its instance has no share of.
    answer = b.raw("gpu_alloc", gpu=1, bytes=1)
    assert answer.startswith("EPERM ") and "no share of GPU 1" in answer
    assert b.raw("gpu_meminfo", gpu=1).startswith("EPERM ")
    assert daemon.snapshot() == before
    info = json.loads(a.raw("gpu_meminfo", gpu=0)[3:])
    assert info == {"gpu": 0, "instance": a.name, "free": 512 * MiB, "total": GiB, "used": 512 * MiB}
    assert json.loads(a.raw("gpu_meminfo")[3:]) == info  # no GPU named: the instance's lowest


def test_a_process_outside_any_instance_gets_eperm(daemon, holders):
    holders.append(Holder(daemon, "memtest00003", "1G"))  # an instance exists, but not ours
    with SimGpu(0, str(daemon.socket)) as g:
        with pytest.raises(NotInInstanceError) as err:
            g.alloc(1)
        assert isinstance(err.value, PermissionError) and err.value.errno == errno.EPERM
        assert "is in no cgpud instance" in str(err.value) and str(os.getpid()) in str(err.value)
        with pytest.raises(NotInInstanceError):
            g.mem_info()
    with Client(str(daemon.socket)) as c:
        with pytest.raises(ControlError) as err:
            c.call("gpu_alloc", gpu=0, bytes=1)
        assert err.value.error == "EPERM"
    assert meminfo(daemon, "memtest00003") == expected(GiB, {})
    for args in (["mem", "info"], ["mem", "hold", "1M", "--seconds", "0"]):
        r = cgpu(daemon, *args)
        assert r.returncode == 1 and "is in no cgpud instance" in r.stderr, r.stderr
        assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr


def test_a_new_instance_of_the_same_name_starts_empty(daemon, holders):
    """Destroying an instance takes its memory with it; a process still holding
    handles cannot reach into a later instance of the same name."""
    holders.append(h := Holder(daemon, "memtest00004", "2G"))
    handle = h.alloc(GiB)
    daemon.destroy(h.name)
    daemon.create(0, h.name)
    memsize = int(daemon.value(f"0/{h.name}/memsize"))
    assert h.ask(f"free {handle}").startswith("ENOENT ")
    assert meminfo(daemon, h.name) == expected(memsize, {})
    # The new instance has no cgroup attached: the old one's process is not in it.
    assert h.ask("alloc 1").startswith("NotInInstanceError errno=1 ")
    assert meminfo(daemon, h.name) == expected(memsize, {})


def test_cgpu_mem_info_and_hold_inside_cgpu_run(daemon):
    exe = str(Path(sys.executable).parent / "cgpu")
    r = cgpu(daemon, "run", "--name", "memtest00005", "--mem", "2G", "--", exe, "mem", "info", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"gpu": 0, "instance": "memtest00005", "free": 2 * GiB, "total": 2 * GiB, "used": 0}
    r = cgpu(daemon, "run", "--mem", "2G", "--", "sh", "-c", f"{exe} mem hold 512M --seconds 0 && {exe} mem info")
    assert r.returncode == 0, r.stderr
    held, info = r.stdout.splitlines()
    assert held.startswith(f"holding {512 * MiB} bytes on GPU 0 as pid ")
    assert info.endswith(": 0MiB / 2048MiB used, 2048MiB free (2147483648 of 2147483648 bytes)")  # returned at exit
    r = cgpu(daemon, "run", "--mem", "1G", "--", exe, "mem", "hold", "1025M")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0
    assert r.stderr.startswith("Error: out of memory: ") and f"{1025 * MiB} bytes asked, {GiB} free" in r.stderr


def test_workload_mem_holds_memory_while_it_runs(daemon):
    exe = str(Path(sys.executable).parent / "cgpu")
    env = dict(os.environ, CGPUD_SOCKET=str(daemon.socket))
    name = "memtest00006"
    p = subprocess.Popen([exe, "run", "--name", name, "--mem", "2G", "--", exe, "workload", "--seconds", "1.5",
                          "--mem", "1536M", "--json"], env=env, stdout=subprocess.PIPE, text=True)
    line: list[str] = []

    def holding() -> bool:
        nonlocal line
        try:
            text = meminfo(daemon, name)
        except OSError:
            return False
        line = text.splitlines()
        return len(line) == 2

    wait_for(holding, timeout=10, what="the workload's memory in meminfo")
    assert line[0] == f"Free: {512 * MiB}"
    pid = int(line[1].split()[1])
    assert line[1] == f"PID: {pid} Mem: {1536 * MiB}"
    with open(f"/proc/{pid}/cmdline") as f:
        assert "workload" in f.read()  # the pid is the workload's, as the host sees it
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0
    assert json.loads(out)["mem_bytes"] == 1536 * MiB
    assert name not in os.listdir(daemon.path("0"))

    t0 = time.monotonic()
    r = cgpu(daemon, "run", "--mem", "1G", "--", exe, "workload", "--seconds", "20", "--mem", "2G")
    assert r.returncode == 1 and time.monotonic() - t0 < 10  # failed at the start, ran nothing
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("Error: out of memory: "), r.stderr
    assert r.stdout == ""


def test_cgroup_targets_are_compared_inside_their_hierarchy():
    """A target's path on disk becomes the path /proc/<pid>/cgroup shows, also
    where the cgroup mount's root is not the hierarchy's root (a daemon in a
    container without its own cgroup namespace)."""
    from cgpud.sched.cgroupfs import contains as _contains, hierarchy_path as _hierarchy_path

    mounts = [("/sys/fs/cgroup/unified", "/", "cgroup2", {"rw"}),
              ("/sys/fs/cgroup/freezer", "/docker/abc", "cgroup", {"rw", "freezer"})]
    assert _hierarchy_path({"kind": "cgroup2", "path": "/sys/fs/cgroup/unified/cgpud/x"}, mounts) == ("", "/cgpud/x")
    assert _hierarchy_path({"kind": "cgroup1-freezer", "path": "/sys/fs/cgroup/freezer/cgpud/x"}, mounts) \
        == ("freezer", "/docker/abc/cgpud/x")
    assert _hierarchy_path({"kind": "cgroup2", "path": "/elsewhere/x"}, mounts) is None
    assert _contains("/cgpud/x", "/cgpud/x") and _contains("/cgpud/x", "/cgpud/x/worker")
    assert not _contains("/cgpud/x", "/cgpud/xy")
