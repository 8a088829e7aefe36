"""CUDA graphs and the compute gate (issue 23, part 1).

PyTorch, vLLM and torch.compile capture CUDA graphs with streams in the global capture mode:
while any thread captures so, a potentially unsafe call (cuMemAlloc among them) from another
thread that is not in relaxed mode is refused and invalidates the capture; synchronizing the
context (cuCtxSynchronize) while one of its streams captures is refused in every mode (the CUDA
Programming Guide: "a broader handle which encompasses an active stream capture"; the H100
invalidated PyTorch's capture so, issue 27). libcgpu's helper drains the container's work at
every closing of its gate: a capture in progress must survive any number of closings.

No GPU here: the stand-in driver models the capture rules (native/stubs/cuda_graphs.c, from
NVIDIA's documentation of CUstreamCaptureMode); the rules are checked first, then NVIDIA's real
runtime (cuda.bindings.runtime: libcudart 13 from its wheel) captures and replays graphs under
libcgpu while the gate closes."""
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

# One process capturing graphs with the real runtime, in the global mode, as PyTorch does:
# capturer STOPFILE: begins a capture, launches 5 kernels of 200 µs into it over ~10 ms, ends it;
# instantiates the graph, replays it and waits for it; again until STOPFILE exists. Prints
# "started", then "captures invalidated replayed".
CAPTURER = textwrap.dedent("""
    import os, sys, time
    from cuda.bindings import driver as d, runtime as rt
    OK = (d.CUresult.CUDA_SUCCESS, rt.cudaError_t.cudaSuccess)
    def ok(r):
        assert r[0] in OK, r
        return r[1] if len(r) == 2 else None
    ok(rt.cudaFree(0))
    s = ok(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
    print("started", flush=True)
    captures = invalidated = replayed = 0
    while not os.path.exists(sys.argv[1]):
        ok(rt.cudaStreamBeginCapture(s, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal))
        for _ in range(5):
            r = d.cuLaunchKernel(d.CUfunction(), 200, 1, 1, 1, 1, 1, 0, d.CUstream(int(s)), 0, 0)
            assert r[0] in (d.CUresult.CUDA_SUCCESS, d.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED), r
            time.sleep(0.002)
        r = rt.cudaStreamEndCapture(s)
        captures += 1
        if r[0] == rt.cudaError_t.cudaErrorStreamCaptureInvalidated:
            invalidated += 1
            continue
        g = ok(r)
        ge = ok(rt.cudaGraphInstantiate(g, 0))
        ok(rt.cudaGraphLaunch(ge, s))
        ok(rt.cudaStreamSynchronize(s))
        ok(rt.cudaGraphExecDestroy(ge))
        ok(rt.cudaGraphDestroy(g))
        replayed += 1
    print(captures, invalidated, replayed, flush=True)
""")


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> Path:
    from test_libcgpu import build_libs
    return build_libs(tmp_path_factory.mktemp("graphs"))


def driver_env(libs: Path, tmp: Path) -> dict:
    return {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs), "CGPU_STUB_CUDA_UUIDS": UUID,
            "CGPU_STUB_CUDA_STATE": os.fspath(tmp / "card"), "CGPU_STUB_CUDA_LOG": os.fspath(tmp / "kernels")}


RULES = textwrap.dedent("""
    import threading
    from cuda.bindings import driver as d
    E = d.CUresult
    GLOBAL, LOCAL, RELAXED = (d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL,
                              d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                              d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    assert d.cuInit(0)[0] == E.CUDA_SUCCESS
    dev = d.cuDeviceGet(0)[1]
    ctx = d.cuDevicePrimaryCtxRetain(dev)[1]
    d.cuCtxSetCurrent(ctx)
    s = d.cuStreamCreate(1)[1]
    def other(fn, mode=None):
        out = []
        def run():
            d.cuCtxSetCurrent(ctx)
            if mode is not None:
                assert d.cuThreadExchangeStreamCaptureMode(mode)[0] == E.CUDA_SUCCESS
            out.append(fn()[0])
        t = threading.Thread(target=run); t.start(); t.join()
        return out[0].name
    def capture(mode, during):
        assert d.cuStreamBeginCapture(s, mode)[0] == E.CUDA_SUCCESS
        st = d.cuStreamIsCapturing(s)[1].name
        r = d.cuLaunchKernel(d.CUfunction(), 300, 1, 1, 1, 1, 1, 0, s, 0, 0)[0].name
        said = during()
        end = d.cuStreamEndCapture(s)
        if end[0] == E.CUDA_SUCCESS:
            g = end[1]
            ex = d.cuGraphInstantiate(g, 0)[1]
            assert d.cuGraphLaunch(ex, s)[0] == E.CUDA_SUCCESS
            assert d.cuStreamSynchronize(s)[0] == E.CUDA_SUCCESS
            d.cuGraphExecDestroy(ex); d.cuGraphDestroy(g)
        return said, end[0].name
    alloc = lambda: d.cuMemAlloc(1 << 20)
    print(capture(GLOBAL, lambda: other(alloc)))
    print(capture(GLOBAL, lambda: other(alloc, RELAXED)))
    print(capture(LOCAL, lambda: other(alloc)))
    print(capture(LOCAL, lambda: alloc()[0].name))
    print(capture(RELAXED, lambda: alloc()[0].name))
    print(capture(RELAXED, lambda: other(lambda: d.cuStreamSynchronize(s), RELAXED)))
    print(capture(GLOBAL, lambda: other(lambda: d.cuStreamEndCapture(s))))
    print(capture(GLOBAL, lambda: other(d.cuCtxSynchronize)))
    print(capture(GLOBAL, lambda: other(d.cuCtxSynchronize, RELAXED)))
    print(capture(LOCAL, lambda: other(d.cuCtxSynchronize)))
    print(capture(RELAXED, lambda: d.cuCtxSynchronize()[0].name))
""")


def test_the_stand_in_keeps_the_drivers_capture_rules(libs, tmp_path):
    """Each line: what the call made during a capture answered, then what cuStreamEndCapture did;
    a capture that ended well was replayed: its one kernel of 300 µs ran then, not when launched."""
    r = subprocess.run([sys.executable, "-c", RULES], env=driver_env(libs, tmp_path), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    unsupported, invalidated, ok = ("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
                                    "CUDA_SUCCESS")
    assert [eval(line) for line in r.stdout.splitlines()] == [
        (unsupported, invalidated),  # another thread's potentially unsafe call (cuMemAlloc) during a global capture
        (ok, ok),                    # the same thread relaxed
        (ok, ok),                    # a thread-local capture ignores other threads
        (unsupported, invalidated),  # but not its own thread's call
        (ok, ok),                    # a relaxed capture: its own thread may make it
        (unsupported, invalidated),  # nobody may wait for a capturing stream
        ("CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", ok),  # ended by the thread that began it
        # nobody may synchronize the context while one of its streams captures ("a broader handle which
        # encompasses an active stream capture", the CUDA Programming Guide): whatever the modes
        (unsupported, invalidated),
        (unsupported, invalidated),  # a relaxed thread too (the H100 broke PyTorch's capture so)
        (unsupported, invalidated),
        (unsupported, invalidated),
    ], r.stdout
    ks = [tuple(map(int, line.split())) for line in (tmp_path / "kernels").read_text().splitlines()]
    assert len(ks) == 4 and all(e - s == 300_000 for _, s, e in ks)  # the four graphs replayed, once each


def closings(gate: GateFreezer, n: int, closed_s: float, open_s: float) -> None:
    """Close the gate `n` times as the scheduler does: closed, drained, kept closed, opened."""
    for _ in range(n):
        gate.freeze()
        t0 = time.monotonic()
        while not gate.is_frozen():
            assert time.monotonic() - t0 < 2, f"not drained: {gate.undrained()}"
            time.sleep(0.0002)
        time.sleep(closed_s)
        gate.thaw()
        time.sleep(open_s)


def test_a_capture_survives_the_gates_closings(libs, tmp_path):
    """The real runtime captures graphs in the global mode while the gate closes 60 times: the
    library's drain at each closing (its helper thread synchronizes the context) invalidates none,
    and every captured graph is replayed on the card."""
    pages.create(os.fspath(tmp_path / "pages"), [1 << 30])
    gate = GateFreezer(os.fspath(tmp_path / "pages"))
    env = dict(driver_env(libs, tmp_path), LD_PRELOAD=os.fspath(libs / "libcgpu.so"),
               CGPU_PAGE_DIR=os.fspath(tmp_path / "pages"))
    p = subprocess.Popen([sys.executable, "-c", CAPTURER, os.fspath(tmp_path / "stop")], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == "started", p.stderr.read()
        time.sleep(0.2)
        closings(gate, 60, 0.004, 0.008)
        (tmp_path / "stop").touch()
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
    finally:
        if p.poll() is None:
            p.kill()
        gate.thaw()
        gate.close()
    captures, invalidated, replayed = map(int, out.split())
    assert captures >= 20, out  # (each ~10 ms: most closings came during one)
    assert invalidated == 0, f"{invalidated} of {captures} captures invalidated by the gate's closings"
    assert replayed == captures
    assert len((tmp_path / "kernels").read_text().splitlines()) == 5 * replayed
