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
# "started", then "captures invalidated replayed", then each capture's begin and end (ns, CLOCK_MONOTONIC).
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
    spans = []
    while not os.path.exists(sys.argv[1]):
        begun = time.monotonic_ns()
        ok(rt.cudaStreamBeginCapture(s, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal))
        for _ in range(5):
            r = d.cuLaunchKernel(d.CUfunction(), 200, 1, 1, 1, 1, 1, 0, d.CUstream(int(s)), 0, 0)
            assert r[0] in (d.CUresult.CUDA_SUCCESS, d.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED), r
            time.sleep(0.002)
        r = rt.cudaStreamEndCapture(s)
        spans.append((begun, time.monotonic_ns()))
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
    for b, e in spans:
        print(b, e)
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


def stopped(p: subprocess.Popen, gate: GateFreezer, stop: Path | None, timeout: float = 60) -> str:
    """The process's output once `stop` is touched (None: on an error before: it is killed); the
    gate opened and let go either way."""
    try:
        if stop is None:
            return ""
        stop.touch()
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err
        return out
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        gate.thaw()
        gate.close()


def closings(gate: GateFreezer, n: int, closed_s: float, open_s: float) -> list[tuple[int, int]]:
    """Close the gate `n` times as the scheduler does: closed, drained, kept closed, opened. Returns
    each closing's span from the gate's closing to the drain's answer seen (ns, CLOCK_MONOTONIC)."""
    spans = []
    for _ in range(n):
        closed = time.monotonic_ns()
        gate.freeze()
        t0 = time.monotonic()
        while not gate.is_frozen():
            assert time.monotonic() - t0 < 2, f"not drained: {gate.undrained()}"
            time.sleep(0.0002)
        spans.append((closed, time.monotonic_ns()))
        time.sleep(closed_s)
        gate.thaw()
        time.sleep(open_s)
    return spans


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
    stop = None
    try:
        assert p.stdout.readline().strip() == "started", p.stderr.read()
        time.sleep(0.2)
        drains = closings(gate, 60, 0.004, 0.008)
        stop = tmp_path / "stop"
    finally:
        out = stopped(p, gate, stop, 30)
    lines = out.splitlines()
    captures, invalidated, replayed = map(int, lines[0].split())
    spans = [tuple(map(int, line.split())) for line in lines[1:]]
    # the closings whose whole drain (the gate's closing to its answer) fell inside a capture: the
    # helper drained the process while its stream captured (each capture ~10 ms of the 12 ms cycle)
    inside = sum(any(b < c and a < e for b, e in spans) for c, a in drains)
    assert inside >= 20, f"only {inside} of 60 drains fell inside a capture: nothing tested the capture's survival"
    assert invalidated == 0, f"{invalidated} of {captures} captures invalidated by the gate's closings"
    assert replayed == captures
    assert len((tmp_path / "kernels").read_text().splitlines()) == 5 * replayed


# A stream that mixes eager launches and graph launches (vLLM's decode: graphs; its prefill and
# sampling: eager): 200 kernels of 20 µs and a synchronize (the stream's mean per launch learnt),
# then a graph of 50 kernels of 200 µs (10 ms a launch) captured, instantiated and launched 20 times
# back to back (at real-time priority where it may). Prints "started", each graph launch's return (ns, CLOCK_MONOTONIC), then "done".
# argv[1], where the 50 kernels are: "flat" (the graph's own nodes), "child" (a child graph node's
# graph), "conditional" (a child graph node in the body of an IF node whose handle defaults to 1).
MIXED = textwrap.dedent("""
    import os, sys, time
    from cuda.bindings import driver as d
    try:  # (as the tests' launchers: the launches come back to back however busy the machine)
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
    except OSError:
        pass
    def ok(r):
        assert r[0] == d.CUresult.CUDA_SUCCESS, r
        return r[1] if len(r) == 2 else None
    ok(d.cuInit(0))
    ctx = ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))
    ok(d.cuCtxSetCurrent(ctx))
    s = ok(d.cuStreamCreate(1))
    k = d.CUfunction()
    for _ in range(200):
        ok(d.cuLaunchKernel(k, 20, 1, 1, 1, 1, 1, 0, s, 0, 0))
    ok(d.cuStreamSynchronize(s))
    ok(d.cuStreamBeginCapture(s, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    for _ in range(50):
        ok(d.cuLaunchKernel(k, 200, 1, 1, 1, 1, 1, 0, s, 0, 0))
    g = ok(d.cuStreamEndCapture(s))
    if sys.argv[1] != "flat":
        outer = into = ok(d.cuGraphCreate(0))
        if sys.argv[1] == "conditional":
            p = d.CUgraphNodeParams()
            p.type = d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
            p.conditional.handle = ok(d.cuGraphConditionalHandleCreate(outer, ctx, 1, d.CU_GRAPH_COND_ASSIGN_DEFAULT))
            p.conditional.type = d.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF
            p.conditional.size, p.conditional.ctx = 1, ctx
            ok(d.cuGraphAddNode(outer, None, None, 0, p))
            into = p.conditional.phGraph_out[0]
        ok(d.cuGraphAddChildGraphNode(into, None, 0, g))
        g = outer
    ex = ok(d.cuGraphInstantiate(g, 0))
    print("started", flush=True)
    for _ in range(20):
        ok(d.cuGraphLaunch(ex, s))
        print(time.monotonic_ns(), flush=True)
    ok(d.cuStreamSynchronize(s))
    print("done", flush=True)
""")


@pytest.mark.parametrize("shape, old_driver", [("flat", 0), ("child", 0), ("conditional", 0), ("conditional", 1)])
def test_a_graph_counts_as_its_kernels_in_the_queues_bound(libs, tmp_path, shape, old_driver):
    """Through libcgpu on a shared GPU (every launch bounded to 2 ms of queued work), the mixed
    stream's graph launches never have more than three graphs' kernels queued (150: the budget is a
    fifth of one graph, and one launch behind the running work always passes) — counted on the card:
    at each launch's return, the graph kernels launched so far less those the card had started. On
    main a graph counted as one launch at the stream's mean (20 µs, learnt from the eager kernels):
    all 20 graphs, 200 ms, were queued at once. Issue 45, item 9: the same with the kernels in a child
    graph node's graph, or in a conditional node's body (a child graph node there): a child or
    conditional node counted as one node, and all 20 graphs were queued at once again; now their
    graphs' nodes count (a conditional's body once, docs/scheduler.md), also on a driver without
    cuGraphNodeGetParams (old_driver: the bodies cuGraphAddNode returned, kept by libcgpu)."""
    pages.create(os.fspath(tmp_path / "pages"), [1 << 30])
    env = dict(driver_env(libs, tmp_path), LD_PRELOAD=os.fspath(libs / "libcgpu.so"),
               CGPU_PAGE_DIR=os.fspath(tmp_path / "pages"), CGPU_STUB_NO_NODE_PARAMS=str(old_driver))
    r = subprocess.run([sys.executable, "-c", MIXED, shape], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert lines[0] == "started" and lines[-1] == "done", r.stdout
    returns = list(map(int, lines[1:-1]))
    starts = sorted(s for s, e in (map(int, line.split()[1:3]) for line in
                                   (tmp_path / "kernels").read_text().splitlines()) if e - s == 200_000)
    assert len(starts) == 20 * 50, len(starts)  # (each graph kernel whole: nothing preempted it)
    queued = [50 * (i + 1) - sum(s <= t for s in starts) for i, t in enumerate(returns)]
    assert max(queued) <= 150, queued


# One thread launches untracked work on GPU 0 (kernels of 2 ms into the legacy stream) while another
# captures graphs in the global mode on a stream of GPU `CAP` (each capture 5 kernels over ~10 ms,
# ended, counted if invalidated), until STOPFILE exists. Prints "started", then "captures invalidated".
TWO_GPUS = textwrap.dedent("""
    import os, sys, threading, time
    from cuda.bindings import driver as d
    E = d.CUresult
    def ok(r):
        assert r[0] == E.CUDA_SUCCESS, r
        return r[1] if len(r) == 2 else None
    ok(d.cuInit(0))
    cap = int(sys.argv[2])
    ctx = [ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(i)))) for i in (0, 1)]
    stop = sys.argv[1]
    counts = [0, 0]
    def capturer():
        ok(d.cuCtxSetCurrent(ctx[cap]))
        s = ok(d.cuStreamCreate(1))
        while not os.path.exists(stop):
            ok(d.cuStreamBeginCapture(s, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
            for _ in range(5):
                d.cuLaunchKernel(d.CUfunction(), 100, 1, 1, 1, 1, 1, 0, s, 0, 0)
                time.sleep(0.002)
            r = d.cuStreamEndCapture(s)
            counts[0] += 1
            if r[0] != E.CUDA_SUCCESS:
                counts[1] += 1
            else:
                d.cuGraphDestroy(r[1])
    ok(d.cuCtxSetCurrent(ctx[0]))
    ok(d.cuLaunchKernel(d.CUfunction(), 10, 1, 1, 1, 1, 1, 0, d.CUstream(0), 0, 0))
    t = threading.Thread(target=capturer)
    t.start()
    print("started", flush=True)
    while not os.path.exists(stop):
        ok(d.cuLaunchKernel(d.CUfunction(), 2000, 1, 1, 1, 1, 1, 0, d.CUstream(0), 0, 0))
        time.sleep(0.001)
    t.join()
    print(*counts, flush=True)
""")


@pytest.mark.parametrize("cap", [1, 0])
def test_no_global_capture_is_invalidated_by_the_drain_of_untracked_work(libs, tmp_path, cap):
    """GPU 0's work is not bounded (the GPUs not shared: the drain synchronizes GPU 0's context at
    each of 40 closings) while another thread captures in the global mode, on GPU 1, or on a
    stream of GPU 0 that nothing was queued into (vLLM's warm-up capture): none is invalidated.
    Before, the library's synchronizing thread stayed in the global mode (its synchronize is a
    potentially unsafe call: every global capture of another thread invalidated), and the drain's
    guard saw only captures on streams already in its queues (GPU 0's context synchronized under
    a capture: invalidated in every mode) (issue 45, item 2)."""
    pages.create(os.fspath(tmp_path / "pages"), [1 << 30, 1 << 30])
    gate = GateFreezer(os.fspath(tmp_path / "pages"), gpus=[0, 1])
    for k in (0, 1):
        gate.share(k, False, 2000)
    env = dict(driver_env(libs, tmp_path), LD_PRELOAD=os.fspath(libs / "libcgpu.so"), CGPU_STUB_CUDA_DEVICES="2",
               CGPU_PAGE_DIR=os.fspath(tmp_path / "pages"))
    env.pop("CGPU_STUB_CUDA_UUIDS")
    p = subprocess.Popen([sys.executable, "-c", TWO_GPUS, os.fspath(tmp_path / "stop"), str(cap)], env=env,
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    unanswered, stop = 0, None
    try:
        assert p.stdout.readline().strip() == "started", p.stderr.read()
        time.sleep(0.1)
        for _ in range(40):
            gate.freeze(0)
            t0 = time.monotonic()
            while gate.undrained(0) and time.monotonic() - t0 < 5:
                time.sleep(0.0005)
            unanswered += bool(gate.undrained(0))
            gate.thaw(0)
            time.sleep(0.01)
        stop = tmp_path / "stop"
    finally:
        out = stopped(p, gate, stop)
    captures, invalidated = map(int, out.split())
    assert captures >= 20 and unanswered == 0, (captures, unanswered)
    assert invalidated == 0, f"{invalidated} of {captures} captures invalidated by the drains"
