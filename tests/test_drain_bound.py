"""The drain bound (issue 34, items 1 and 5): whatever the application does, the wait before a
launch and the helper's drain at a closing end within one bound.

A stream may wait on the host: cuStreamWaitValue32/64 (NCCL's proxy, vLLM's and TensorRT-LLM's
host-device flags) and cuLaunchHostFunc return at once, and the stream's later work runs only once
a word in host memory is set, or a host function has run. The stand-in card holds such a stream as
the card does (native/stubs/cuda_device.c). A process that launches more work behind such a wait
and then sets the word must not be held at its launch for ever by the library's bound on queued
work (on main it waited, with no deadline, for an event behind the wait: a deadlock, and a Python
caller holding the GIL the whole time), and a closing of its gate must be answered even though its
queued work cannot finish until the process sets the word."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cgpud.gpus import pages
from cgpud.sched.gate import GateFreezer
from real_cuda import UUID

# A process that launches behind a stream waiting on a host word, then sets the word.
# host-waiter [GO]: 40 kernels of 500 µs and a synchronize (the stream's mean known), a wait on the
# word, 40 more kernels (AFTER); prints "launched"; if GO is given, waits until that file exists; sets the
# word, synchronizes and prints "done". KIND: value32 or hostfn (a host function that waits for
# the word stands in for it).
HOST_WAITER = textwrap.dedent("""
    import ctypes, os, sys, time
    from cuda.bindings import driver as d
    def ok(r):
        assert r[0] == d.CUresult.CUDA_SUCCESS, r
        return r[1] if len(r) == 2 else None
    ok(d.cuInit(0))
    ctx = ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))
    ok(d.cuCtxSetCurrent(ctx))
    s = ok(d.cuStreamCreate(1))
    flag = ok(d.cuMemHostAlloc(8, 0))
    word = ctypes.c_uint32.from_address(int(flag))
    word.value = 0
    k = d.CUfunction()
    def launch(n):
        for _ in range(n):
            ok(d.cuLaunchKernel(k, 500, 1, 1, 1, 1, 1, 0, s, 0, 0))
    launch(40)
    ok(d.cuStreamSynchronize(s))
    if os.environ["KIND"] == "value32":
        ok(d.cuStreamWaitValue32(s, ok(d.cuMemHostGetDevicePointer(flag, 0)), 1, 0))
    else:
        HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        def wait_for_word(_):
            while not word.value:
                time.sleep(0.0005)
        keep = HOSTFN(wait_for_word)
        ok(d.cuLaunchHostFunc(s, d.CUhostFn(ctypes.cast(keep, ctypes.c_void_p).value), 0))
    launch(int(os.environ.get("AFTER", "40")))
    print("launched", flush=True)
    if len(sys.argv) > 1:
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.001)
    word.value = 1
    ok(d.cuStreamSynchronize(s))
    print("done", flush=True)
""")


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> Path:
    from test_libcgpu import build_libs
    return build_libs(tmp_path_factory.mktemp("drainbound"))


def env_of(libs: Path, tmp: Path, kind: str) -> dict:
    pages.create(os.fspath(tmp / "pages"), [1 << 30])
    return {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs), "CGPU_STUB_CUDA_UUIDS": UUID,
            "CGPU_STUB_CUDA_STATE": os.fspath(tmp / "card"), "CGPU_STUB_CUDA_LOG": os.fspath(tmp / "kernels"),
            "LD_PRELOAD": os.fspath(libs / "libcgpu.so"), "CGPU_PAGE_DIR": os.fspath(tmp / "pages"), "KIND": kind}


@pytest.mark.parametrize("kind", ["value32", "hostfn"])
def test_the_stand_in_holds_a_stream_that_waits_on_the_host(libs, tmp_path, kind):
    """Without libcgpu: the launches behind the wait return at once, and their kernels run only
    after the word is set (the log's kernels after the wait start after the process set it)."""
    env = env_of(libs, tmp_path, kind)
    del env["LD_PRELOAD"], env["CGPU_PAGE_DIR"]
    go = tmp_path / "go"
    p = subprocess.Popen([sys.executable, "-c", HOST_WAITER, os.fspath(go)], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == "launched", p.stderr.read()
        set_at = time.monotonic_ns()
        go.touch()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and out.strip() == "done", err
    ks = [tuple(map(int, line.split()[:3])) for line in (tmp_path / "kernels").read_text().splitlines()]
    assert len(ks) == 80 and all(s >= set_at for _, s, _ in ks[40:]), ks[38:42]


@pytest.mark.parametrize("kind", ["value32", "hostfn"])
def test_a_launch_behind_a_stream_waiting_on_the_host_is_not_held_for_ever(libs, tmp_path, kind):
    """The process launches 40 kernels behind the wait and only then sets the word: through libcgpu
    on a shared GPU (every launch bounded) it gets there and finishes. On main the wait before a
    launch had no deadline: it waited for an event behind the host wait, for ever."""
    r = subprocess.run([sys.executable, "-c", HOST_WAITER], env=env_of(libs, tmp_path, kind),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["launched", "done"]


@pytest.mark.parametrize("kind", ["value32", "hostfn"])
def test_a_closing_is_answered_while_the_stream_waits_on_the_host(libs, tmp_path, kind):
    """The gate closes while the process's queued work waits on its host word, which it sets only
    once the closing was answered: the helper answers (at its drain bound) instead of waiting for
    work that cannot finish. On main the drain waited with no deadline: the daemon waited up to its
    5 s cap, the neighbours' gates shut."""
    env = dict(env_of(libs, tmp_path, kind), AFTER="1")  # (one behind the wait: no launch waits for its queue)
    gate = GateFreezer(os.fspath(tmp_path / "pages"))
    go = tmp_path / "go"
    p = subprocess.Popen([sys.executable, "-c", HOST_WAITER, os.fspath(go)], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == "launched", p.stderr.read()
        gate.freeze()
        answered = False
        deadline = time.monotonic() + 10  # (a liveness bound, not a figure: the drain bound is 15 ms)
        while not answered and time.monotonic() < deadline:
            answered = gate.is_frozen()
            time.sleep(0.001)
        go.touch()
        gate.thaw()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
        gate.thaw()
        gate.close()
    assert answered, f"the closing was not answered while the stream waited on the host: {gate.undrained()}"
    assert p.returncode == 0 and out.split() == ["done"], err


# ---- the handles' lifetimes (issue 34, item 4) -------------------------------------------------

# A process that destroys what it launched into, as CuPy's and Triton's per-request streams,
# cudaDeviceReset and Numba's cuda.close() do: ROUNDS times a stream made, 20 kernels of 300 µs
# launched into it, the stream destroyed with its work queued; then work on the legacy stream and
# the primary context reset (its streams and events, the library's among them, destroyed with it);
# a new context, more work, a synchronize. Prints "started" first and "done" at the end.
DESTROYER = textwrap.dedent("""
    import sys
    from cuda.bindings import driver as d
    def ok(r):
        assert r[0] == d.CUresult.CUDA_SUCCESS, r
        return r[1] if len(r) == 2 else None
    ok(d.cuInit(0))
    dev = ok(d.cuDeviceGet(0))
    k = d.CUfunction()
    print("started", flush=True)
    for context in range(int(sys.argv[1])):
        ctx = ok(d.cuDevicePrimaryCtxRetain(dev))
        ok(d.cuCtxSetCurrent(ctx))
        for _ in range(int(sys.argv[2])):
            s = ok(d.cuStreamCreate(1))
            for _ in range(20):
                ok(d.cuLaunchKernel(k, 300, 1, 1, 1, 1, 1, 0, s, 0, 0))
            ok(d.cuStreamDestroy(s))
        for _ in range(20):
            ok(d.cuLaunchKernel(k, 300, 1, 1, 1, 1, 1, 0, 0, 0, 0))
        ok(d.cuDevicePrimaryCtxReset(dev))
    ctx = ok(d.cuDevicePrimaryCtxRetain(dev))
    ok(d.cuCtxSetCurrent(ctx))
    for _ in range(20):
        ok(d.cuLaunchKernel(k, 300, 1, 1, 1, 1, 1, 0, 0, 0, 0))
    ok(d.cuCtxSynchronize())
    print("done", flush=True)
""")

# What the stand-in does with a destroyed handle: a stream used after its destruction, an event
# after its context's reset. Prints each call's result; with CGPU_STUB_STRICT_HANDLES=1 the first
# use aborts the process.
MISUSE = textwrap.dedent("""
    from cuda.bindings import driver as d
    d.cuInit(0)
    dev = d.cuDeviceGet(0)[1]
    ctx = d.cuDevicePrimaryCtxRetain(dev)[1]
    d.cuCtxSetCurrent(ctx)
    s = d.cuStreamCreate(1)[1]
    e = d.cuEventCreate(0)[1]
    d.cuStreamDestroy(s)
    print(d.cuEventRecord(e, s)[0].name, flush=True)
    d.cuDevicePrimaryCtxReset(dev)
    print(d.cuEventQuery(e)[0].name, d.cuCtxPushCurrent(ctx)[0].name, flush=True)
""")


def test_the_stand_in_refuses_destroyed_handles_and_strictly_aborts(libs, tmp_path):
    env = env_of(libs, tmp_path, "")
    del env["LD_PRELOAD"], env["CGPU_PAGE_DIR"]
    r = subprocess.run([sys.executable, "-c", MISUSE], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["CUDA_ERROR_INVALID_HANDLE", "CUDA_ERROR_INVALID_HANDLE",
                                "CUDA_ERROR_CONTEXT_IS_DESTROYED"], r.stdout
    r = subprocess.run([sys.executable, "-c", MISUSE], env=dict(env, CGPU_STUB_STRICT_HANDLES="1"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "cuEventRecord used a destroyed stream" in r.stderr, (r.returncode, r.stderr)


def test_the_drain_never_uses_a_handle_the_application_destroyed(libs, tmp_path):
    """The gate closes again and again while the process destroys streams with work queued and
    resets its primary context: the library's helper never records into, waits on or synchronizes a
    destroyed stream, event or context (the stand-in aborts the process at the first such use), and
    the process's work is all done. On main the drain recorded into the destroyed streams and waited
    on events the context's reset had destroyed."""
    env = dict(env_of(libs, tmp_path, ""), CGPU_STUB_STRICT_HANDLES="1")
    gate = GateFreezer(os.fspath(tmp_path / "pages"))
    p = subprocess.Popen([sys.executable, "-c", DESTROYER, "3", "10"], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    n = 0
    try:
        assert p.stdout.readline().strip() == "started", p.stderr.read()
        while p.poll() is None:  # (closings until the process is done: each answered, or the process gone)
            gate.freeze()
            t0 = time.monotonic()
            while not gate.is_frozen() and p.poll() is None:
                assert time.monotonic() - t0 < 10, f"not drained: {gate.undrained()}"
                time.sleep(0.0002)
            gate.thaw()
            n += 1
            time.sleep(0.003)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
        gate.thaw()
        gate.close()
    assert p.returncode == 0 and out.split() == ["done"], err
    assert n >= 10, n  # (the closings came while it destroyed: ~0.2 s of work a context)
    kernels = (tmp_path / "kernels").read_text().splitlines()
    assert len(kernels) >= 3 * (10 * 20 + 20) + 20  # (all its kernels ran: none lost with a handle)


# ---- copies and memsets under the gate (issue 34, item 5) -------------------------------------

# A process that, once GO exists, issues 5 asynchronous memsets of 256 MiB into a stream of its own
# (each a kernel of 134 µs on the stand-in with CGPU_STUB_MEMSETS_ON_CARD=1: 256 MiB at 2 TB/s), then
# synchronizes. Prints "ready" before it waits for GO, then "done".
MEMSETS = textwrap.dedent("""
    import os, sys, time
    from cuda.bindings import driver as d
    def ok(r):
        assert r[0] == d.CUresult.CUDA_SUCCESS, r
        return r[1] if len(r) == 2 else None
    ok(d.cuInit(0))
    ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))))
    s = ok(d.cuStreamCreate(1))
    p = ok(d.cuMemAlloc(256 << 20))
    print("ready", flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.001)
    for _ in range(5):
        ok(d.cuMemsetD8Async(p, 0, 256 << 20, s))
    ok(d.cuStreamSynchronize(s))
    print("done", flush=True)
""")


def test_a_closed_gate_holds_asynchronous_memsets(libs, tmp_path):
    """The gate closed (and answered), the process issues its memsets: none runs on the card until
    the gate opens again. On main memsets and copies were neither gated nor drained: they ran through
    the closed gate, on the next instance's slice."""
    env = dict(env_of(libs, tmp_path, ""), CGPU_STUB_MEMSETS_ON_CARD="1")
    gate = GateFreezer(os.fspath(tmp_path / "pages"))
    go = tmp_path / "go"
    p = subprocess.Popen([sys.executable, "-c", MEMSETS, os.fspath(go)], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        gate.freeze()
        t0 = time.monotonic()
        while not gate.is_frozen():
            assert time.monotonic() - t0 < 10, f"not drained: {gate.undrained()}"
            time.sleep(0.0002)
        go.touch()
        time.sleep(0.3)  # (the memsets' chance to run through the closed gate: 5 × 134 µs)
        opened = time.monotonic_ns()
        gate.thaw()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
        gate.thaw()
        gate.close()
    assert p.returncode == 0 and out.split() == ["done"], err
    starts = [int(line.split()[1]) for line in (tmp_path / "kernels").read_text().splitlines()]
    assert len(starts) >= 5 and all(s >= opened for s in starts), (opened, starts)
