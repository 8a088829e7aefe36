"""Issue 27's defect, reproduced on the stand-in card (native/stubs/cuda_exec.c): the compute share
through the gate (`cgpud serve --compute gate`, libcgpu preloaded by `cgpu run`) with a workload
that runs ahead of the card, as PyTorch does: 8 launches of a 2.7 ms kernel (the H100's 4096²
fp32 matmul), then a synchronize, again and again.

On the H100 two such instances at weights 1:2 under policy 2 got 1:1 of the card: the kernels
queued before a gate's closing ran on after it, past the daemon's wait for the drain, and then
the card's own time-slicing split them evenly. The stand-in's card queues and time-slices as the
H100 did, so the same loop reads about 1:1 on it with today's library and daemon.

The shares are the card's kernel time as its log records it (a line per piece a kernel ran), in
the window where both instances ran; the high-priority figure is how long after its launch (the
client's clock, the log's) its kernel started on the card."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from queue_client import build, kernels

CGPU = str(Path(sys.executable).parent / "cgpu")
KERNEL_US = 2700  # the H100's 4096² fp32 matmul, ~2.7 ms
BATCH = 8         # launches between two synchronizes
# A model's step as the card sees it (issue 35: uniform lengths were kinder than the card): a few long
# GEMMs among many short elementwise kernels, 3 of 2.7 ms then 13 of 30 µs, between two synchronizes
MIXED, MIXED_BATCH = f"{KERNEL_US}x3,30x13", 16


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> Path:
    from test_libcgpu import build_libs
    d = build_libs(tmp_path_factory.mktemp("deepq"))
    build(d)
    return d


def instance(d, libs: Path, tmp: Path, name: str, args: list[str], cmd: str) -> subprocess.Popen:
    """`cgpu run` of `cmd` (a shell command; $Q is the client) as instance `name`, its log tmp/<name>."""
    env = dict(os.environ, CGPUD_SOCKET=str(d.socket), LD_LIBRARY_PATH=os.fspath(libs),
               CGPU_STUB_CUDA_STATE=os.fspath(tmp / "card"), CGPU_STUB_CUDA_LOG=os.fspath(tmp / name),
               Q=os.fspath(libs / "queue-client"))
    # (the stand-in keeps the GPU's device file open from cuInit on, as the driver keeps /dev/nvidiaN)
    return subprocess.Popen([CGPU, "run", "--name", name, "--mem", "64M", *args, "--", "sh", "-c",
                             f'export CGPU_STUB_CUDA_DEVICE="$CGPU_DEVICE"; {cmd}'],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def busy(log: Path, t0: int, t1: int) -> int:
    return sum(max(0, min(e, t1) - max(s, t0)) for _, s, e in kernels(log))


def first_share(procs: list[subprocess.Popen], logs: list[Path]) -> tuple[float, tuple[int, int]]:
    """Once the pair's processes have run to their end: the first one's share of the card's kernel
    time where both ran (their first and last 0.3 s left out), and that window."""
    for p in procs:
        assert p.stdout.readline().strip() == "started", p.stderr.read()
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    t0 = max(min(s for _, s, _ in kernels(lg)) for lg in logs) + 300_000_000
    t1 = min(max(e for _, _, e in kernels(lg)) for lg in logs) - 300_000_000
    assert t1 - t0 > 2e9
    one, two = (busy(lg, t0, t1) for lg in logs)
    return one / (one + two), (t0, t1)


def test_a_deep_queue_pair_at_1_to_2_gets_a_third_of_the_card_for_weight_1(make_daemon, libs, tmp_path):
    """Two instances at weights 1 and 2, policy 2, each a model's steps (3 launches of 2.7 ms and 13
    of 30 µs, then a synchronize): weight 1 gets a third of the card's kernel time (±0.05; the issue's
    figure is ±0.02, bench/deep_queue.py prints it). Issue 27's library and daemon: about a half, and
    the daemon logs that the instances did not finish their queued GPU work."""
    d = make_daemon(extra_args=["--libcgpu", os.fspath(libs / "libcgpu.so"), "--compute", "gate"])
    d.write("0/policy", "2")
    tag = uuid.uuid4().hex[:8]
    names = (f"dqa{tag}1", f"dqb{tag}2")
    loop = f'exec "$Q" loop 4 {MIXED} {MIXED_BATCH}'
    procs = [instance(d, libs, tmp_path, n, ["--weight", str(w)], loop) for n, w in zip(names, (1, 2))]
    share, _ = first_share(procs, [tmp_path / n for n in names])
    assert abs(share - 1 / 3) <= 0.05, (share, d.log_text()[-2000:])


def test_a_cpu_bound_instance_at_weight_1_gets_a_third_of_the_gpu_time_beside_a_gpu_bound_one_at_2(
        make_daemon, libs, tmp_path):
    """Small-batch inference beside training, weights 1:2, policy 2: the weight-1 instance launches a
    2 ms kernel, synchronizes, then does 1 ms of host work, again and again (it can use about two
    thirds of the time its gate is open); the weight-2 one runs 8 launches of 2.7 ms ahead. Charged
    the GPU time its processes got (libcgpu counts it), weight 1 gets a third of the card's kernel
    time (±0.05) and is not starved. Today's daemon charges the time its gate was open: it uses
    about two thirds of its third, a quarter of the card."""
    d = make_daemon(extra_args=["--libcgpu", os.fspath(libs / "libcgpu.so"), "--compute", "gate"])
    d.write("0/policy", "2")
    tag = uuid.uuid4().hex[:8]
    names = (f"dqc{tag}1", f"dqg{tag}2")
    cmds = ('exec "$Q" host 4 2000 1000', f'exec "$Q" loop 4 {KERNEL_US} {BATCH}')
    procs = [instance(d, libs, tmp_path, n, ["--weight", str(w)], c) for n, w, c in zip(names, (1, 2), cmds)]
    logs = [tmp_path / n for n in names]
    share, (t0, t1) = first_share(procs, logs)
    assert abs(share - 1 / 3) <= 0.05, (share, d.log_text()[-2000:])
    # not starved: it ran in every half second of the window
    starts = [s for _, s, _ in kernels(logs[0])]
    assert all(any(a <= s < a + 500_000_000 for s in starts) for a in range(t0, t1 - 500_000_000, 500_000_000))


def test_a_high_priority_kernel_does_not_wait_behind_a_weight_1_neighbours_queue(make_daemon, libs,
                                                                                  tmp_path):
    """`make gpu-check`'s high-priority row on the stand-in: a weight-1 instance runs 64 launches of
    2.7 ms ahead of the card (then synchronizes, again), alone for a second; then a high-priority
    instance launches one small kernel every 20 ms and waits for it. Counted on the card, not on the
    clock (the issue's 5 ms is a figure: bench/deep_queue.py row 4 prints it): for 99 % of the probe's
    kernels, at most 3 of the neighbour's kernels started between the probe's launch and its kernel's
    start — the one queued behind the neighbour's running kernel (the queue's bound lets one wait
    behind it), and the launches the neighbour made until the daemon closed its gate (it launches one
    per kernel that ends: 2.7 ms each). Before issue 27 the whole queue, 64; a high-priority path ten
    times slower than the 5 ms goal lets about 18 start."""
    d = make_daemon(extra_args=["--libcgpu", os.fspath(libs / "libcgpu.so"), "--compute", "gate"])
    d.write("0/policy", "2")
    tag = uuid.uuid4().hex[:8]
    ahead_name, probe_name = f"dqn{tag}1", f"dqh{tag}2"
    ahead = instance(d, libs, tmp_path, ahead_name, ["--weight", "1"], f'exec "$Q" loop 6.5 {KERNEL_US} 64')
    assert ahead.stdout.readline().strip() == "started", ahead.stderr.read()
    time.sleep(1.0)
    probe = instance(d, libs, tmp_path, probe_name, ["--highprio"], 'exec "$Q" every 4 10 20')
    out, err = probe.communicate(timeout=60)
    assert probe.returncode == 0, err
    ahead.communicate(timeout=60)
    launches = [int(line.split()[0]) for line in out.splitlines()[1:]]
    mine = sorted(s for _, s, _ in kernels(tmp_path / probe_name))
    theirs = sorted(s for _, s, _ in kernels(tmp_path / ahead_name))
    assert len(launches) > 100 and len(mine) == len(launches), (len(launches), len(mine))
    ahead_of = sorted(sum(a <= s < k for s in theirs) for a, k in zip(launches, mine))
    p99 = ahead_of[int(0.99 * len(ahead_of))]
    assert p99 <= 3, (f"neighbour kernels started before the probe's: p50 {ahead_of[len(ahead_of) // 2]}, "
                      f"p99 {p99}, max {ahead_of[-1]}", d.log_text()[-1500:])


def test_a_stream_whose_events_are_done_by_its_next_launch_records_one_event_per_stride(libs, tmp_path):
    """A bounded stream on a card that keeps up (the stand-in's launches made free: each event is
    done by the next launch, as a launch-bound stream's often is): libcgpu records an event every
    stride (up to 64 launches once they never wait) and no other — each record is a driver call of
    a microsecond or two, over 64 launches about 20 ns a launch. Before, an event found done at
    the next launch began a new run with an event of its own: two records a stride, and a bounded
    launch cost 117-123 ns against the stand-in's 18 (bench/gate.py 1; issue 20's goal: 100 ns
    added)."""
    from cgpud.gpus import pages
    from cgpud.sched.gate import GateFreezer
    pages.create(os.fspath(tmp_path / "pages"), [1 << 30])
    g = GateFreezer(os.fspath(tmp_path / "pages"))
    g.share(None, True, 2000)  # (the GPU shared: launches bounded)
    g.close()
    calls = tmp_path / "calls"
    env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs), "LD_PRELOAD": os.fspath(libs / "libcgpu.so"),
           "CGPU_PAGE_DIR": os.fspath(tmp_path / "pages"), "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card"),
           "CGPU_STUB_CUDA_FAST": "1", "CGPU_STUB_CUDA_CALLS": os.fspath(calls)}
    n = 6400
    r = subprocess.run([os.fspath(libs / "queue-client"), "burst", str(n), "10"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    records = calls.read_text().split().count("cuEventRecord")
    assert 0 < records <= n / 64 * 1.25 + 16, records  # (the stride doubles from 1 to 64 first)


def _bounded(libs: Path, tmp_path: Path, budget_us: int = 2000) -> dict:
    """A container's pages with its GPU shared (launches bounded, GPU time counted), no daemon; the
    environment of a process of it on a stand-in card of the test's own."""
    from cgpud.gpus import pages
    from cgpud.sched.gate import GateFreezer
    pages.create(os.fspath(tmp_path / "pages"), [1 << 30])
    g = GateFreezer(os.fspath(tmp_path / "pages"))
    g.share(None, True, budget_us)
    g.close()
    return {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": os.fspath(libs),
            "LD_PRELOAD": os.fspath(libs / "libcgpu.so"), "CGPU_PAGE_DIR": os.fspath(tmp_path / "pages"),
            "CGPU_STUB_CUDA_STATE": os.fspath(tmp_path / "card"), "CGPU_STUB_CUDA_LOG": os.fspath(tmp_path / "log")}


def _overlaps(log: Path) -> int:
    """Kernels that started before the one before them on the card ended (the stand-in's log)."""
    ks = sorted(kernels(log), key=lambda k: k[1])
    return sum(b[1] < a[2] for a, b in zip(ks, ks[1:]))


def test_programmatic_dependent_launches_keep_their_overlap_through_the_queue_bound(libs, tmp_path):
    """Hopper's programmatic dependent launches (cuLaunchKernelEx with
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, as TensorRT-LLM and vLLM launch a layer's
    kernels): each overlaps the tail of the kernel before it in its stream, and an event recorded
    between the two serializes them on the card (the stand-in does both: without libcgpu, 140
    overlaps of 140 pairs; with an event after each launch, none). Through libcgpu on a shared GPU
    (its bound and GPU-time events on) the overlaps stay: 20 rounds of a kernel then 7 PDL ones of
    100 µs (800 µs a round, under the 2 ms budget). Today's libcgpu records its timing event after
    every launch of a stream it has not measured yet: no overlap is left."""
    env = _bounded(libs, tmp_path)
    p = subprocess.Popen([os.fspath(libs / "queue-client"), "pdl", "20", "8", "100"], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline().strip() == "warm", p.stderr.read()
    before = _charged(tmp_path / "pages")  # (the process's first launches: the driver's lazy loading)
    out, err = p.communicate("go\n", timeout=60)
    assert p.returncode == 0, err
    ks = kernels(tmp_path / "log")[2:]
    assert len(ks) == 160, len(ks)
    ks.sort(key=lambda k: k[1])
    gaps = [b[1] - a[2] for a, b in zip(ks, ks[1:])]
    # (the first rounds, while the stream's mean is learned, may lose one or two; and a pair launched
    # after the first had ended, the client held off its CPU, cannot overlap)
    assert sum(g < 0 for g in gaps) >= 140 - 6, gaps
    # and the GPU time is still counted, the rounds' union on the card (20 × (100 + 7 × 90) µs) within
    # 15 % (the launches between events are charged at the stream's mean, measured without overlap)
    union = sum(e - s for _, s, e in ks) + sum(g for g in gaps if g < 0)
    charged = _charged(tmp_path / "pages") - before
    assert abs(charged / union - 1) <= 0.15, (charged, union)


def _charged(page_dir: Path) -> int:
    """The GPU time the usage page counts for GPU 0, all slots together."""
    from cgpud.gpus import pages
    raw = (page_dir / "usage").read_bytes()
    return sum(pages.BUSY.unpack_from(raw, pages.BUSY_OFFSET + k * pages.BUSY.size)[2] for k in range(pages.MAX_PROCS))


def test_the_gpu_time_of_two_concurrent_streams_is_their_union_not_their_sum(libs, tmp_path):
    """One process, two threads each with a stream of its own, each 8 launches of 500 µs then a
    synchronize, again and again for 1.5 s (a pipeline's compute and copy streams, DDP's
    communication stream beside the compute one): the streams' work is queued at the same time, and
    the process is charged the time the card worked for it (its kernels' union in the card's log:
    the stand-in runs them one at a time), within 10 %. Summing each stream's runs from its own
    events counts the time both were queued twice: today about 1.8 times the card's."""
    env = _bounded(libs, tmp_path)
    r = subprocess.run([os.fspath(libs / "queue-client"), "two", "1.5", "500", "8"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    busy_ns = sum(e - s for _, s, e in kernels(tmp_path / "log"))
    assert busy_ns > 1e9, busy_ns
    charged = _charged(tmp_path / "pages")
    assert abs(charged / busy_ns - 1) <= 0.10, (charged, busy_ns, charged / busy_ns)


def test_the_queue_bound_holds_in_time_with_long_kernels_behind_short_ones(libs, tmp_path):
    """A model's step as the card sees it: a few long GEMMs among many short elementwise kernels
    (4 of 3 ms, then 40 of 20 µs; 8 steps launched as fast as the queue lets them), on a shared GPU
    with a 2 ms budget. Once each kind of kernel has run (the first step), no launch returns with
    more queued ahead of its kernel than the budget and the one kernel running (3 ms), with 1 ms for
    the launcher's wake-up: the time from a launch's return to its kernel's start is at most 6 ms.
    A bound by the stream's mean time per launch (after 40 short kernels, about 20 µs) lets the
    launcher queue all four GEMMs at once: 9-12 ms ahead."""
    env = _bounded(libs, tmp_path)
    step = 44
    r = subprocess.run([os.fspath(libs / "queue-client"), "burst", str(8 * step), "3000x4,20x40"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    returned = [int(x) for x in r.stdout.split()[:-1]]
    ks = kernels(tmp_path / "log")
    assert len(ks) == len(returned) == 8 * step, (len(ks), len(returned))
    starts = [s for _, s, _ in sorted(ks, key=lambda k: k[1])]
    ahead = [s - t for s, t in zip(starts, returned)][step:]
    assert max(ahead) <= 6_000_000, sorted(ahead)[-10:]


def test_a_closing_leaves_no_event_between_two_programmatic_dependent_launches(libs, tmp_path):
    """A stream of programmatic dependent launches (issue 45, item 13): a kernel of 3 s runs when the
    gate closes; the drain answers by its bound (1 s) while it still runs; the gate opens and the next
    dependent launch goes in. It overlaps the long kernel's tail (10 µs on the stand-in, as the card's
    preamble): the drain asked the stream whether its work was done instead of recording an event
    after its last launch. Before, the drain's event sat between the two and serialized them (the
    stand-in, as the card: a record costs it 1 µs between them, no overlap)."""
    from cgpud.sched.gate import GateFreezer
    from test_graphs import stopped
    env = _bounded(libs, tmp_path)
    gate = GateFreezer(os.fspath(tmp_path / "pages"))
    gate.bound(1_000_000)
    p = subprocess.Popen([os.fspath(libs / "queue-client"), "pdlgate", "3000000", "100"], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == "warm"
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "launched"
        gate.freeze()
        t0 = time.monotonic()
        while not gate.is_frozen():  # (the drain's answer: at its bound, the long kernel still running)
            assert time.monotonic() - t0 < 30, f"never drained: {gate.undrained()}"
            time.sleep(0.001)
        gate.thaw()
        out, err = p.communicate("go\n", timeout=60)
        assert p.returncode == 0 and out.split() == ["done"], err
    finally:
        stopped(p, gate, None)  # (the process killed if it is still there, the gate opened and let go)
    ks = sorted(kernels(tmp_path / "log"), key=lambda k: k[1])
    assert [e - s for _, s, e in ks] == [100_000, 100_000, 3_000_000_000, 100_000], ks
    long_end, next_start = ks[2][2], ks[3][1]
    assert next_start - long_end == -10_000, (long_end, next_start)
