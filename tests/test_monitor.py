"""The pure halves of cgpu-smi, cgpu inspect and cgpu trace (docs/monitoring.md):
the compute-limit rule, GiB as the user counts them, the inspect layouts, the
trace lanes and picture, and the telemetry ring they read."""
from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from cgpud.observe.inspect import allocation, detail, summary
from cgpud.observe.monitor import compute_limits, instance_gib, node_view, user_gib
from cgpud.sched.policies import Decision, Kind
from cgpud.sched.telemetry import Telemetry
from cgpud.observe.trace import lanes, svg, summary as trace_summary

MiB, GiB = 1 << 20, 1 << 30
T4 = 15109 * MiB
V100 = 16160 * MiB
A, B, C, H = "aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc", "hhhhhhhhhhhh"


# ---- the compute limit: one rule for every policy ----------------------------------

@pytest.mark.parametrize("policy, expect", [
    (0, {A: 1 / 16, B: 1 / 16, C: 0.0}),          # fair: 1/max_inst, weight ignored (but 0 never runs)
    (1, {A: 1 / 2, B: 1 / 2, C: 0.0}),            # preemptive: an equal share of those that may run
    (2, {A: 1 / 3, B: 2 / 3, C: 0.0}),            # weighted: w / sum(w)
    (3, {A: 1 / 16, B: 2 / 16, C: 0.0}),          # fixed: w / max_inst, even alone
    (4, {A: 1 / 2, B: 1 / 2, C: 0.0}),            # weak: as preemptive
    (5, {A: None, B: None, C: None}),              # native: nothing is controlled
])
def test_compute_limit_by_policy(policy, expect):
    got = compute_limits(policy, 16, 80, [(A, 1, False), (B, 2, False), (C, 0, False)])
    assert got.keys() == expect.keys()
    for n, v in expect.items():
        assert got[n] == (None if v is None else pytest.approx(v))


def test_compute_limit_with_high_priority():
    # H takes prio_ratio of the time; the others share the rest by the policy
    got = compute_limits(2, 16, 60, [(A, 1, False), (B, 3, False), (H, 2, True)])
    assert got == {A: pytest.approx(0.4 / 4), B: pytest.approx(0.4 * 3 / 4), H: pytest.approx(0.6)}
    # alone, a high-priority instance may have the whole GPU
    assert compute_limits(0, 16, 60, [(H, 1, True)]) == {H: pytest.approx(1.0)}
    # two of them share their prio_ratio evenly under policy 1
    got = compute_limits(1, 16, 50, [(A, 1, False), (H, 1, True), (C, 5, True)])
    assert got == {A: pytest.approx(0.5), H: pytest.approx(0.25), C: pytest.approx(0.25)}


# ---- GiB as ALIYUN_COM_GPU_MEM_DEV / _CONTAINER count them ---------------------------

def test_gib_rounding_follows_the_seeds():
    assert user_gib(T4) == 15 and user_gib(V100) == 16  # "15109 MiB ... 15 GiB" (SPEC §2, §8)
    six_of_15 = T4 * 6 // 15                              # MEM_CONTAINER=6 MEM_DEV=15: 6043 MiB
    assert six_of_15 // MiB == 6043 and instance_gib(six_of_15, T4) == 6
    assert instance_gib(6 * GiB, T4) == 6 and instance_gib(T4, T4) == 15
    assert instance_gib(4309 * MiB, V100) == 4            # the seed's 4 GiB of a V100
    assert [instance_gib(T4 * k // 15, T4) for k in range(16)] == list(range(16))
    assert instance_gib(0, T4) == 0 and instance_gib(GiB, 0) == 0


def _snap(*gpus):
    return {"version": "x", "mode": "cgpu", "strategy": "binpack", "gpus": [
        {"index": k, "uuid": f"GPU-{k}", "name": "Tesla T4", "memory": T4, "policy": 2, "max_inst": 16,
         "prio_ratio": 80, "free_weight": 16 - sum(w for _, _, w in insts),
         "instances": [{"name": n, "id": j + 1, "memsize": m, "weight": w, "highprio": False, "used": 0, "procs": {}}
                       for j, (n, m, w) in enumerate(insts)]}
        for k, insts in enumerate(gpus)]}


def test_inspect_summary_is_the_products_layout():
    node = allocation(_snap([(A, T4 * 6 // 15, 1)]), "cn-shanghai.192.168.6.104", "192.168.6.104")
    assert summary([node]).splitlines() == [
        "NAME                       IPADDRESS      GPU0(Allocated/Total)  GPU Memory(GiB)",
        "cn-shanghai.192.168.6.104  192.168.6.104  6/15                   6/15",
        "-" * (len("cn-shanghai.192.168.6.104  192.168.6.104  6/15                   6/15") + 20),
        "Allocated/Total GPU Memory In Cluster: 6/15 (40%)",
    ]
    empty = allocation(_snap([]), "n", "10.0.0.1")
    assert summary([empty]).splitlines()[-1] == "Allocated/Total GPU Memory In Cluster: 0/15 (0%)"


def test_inspect_detail_lists_each_instance_on_each_gpu():
    snap = _snap([(A, 2 * GiB, 1), (B, T4 * 3 // 15, 2)], [(A, 2 * GiB, 1)])
    node = allocation(snap, "node1", "10.0.0.1")
    assert node["allocated"] == 7 and node["total"] == 30 and node["percent"] == 23  # truncated, as the product
    assert node["instances"] == [{"name": A, "gpus": {"0": 2, "1": 2}, "allocated": 4},
                                 {"name": B, "gpus": {"0": 3}, "allocated": 3}]
    lines = detail([node]).splitlines()
    assert lines[:9] == [
        "",
        "NAME:       node1",
        "IPADDRESS:  10.0.0.1",
        "",
        "NAME          NAMESPACE  GPU0(Allocated)  GPU1(Allocated)",
        f"{A}  -          2                2",
        f"{B}  -          3                0",
        "Allocated :   7 (23%)",
        "Total :       30",
    ]
    assert set(lines[9]) == {"-"} and lines[-1] == "Allocated/Total GPU Memory In Cluster: 7/30 (23%)"


def test_node_view_shape():
    snap = _snap([(A, 2 * GiB, 1), (B, 4 * GiB, 2)])
    snap["gpus"][0]["instances"][1].update(used=GiB + 5, procs={"42": GiB, "7": 5})
    stats = [{"gpu": 0, "instances": {B: {"share_1s": 0.66}}}]
    v = node_view(snap, stats, names=False)
    g = v["gpus"][0]
    assert v["schema"] == 1 and g["policy_name"] == "weighted"
    assert g["memory"] == {"total": T4, "allocated": 6 * GiB, "used": GiB + 5}
    a, b = g["instances"]
    assert a["util"] == 0.0 and b["util"] == 0.66 and g["util"] == pytest.approx(0.66)  # A: scheduled, no time yet
    assert a["limit"] == pytest.approx(1 / 3) and b["limit"] == pytest.approx(2 / 3)
    assert b["processes"] == [{"pid": 7, "memory": 5}, {"pid": 42, "memory": GiB}]
    assert node_view(snap, [])["gpus"][0]["instances"][0]["util"] is None  # no scheduler: unknown


# ---- the telemetry ring and the trace lanes -------------------------------------------

def _dec(running, active, considered, start, end, kind=Kind.SLOT):
    return Decision(frozenset(running), end, start, kind, active=frozenset(active), considered=frozenset(considered))


def test_ring_is_bounded_by_time_and_by_count():
    tel = Telemetry(0, history=50, history_seconds=1.0)
    t = 0.0
    for k in range(300):
        tel.record(_dec({A}, {A}, {A, B}, t, t + 0.01), t, t + 0.01)
        t += 0.01
    assert len(tel.recent) == 50  # the count bound
    tel = Telemetry(0, history=10_000, history_seconds=1.0)
    t = 0.0
    for k in range(300):
        tel.record(_dec({A}, {A}, {A, B}, t, t + 0.01), t, t + 0.01)
        t += 0.01
    assert tel.recent[-1].end - tel.recent[0].end <= 1.0 + 1e-9 and len(tel.recent) in (100, 101)  # the time bound
    r = tel.recent[-1]
    assert r.names == {A} and r.active == {A} and r.waiting == {B}


def _trace(slices, names, now=10.0, since=6.0):
    return {"gpu": 0, "policy": 2, "max_inst": 16, "slice": 0.01, "now": now, "since": since,
            "instances": [{"name": n, "weight": 1, "highprio": False} for n in names], "names": names,
            "slices": slices}


def test_lanes_states_clipping_and_merging():
    g = _trace([
        [5.0, 7.0, "slot", [0], [0], [1]],     # A ran, B frozen (clipped at since=6)
        [7.0, 7.5, "slot", [0], [0], [1]],     # the same again: merged
        [7.5, 8.0, "slot", [1], [1], [0]],     # B ran, A frozen
        [8.0, 9.0, "slot", [2], [], [0, 1]],   # C held its slot idle: wasted; A and B frozen
        [9.0, 9.5, "waste", [], [], []],       # nobody's slot
        [9.5, 10.0, "idle", [], [], []],       # nobody to run
    ], [A, B, C])
    ln = lanes(g)
    assert ln["instances"][A] == [[-4.0, -2.5, "run"], [-2.5, -1.0, "frozen"]]
    assert ln["instances"][B] == [[-4.0, -2.5, "frozen"], [-2.5, -2.0, "run"], [-2.0, -1.0, "frozen"]]
    assert ln["instances"][C] == [[-2.0, -1.0, "held"]]
    assert ln["gpu"] == [[-2.0, -0.5, "waste"], [-0.5, 0.0, "idle"]]


def test_svg_bars_are_where_their_intervals_say():
    g = _trace([[6.0, 7.0, "slot", [0], [0], [1]], [7.0, 9.0, "slot", [1], [1], [0]],
                [9.0, 10.0, "slot", [2], [], [0, 1]]], [A, B, C])
    g["slices"] = [[round(s * 1e6), round(e * 1e6), *rest] for s, e, *rest in g["slices"]]  # as on the socket
    doc = ET.fromstring(svg(trace_summary({"seconds": 4.0, "wall": 0.0, "gpus": [g]})))
    ns = {"s": "http://www.w3.org/2000/svg"}
    panel = doc.find("s:g", ns)
    x0, pps = float(panel.get("data-x0")), float(panel.get("data-pps"))
    bars = [r for r in panel.findall("s:rect", ns) if r.get("data-start") is not None]
    seen = {}
    for r in bars:
        s, e = float(r.get("data-start")), float(r.get("data-end"))
        assert float(r.get("x")) == pytest.approx(x0 + s * pps, abs=1e-3)
        assert float(r.get("width")) == pytest.approx((e - s) * pps, abs=1e-3)
        seen.setdefault(r.get("data-instance", "gpu"), []).append((s, e, r.get("class")))
    assert seen[A] == [(-4.0, -3.0, "run"), (-3.0, 0.0, "frozen")]
    assert seen[B] == [(-4.0, -3.0, "frozen"), (-3.0, -1.0, "run"), (-1.0, 0.0, "frozen")]
    assert seen[C] == [(-1.0, 0.0, "held")] and seen["gpu"] == [(-1.0, 0.0, "waste")]
    texts = "".join(doc.itertext())
    assert "policy 2 (weighted)" in texts and f"{B} w1" in texts and "-4 s" in texts


def test_collect_and_encode_the_ring_in_pieces():
    """The daemon side of `trace`: a snapshot of the window, the decision in
    force appended, JSON text in pieces that parse back whole."""
    import json

    from cgpud.core.model import GpuInfo, Node
    from cgpud.observe.trace import encode
    from cgpud.sched.telemetry import collect

    node = Node([GpuInfo(0, "GPU-x", "T4", T4)])
    node.create_instance(0, A, memsize=GiB)
    node.create_instance(0, B, memsize=GiB, weight=2)
    tel = Telemetry(0)
    t = 100.0
    for k in range(6):  # A, B, B, A, B, B ... and one by C, gone since
        who = A if k % 3 == 0 else B
        tel.record(_dec({who}, {who}, {A, B}, t, t + 0.01), t, t + 0.01)
        t += 0.01
    tel.record(_dec({C}, set(), {A}, t, t + 0.01), t, t + 0.01)
    t += 0.01
    in_force = _dec({A}, {A}, {A, B}, t, t + 0.01)
    snap = collect(node.gpu(0), tel.recent, in_force, t + 0.004, 0.0435, 0.01)  # from 100.0305
    assert [r.start for r in snap["records"]] == pytest.approx([100.03, 100.04, 100.05, 100.06, 100.07])
    assert snap["head"]["policy"] == 0 and [i["weight"] for i in snap["head"]["instances"]] == [1, 2]
    pieces = list(encode([snap], 0.0435, 1234.5, chunk=2))
    assert len(pieces) > 4  # head, 3 chunks of slices, tails
    got = json.loads("".join(pieces))
    assert got["seconds"] == 0.0435 and got["wall"] == 1234.5
    [g] = got["gpus"]
    assert g["names"] == [A, B, C] and g["now"] == pytest.approx(100.074) and g["since"] == pytest.approx(100.0305)
    assert g["slices"] == [
        [100030000, 100040000, "slot", [0], [0], [1]],
        [100040000, 100050000, "slot", [1], [1], [0]],
        [100050000, 100060000, "slot", [1], [1], [0]],
        [100060000, 100070000, "slot", [2], [], [0]],
        [100070000, 100074000, "slot", [0], [0], [1]],  # in force: open up to now
    ]
