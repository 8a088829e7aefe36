"""Placement (SPEC §3, §6): cgpud.containers.placement called directly on plain snapshots.

binpack fills the fitting GPU with the least free memory, spread takes the
most free; ties go to the lower index; N over M GPUs is N/M each; the node
modes; and never an overcommit — checked on examples and, with hypothesis,
on random nodes and on a real Node that must accept every plan.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgpud.control.views import snapshot
from cgpud.containers.envspec import COUNT, MEM_CONTAINER, MEM_DEV, NVIDIA, VISIBLE, WEIGHT, parse_env
from cgpud.core.model import GpuInfo, InvalidValue, Node, NoSpace
from cgpud.containers.request import GIB, SHARE_UNIT, Sizing, UnevenSplit, split
from cgpud.containers.placement import (
    CGPU_MAX_SHARE,
    MODES,
    STRATEGIES,
    GpuState,
    PlacementError,
    check_named,
    instance_cap,
    place,
    place_split,
    resolve,
    states_from_node,
    states_from_snapshot,
    unit_for,
)

MIB = 1 << 20
T4 = 15109 * MIB
NAMES = [f"c{i:011d}" for i in range(64)]


def gpu(index: int, free_gib: float, *, memory: int = T4, instances: int = 0, max_inst: int = 16) -> GpuState:
    return GpuState(index, memory, int(free_gib * GIB), instances, max_inst)


def node_with(*used_gib: int, n: int | None = None) -> Node:
    """T4s; GPU i holds one instance of used_gib[i] GiB (none when 0)."""
    node = Node([GpuInfo(i, f"GPU-p{i}", "Tesla T4", T4) for i in range(n or len(used_gib))])
    for i, u in enumerate(used_gib):
        if u:
            node.create_instance(i, NAMES[i], memsize=u * GIB, promise=True)
    return node


# ---- binpack and spread -----------------------------------------------------------------


def test_binpack_takes_the_fitting_gpu_with_least_free_memory():
    gpus = [gpu(0, 10), gpu(1, 4), gpu(2, 7), gpu(3, 14)]
    assert place(gpus, 6 * GIB) == [(2, 6 * GIB)]  # GPU 1 has less free, but 6 GiB does not fit there
    assert place(gpus, 4 * GIB) == [(1, 4 * GIB)]  # exactly fits: fits
    assert place(gpus, 4 * GIB, strategy="binpack") == place(gpus, 4 * GIB)  # the default


def test_spread_takes_the_gpu_with_most_free_memory():
    gpus = [gpu(0, 10), gpu(1, 4), gpu(2, 7), gpu(3, 14)]
    assert place(gpus, 2 * GIB, strategy="spread") == [(3, 2 * GIB)]
    assert place(gpus[:3], 2 * GIB, strategy="spread") == [(0, 2 * GIB)]


def test_ties_go_to_the_lower_index():
    gpus = [gpu(3, 5), gpu(1, 5), gpu(2, 5), gpu(0, 9)]
    assert place(gpus, GIB) == [(1, GIB)]
    assert place(gpus, GIB, strategy="spread") == [(0, GIB)]
    assert place([gpu(2, 5), gpu(1, 5)], GIB, strategy="spread") == [(1, GIB)]


def test_binpack_fills_one_gpu_before_the_next_and_spread_alternates():
    """On a real node: binpack keeps whole GPUs free, spread never doubles up while a GPU is empty."""
    for strategy, expect in (("binpack", [0, 0, 0, 1, 1, 1]), ("spread", [0, 1, 0, 1, 0, 1])):
        node = node_with(0, 0)
        got = []
        for k in range(6):
            [(g, m)] = place(states_from_node(node), 4 * GIB, strategy=strategy)
            node.create_instance(g, NAMES[k], memsize=m, promise=True)
            got.append(g)
        assert got == expect, strategy
        with pytest.raises(PlacementError):  # 3 × 4 GiB on each: 3 GiB left, a 4th does not fit
            place(states_from_node(node), 4 * GIB, strategy=strategy)


def test_dev_sizing_depends_on_each_gpu():
    gpus = [GpuState(0, 8 * GIB, 8 * GIB, 0, 16), GpuState(1, T4, 3 * GIB, 2, 16)]
    # 6/15 of an 8 GiB GPU is 3.2 GiB: fits GPU 0; 6/15 of a T4 (5.9 GiB) does not fit GPU 1's 3 GiB
    assert place(gpus, Sizing(6, GIB, 15)) == [(0, 8 * GIB * 6 // 15)]


# ---- multi-GPU ---------------------------------------------------------------------------


def test_n_over_m_gives_n_over_m_each_on_the_gpus_the_rule_picks():
    gpus = [gpu(0, 14), gpu(1, 5), gpu(2, 4.5), gpu(3, 3)]
    assert place_split(gpus, Sizing(8), 2) == [(2, 4 * GIB), (1, 4 * GIB)]  # the two least free that fit
    assert place_split(gpus, Sizing(8), 2, strategy="spread") == [(0, 4 * GIB), (1, 4 * GIB)]
    assert place(gpus, 4 * GIB, 2) == place_split(gpus, Sizing(8), 2)
    assert split(Sizing(12, GIB, 15), 4) == Sizing(3, GIB, 15)


def test_a_split_that_is_not_whole_is_refused():
    with pytest.raises(UnevenSplit, match=r"7 GiB over 2 GPUs is not a whole number per GPU \(7/2\)") as info:
        place_split([gpu(0, 14), gpu(1, 14)], Sizing(7), 2)
    assert isinstance(info.value, InvalidValue) and "\n" not in str(info.value)
    with pytest.raises(UnevenSplit):
        split(Sizing(10, SHARE_UNIT), 3)
    assert split(Sizing(9, SHARE_UNIT), 3) == Sizing(3, SHARE_UNIT)


def test_all_m_gpus_must_be_on_this_node_and_distinct():
    with pytest.raises(PlacementError, match="over 3 GPUs: this node has 2"):
        place_split([gpu(0, 14), gpu(1, 14)], Sizing(6), 3)
    # 2 GPUs wanted, only one fits: no partial answer
    with pytest.raises(PlacementError, match="no room for 2 GPUs with 6144 MiB each"):
        place([gpu(0, 14), gpu(1, 5)], 6 * GIB, 2)
    got = place([gpu(0, 14), gpu(1, 14), gpu(2, 14)], 7 * GIB, 3)
    assert sorted(g for g, _ in got) == [0, 1, 2]


# ---- node modes -------------------------------------------------------------------------


def test_exclusive_mode_skips_any_gpu_with_an_instance():
    gpus = [gpu(0, 14, instances=1), gpu(1, 10), gpu(2, 2, instances=0)]
    assert place(gpus, GIB, mode="exclusive") == [(2, GIB)]
    assert place(gpus, 3 * GIB, mode="exclusive") == [(1, 3 * GIB)]
    assert place(gpus, GIB, mode="cgpu") == [(2, GIB)]
    with pytest.raises(PlacementError, match="GPU 0 taken"):
        place(gpus, 12 * GIB, mode="exclusive")


def test_cgpu_and_mps_cap_at_16_instances_share_goes_to_max_inst():
    full16 = gpu(0, 10, instances=16, max_inst=25)
    other = gpu(1, 1, instances=0)
    for mode in ("cgpu", "mps"):
        assert instance_cap(full16, mode) == CGPU_MAX_SHARE
        assert place([full16, other], 128 * MIB, mode=mode) == [(1, 128 * MIB)]
        with pytest.raises(PlacementError, match=f"at most 16 per GPU"):
            place([full16], 128 * MIB, mode=mode)
    # share mode: no isolation module, so max_inst (25) is the only cap
    assert instance_cap(full16, "share") == 25
    assert place([full16, other], 128 * MIB, mode="share") == [(1, 128 * MIB)]  # binpack: least free
    assert place([full16, other], 2 * GIB, mode="share") == [(0, 2 * GIB)]
    # a max_inst below 16 still binds in every mode
    small = gpu(0, 10, instances=4, max_inst=4)
    for mode in MODES:
        with pytest.raises(PlacementError, match="full: 4 instances|taken"):
            place([small], GIB, mode=mode)


def test_share_mode_allocates_in_128_mib_units():
    assert unit_for("share") == SHARE_UNIT == 128 * MIB
    assert unit_for("cgpu") == unit_for("exclusive") == unit_for("mps") == GIB
    gpus = [gpu(0, 1.25), gpu(1, 14)]
    assert place(gpus, Sizing(10, unit_for("share")), mode="share") == [(0, 10 * 128 * MIB)]
    assert place(gpus, Sizing(10, unit_for("share")), mode="share", strategy="spread") == [(1, 1280 * MIB)]
    with pytest.raises(ValueError, match="unknown node mode"):
        unit_for("shared")


def test_a_gpu_whose_max_inst_is_below_the_weight_is_not_a_candidate():
    gpus = [gpu(0, 2, max_inst=4), gpu(1, 14, max_inst=16)]
    assert place(gpus, GIB, weight=8) == [(1, GIB)]
    with pytest.raises(PlacementError, match="max_inst 4 is below weight 8"):
        place(gpus[:1], GIB, weight=8)


# ---- no overcommit: the message ------------------------------------------------------------


def test_no_overcommit_one_line_with_what_was_asked_and_what_each_gpu_has():
    gpus = [gpu(0, 5), gpu(1, 3.5, instances=3), gpu(2, 14, instances=16, max_inst=16)]
    with pytest.raises(PlacementError) as info:
        place(gpus, 6 * GIB)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("no room for 1 GPU with 6144 MiB (binpack, cgpu mode): ")
    assert "GPU 0 needs 6144 MiB, has 5120 MiB free of 15109 MiB" in msg
    assert "GPU 1 needs 6144 MiB, has 3584 MiB free of 15109 MiB" in msg
    assert "GPU 2 full: 16 instances (max_inst 16)" in msg
    assert isinstance(info.value, NoSpace)  # ENOSPC at the control socket
    with pytest.raises(PlacementError, match=r"no room for 2 GPUs with 6/15 of the GPU each .*"
                                             r"GPU 0 fits \(7168 MiB free of 15109 MiB\); "
                                             r"GPU 1 needs 6043\.59 MiB, has 3584 MiB free"):  # 6043.5999… rounded down
        place_split([gpu(0, 7), gpus[1]], Sizing(12, GIB, 15), 2)


def test_sizes_in_messages_are_rounded_down():
    with pytest.raises(PlacementError, match=r"has 2047\.99 MiB free"):
        place([GpuState(0, T4, 2 * GIB - 1, 0, 16)], 2 * GIB)


def test_bad_arguments_are_programming_errors():
    for kw in ({"strategy": "pack"}, {"mode": "isolated"}, {"count": 0}, {"weight": -1}):
        with pytest.raises(ValueError):
            place([gpu(0, 14)], GIB, **kw)
    with pytest.raises(ValueError):
        place([gpu(0, 14), gpu(0, 3)], GIB)
    with pytest.raises(ValueError):
        Sizing(-1)
    with pytest.raises(ValueError):
        Sizing(1, GIB, 0)


# ---- snapshots, named GPUs, a parsed request end to end --------------------------------------


def test_states_from_a_node_and_from_its_snapshot_agree():
    node = node_with(6, 0, 3)
    node.set_max_inst(1, 8)
    node.create_instance(2, NAMES[9], memsize=GIB, promise=True)
    want = [
        GpuState(0, T4, T4 - 6 * GIB, 1, 16, "GPU-p0"),
        GpuState(1, T4, T4, 0, 8, "GPU-p1"),
        GpuState(2, T4, T4 - 4 * GIB, 2, 16, "GPU-p2"),
    ]
    assert states_from_node(node) == want
    assert states_from_snapshot(snapshot(node)) == want


def test_named_gpus_are_checked_by_the_same_rules():
    gpus = [gpu(0, 5, instances=1), gpu(1, 14)]
    assert check_named(gpus, [(1, 6 * GIB), (0, 5 * GIB)]) == [(1, 6 * GIB), (0, 5 * GIB)]
    with pytest.raises(PlacementError, match="GPU 0 needs 6144 MiB, has 5120 MiB free"):
        check_named(gpus, [(0, 6 * GIB)])
    with pytest.raises(PlacementError, match="GPU 0 taken"):
        check_named(gpus, [(0, GIB)], mode="exclusive")
    with pytest.raises(PlacementError, match="GPU 5 is not on this node"):
        check_named(gpus, [(5, GIB)])


def test_resolve_a_parsed_request():
    node = node_with(10, 2, 0, 0)
    infos = [g.info for g in node.gpus]
    states = states_from_node(node)
    # the seed's command without a GPU named: binpack puts 6 of 15 on GPU 1 (least free that fits)
    req = parse_env({MEM_CONTAINER: "6", MEM_DEV: "15"}, infos)
    assert resolve(req, states) == [(1, T4 * 6 // 15)]
    assert resolve(req, states, strategy="spread") == [(2, T4 * 6 // 15)]
    assert resolve(req, states, mode="exclusive") == [(2, T4 * 6 // 15)]
    # 8 GiB over 2 GPUs: 4 each on the two least free that fit (GPU 0 has 4869 MiB free)
    req = parse_env({MEM_CONTAINER: "8", COUNT: "2"}, infos)
    assert resolve(req, states) == [(0, 4 * GIB), (1, 4 * GIB)]
    # named: checked, not moved
    req = parse_env({MEM_CONTAINER: "7", VISIBLE: "0", NVIDIA: "all", WEIGHT: "2"}, infos)
    with pytest.raises(PlacementError, match="GPU 0 needs 7168 MiB, has 4869 MiB free"):
        resolve(req, states)
    assert resolve(parse_env({MEM_CONTAINER: "0"}, infos), states) == []
    # the plan is what the model accepts
    req = parse_env({MEM_CONTAINER: "3,4", NVIDIA: "2,3"}, infos)
    for g, m in resolve(req, states):
        node.create_instance(g, NAMES[20], memsize=m, promise=True)
    assert [i.memsize for i in node.instances_named(NAMES[20])] == [3 * GIB, 4 * GIB]


def test_resolve_refuses_a_request_parsed_for_another_unit():
    req = parse_env({MEM_CONTAINER: "16"}, [GpuInfo(0, "GPU-a", "T4", T4)], unit=SHARE_UNIT)
    with pytest.raises(ValueError, match="unit"):
        resolve(req, [gpu(0, 14)], mode="cgpu")
    assert resolve(req, [gpu(0, 14)], mode="share") == [(0, 2 * GIB)]


# ---- properties ------------------------------------------------------------------------------

_states = st.lists(
    st.tuples(st.integers(1, 64), st.integers(0, 64), st.integers(0, 25), st.integers(1, 25)),
    min_size=1, max_size=8,
).map(lambda rows: [
    GpuState(i, mem * GIB // 4, min(free, mem) * GIB // 4, min(inst, mx), mx) for i, (mem, free, inst, mx) in enumerate(rows)
])


@settings(max_examples=500, deadline=None)
@given(
    gpus=_states,
    need=st.one_of(st.integers(0, 17 * GIB), st.builds(Sizing, st.integers(1, 20), st.just(GIB),
                                                        st.one_of(st.none(), st.integers(1, 30)))),
    count=st.integers(1, 4),
    strategy=st.sampled_from(STRATEGIES),
    mode=st.sampled_from(MODES),
    weight=st.integers(1, 25),
)
def test_placement_never_overcommits_and_picks_by_the_rule(gpus, need, count, strategy, mode, weight):
    def bytes_on(g):
        return need.memsize(g.memory) if isinstance(need, Sizing) else need

    def cap(g):  # the SPEC's rule, written out independently of instance_cap
        return {"exclusive": 1, "share": g.max_inst}.get(mode, min(g.max_inst, 16))

    def ok(g):
        return bytes_on(g) <= g.free and g.instances < cap(g) and weight <= g.max_inst

    feasible = [g for g in gpus if ok(g)]
    key = (lambda g: (g.free, g.index)) if strategy == "binpack" else (lambda g: (-g.free, g.index))
    try:
        got = place(gpus, need, count, strategy=strategy, mode=mode, weight=weight)
    except PlacementError as exc:
        assert len(feasible) < count and "\n" not in str(exc)
        return
    by = {g.index: g for g in gpus}
    assert len(got) == count and len({g for g, _ in got}) == count
    for idx, memsize in got:
        g = by[idx]
        assert memsize == bytes_on(g) <= g.free
        assert g.instances < cap(g) and weight <= g.max_inst
        assert g.instances == 0 if mode == "exclusive" else g.instances < (25 if mode == "share" else 16)
    assert [g for g, _ in got] == [g.index for g in sorted(feasible, key=key)[:count]]


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 3)), min_size=1, max_size=30),
    strategy=st.sampled_from(STRATEGIES),
    mode=st.sampled_from(MODES),
)
def test_every_plan_is_accepted_by_the_model(requests, strategy, mode):
    """Placing request after request on a real Node: the model never has to
    refuse a plan (no NoSpace), and a refusal from placement means it did not fit."""
    node = node_with(0, 0, 0, n=3)
    for k, (per, count) in enumerate(requests):
        try:
            plan = place_split(states_from_node(node), Sizing(per * count), count, strategy=strategy, mode=mode)
        except PlacementError:
            fitting = [g for g in node.gpus if g.free_memory >= per * GIB
                       and len(g.instances) < (1 if mode == "exclusive" else 16)]
            assert len(fitting) < count
            continue
        for g, m in plan:
            node.create_instance(g, NAMES[k], memsize=m, promise=True)  # raises NoSpace on an overcommit
        for g in node.gpus:
            assert g.memsize_sum <= g.info.memory
            if mode == "exclusive":
                assert len(g.instances) <= 1
