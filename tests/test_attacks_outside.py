"""A process that leaves the library (issue 44; SPEC §9; docs/security.md, "Leaving the library"): a
process of an instance that uses the GPU without libcgpu (LD_PRELOAD unset here; a static binary, a
dlmopen'ed driver or raw ioctls the same) passes no gate. It has no slot, so nothing charged it and
no closing waited for it: it ran through its neighbours' turns.

A real daemon (`cgpud serve`, libcgpu, the compute gate, policy 2 at weights 1:1) with the stand-in
NVML (its per-process utilisation measured from what the stand-in card ran for each process) and two
`cgpu run` instances launching 1 ms kernels: `fair` through libcgpu, `out` with LD_PRELOAD unset. NVML
lists out's process using the GPU; it holds no slot's lock in its page: the daemon holds the instance
by its cgroup's freezer from then on (frozen whenever its gates are closed), and fair gets its half."""
from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

from test_attacks_charge import nvml_daemon
from test_enforce import lab  # noqa: F401  (the fixture)
from test_growth import watched  # noqa: F401  (the fixture)
from test_gate import CGPU, busy, libs  # noqa: F401  (libs: the fixture)

SAID = "outside the library"


def launcher(d, libs: Path, tmp: Path, name: str, seconds: float, outside: bool) -> subprocess.Popen:  # noqa: F811
    """A `cgpu run` instance (weight 1) launching 1 ms kernels, through libcgpu or (outside) not."""
    env = dict(os.environ, CGPUD_SOCKET=str(d.socket), LD_LIBRARY_PATH=os.fspath(libs),
               CGPU_STUB_CUDA_STATE=os.fspath(tmp / "card"), CGPU_STUB_CUDA_LOG=os.fspath(tmp / f"{name}.kernels"))
    leave = "unset LD_PRELOAD; " if outside else ""
    cmd = f'{leave}CGPU_STUB_CUDA_DEVICE="$CGPU_DEVICE" exec {libs / "launcher"} {seconds} 1000 1'
    return subprocess.Popen([CGPU, "run", "--name", name, "--mem", "64M", "--weight", "1", "--", "sh", "-c", cmd],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_process_outside_the_library_is_held_by_the_freezer(make_daemon, libs, tmp_path, monkeypatch):  # noqa: F811
    d = nvml_daemon(make_daemon, libs, tmp_path, monkeypatch, "GPU-c4a2e0f1-0000-4000-8000-000000000044")
    tag = uuid.uuid4().hex[:8]
    out, fair = f"outs{tag}", f"fair{tag}"
    procs = [launcher(d, libs, tmp_path, out, 14, True), launcher(d, libs, tmp_path, fair, 14, False)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "started", p.stderr.read()
        deadline = time.monotonic() + 6  # (a wait for the check's verdict, not a timed assertion: a few windows)
        while SAID not in d.log_text() and time.monotonic() < deadline and d.alive():
            time.sleep(0.05)
        time.sleep(0.3)
        t0 = time.monotonic_ns()
        time.sleep(4)
        t1 = time.monotonic_ns()
        assert all(p.poll() is None for p in procs), "a launcher ended before the window did"
    finally:
        for p in procs:
            p.terminate()
            p.communicate(timeout=30)
    theirs, mine = busy(tmp_path / f"{out}.kernels", t0, t1), busy(tmp_path / f"{fair}.kernels", t0, t1)
    share = mine / (mine + theirs)
    log = d.log_text()
    # weights 1:1: half the kernel time each
    assert share >= 0.42, (share, mine, theirs, log[-4000:])
    said = [line for line in log.splitlines() if f"instance {out}: process" in line]
    assert len(said) == 1 and SAID in said[0], log[-3000:]
    assert f"instance {fair}: process" not in log, "the neighbour through the library was held too"
    print(f"fair's share {share:.3f}")
    assert d.alive()


def test_a_held_instances_cgroup_is_frozen_at_each_closing_and_thawed_by_the_guards_entry(lab, tmp_path):  # noqa: F811
    """The hold itself, driven as the scheduler drives it: a gated instance's target (from its registry
    entry: its pages and its cgroup) held by its cgroup writes `1` to cgroup.freeze at each closing and
    `0` at each opening; its spec names the group, and the guard's thaw of that entry (a daemon that
    died with it frozen) thaws the group as well as the gates."""
    from cgpud.gpus import pages
    from cgpud.sched.enforce import freezer_from_spec, thaw_spec

    group = lab.group("cgroup2")
    pages.create(os.fspath(tmp_path / "pages"), [1 << 30])
    gate = freezer_from_spec({"kind": "cgroup2", "path": group, "gate": os.fspath(tmp_path / "pages"), "gpus": [0]})
    state = Path(group, "cgroup.freeze")
    try:
        gate.freeze(0)
        gate.thaw(0)
        assert state.read_text().strip() == "0", "frozen before it was held"
        assert gate.hold_group("a process of it used GPU 0 outside the library")
        assert not gate.hold_group("again"), "held twice"
        gate.freeze(0)
        assert state.read_text().strip() == "1", "a closing of a held instance did not freeze its cgroup"
        gate.thaw(0)
        assert state.read_text().strip() == "0", "an opening did not thaw it"
        gate.freeze(0)
        entry = gate.spec()
        assert entry["group"] == {"kind": "cgroup2", "path": group}
        assert "outside the library" in (gate.damage() or "")
    finally:
        gate.close()
    assert thaw_spec(entry) == "thawed"
    assert state.read_text().strip() == "0", "the guard's thaw left the group frozen"


def test_memory_taken_outside_the_library_is_held_before_a_neighbours_allocation_fails(watched, tmp_path):
    """A process of an instance (1 GiB) that unsets LD_PRELOAD fills the whole card; at that moment a
    neighbour's process (through libcgpu, 1 GiB) asks 256 MiB, well inside its memsize. The card is
    full: the driver says out of memory. libcgpu, the instance watched by the daemon's watchdog, gives
    the watchdog its look (it fails the process past its memsize: SIGKILL) and asks again: the
    allocation succeeds. Before, the neighbour got CUDA_ERROR_OUT_OF_MEMORY (issue 44)."""
    from test_growth import cgpu_run, finish, name

    go = tmp_path / "filled"
    fair = cgpu_run(watched, name("mf"), "1G", f"""
        import os, time
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        print("ready", flush=True)
        while not os.path.exists({os.fspath(go)!r}):
            time.sleep(0.001)
        r = d.cuMemAlloc(2**28)
        print("asked", r[0].name, flush=True)
    """)
    assert fair.stdout.readline().strip() == "ready", fair.stderr.read()
    hog = cgpu_run(watched, name("mo"), "1G", f"""
        import time
        ok(d.cuInit(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
        got = []
        for size in (2**28, 2**24, 2**20):
            while (r := d.cuMemAlloc(size))[0] == d.CUresult.CUDA_SUCCESS:
                got.append(r[1])
        open({os.fspath(go)!r}, "w").close()
        time.sleep(30)
    """, around=True)
    try:
        rc, out, err = finish(fair)
    finally:
        os.killpg(hog.pid, 9)
        hog.communicate(timeout=30)
    assert rc == 0 and out.split() == ["asked", "CUDA_SUCCESS"], (rc, out, err, watched.log_text()[-3000:])
