"""A container's environment read as SPEC §2 says (cgpud.containers.envspec).

Fast tier: parse_env called directly on simulated GPUs. Every row and
example of the SPEC's table, the seed's commands (6 and 8 GiB of 15 on a T4;
3,4,5,6 and 3,1 on four GPUs) and every bad value the issue names.
"""
from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgpud.containers.envspec import (
    COUNT,
    DISABLE,
    HIGH_PRIO,
    MEM_CONTAINER,
    MEM_DEV,
    MEM_IDX,
    MEM_POD,
    NVIDIA,
    VARIABLES,
    VISIBLE,
    WEIGHT,
    EnvError,
    parse_env,
)
from cgpud.gpus.sim import parse_sim
from cgpud.core.model import GpuInfo
from cgpud.containers.request import GIB, SHARE_UNIT, Request, Share, Sizing

MIB = 1 << 20
T4 = 15109 * MIB  # 15 842 934 784 bytes, as nvidia-smi shows a Tesla T4
A10 = 22731 * MIB
UUIDS = [
    "GPU-b084ae33-e244-0959-cd97-830000000000",
    "GPU-3eb465ad-407c-4a23-0c5f-bb0000000000",
    "GPU-2fce61ea-2424-27ec-a2f1-8b0000000000",
    "GPU-22401369-db12-c6ce-fc48-d70000000000",
]


def t4s(n: int = 4, memory: int = T4) -> list[GpuInfo]:
    return [GpuInfo(i, UUIDS[i], "Tesla T4", memory, 243) for i in range(n)]


def parse(n: int = 4, *, max_inst=16, unit=GIB, gpus=None, **env) -> Request:
    return parse_env(env, gpus if gpus is not None else t4s(n), max_inst=max_inst, unit=unit)


def refused(variable: str, n: int = 4, *, max_inst=16, gpus=None, **env) -> str:
    """parse raises EnvError naming `variable`, in one line `VARIABLE=value: why`."""
    with pytest.raises(EnvError) as info:
        parse(n, max_inst=max_inst, gpus=gpus, **env)
    msg = str(info.value)
    assert info.value.variable == variable, msg
    assert msg.startswith(f"{variable}="), msg
    assert "\n" not in msg and "\r" not in msg, msg
    assert info.value.reason and info.value.reason in msg
    return msg


def memsizes(req: Request) -> list[tuple[int, int]]:
    return [(s.gpu, s.memsize) for s in req.shares]


# ---- the seed's single-GPU commands: 6 and 8 GiB of 15 on a T4 ------------------


def test_six_and_eight_of_fifteen_on_a_sim_t4_are_exact_bytes():
    gpus = parse_sim("T4")
    assert gpus[0].memory == 15842934784
    six = parse_env({MEM_CONTAINER: "6", MEM_DEV: "15", NVIDIA: "all"}, gpus)
    eight = parse_env({MEM_CONTAINER: "8", MEM_DEV: "15", NVIDIA: "all"}, gpus)
    # 15109 MiB × 6 / 15 = 6043.6 MiB, 15109 MiB × 8 / 15 = 8058.13 MiB: floor, in bytes
    assert memsizes(six) == [(0, 6337173913)]
    assert memsizes(eight) == [(0, 8449565218)]
    assert 6337173913 == 15842934784 * 6 // 15 and 6043 * MIB < 6337173913 < 6044 * MIB
    assert 8449565218 == 15842934784 * 8 // 15 and 8058 * MIB < 8449565218 < 8059 * MIB
    assert six.managed and six.weight == 1 and not six.policy2 and not six.highprio
    assert six.passthrough == () and six.count == 0


def test_without_dev_memsize_is_container_gib():
    assert memsizes(parse(1, **{MEM_CONTAINER: "6", NVIDIA: "0"})) == [(0, 6 * GIB)]


def test_dev_scales_each_gpu_by_its_own_total():
    gpus = [GpuInfo(0, UUIDS[0], "Tesla T4", T4), GpuInfo(1, UUIDS[1], "NVIDIA A10", A10)]
    req = parse(gpus=gpus, **{MEM_CONTAINER: "3", MEM_DEV: "23", NVIDIA: "all"})
    assert memsizes(req) == [(0, T4 * 3 // 23), (1, A10 * 3 // 23)]


def test_daemon_picks_when_no_gpu_is_named():
    req = parse(**{MEM_CONTAINER: "6", MEM_DEV: "15"})
    assert req.managed and req.shares == () and req.count == 1
    assert req.sizing == Sizing(6, GIB, 15) and req.sizing.memsize(T4) == 6337173913
    req = parse(**{MEM_CONTAINER: "6", NVIDIA: "void"})
    assert req.count == 1 and req.sizing == Sizing(6) and req.gpus == ()


# ---- multi-GPU lists: 3,4,5,6 and 3,1 and 1,0,0 -----------------------------------


def test_seed_four_gpus_3_4_5_6():
    # the seed's own command: -e ALIYUN_COM_GPU_MEM_CONTAINER=3,4,5,6 -e ALIYUN_COM_GPU_MEM_DEV=23
    # -e NVIDIA_VISIBLE_DEVICES=0,1,2,3 (on A10s)
    gpus = [GpuInfo(i, UUIDS[i], "NVIDIA A10", A10) for i in range(4)]
    req = parse(gpus=gpus, **{MEM_CONTAINER: "3,4,5,6", MEM_DEV: "23", NVIDIA: "0,1,2,3"})
    assert memsizes(req) == [(i, A10 * v // 23) for i, v in enumerate((3, 4, 5, 6))]
    assert [s.units for s in req.shares] == [3, 4, 5, 6]
    req = parse(**{MEM_CONTAINER: "3,4,5,6", NVIDIA: "0,1,2,3"})
    assert memsizes(req) == [(0, 3 * GIB), (1, 4 * GIB), (2, 5 * GIB), (3, 6 * GIB)]


@pytest.mark.parametrize("value, expect", [
    ("3", [3, 3, 3, 3]),
    ("3,1", [3, 1, 1, 1]),  # the last value repeats
    ("3,4,5,6", [3, 4, 5, 6]),
    ("3, 4 ,5", [3, 4, 5, 5]),  # spaces around entries are accepted
])
def test_per_gpu_list_last_value_repeats(value, expect):
    req = parse(**{MEM_CONTAINER: value, NVIDIA: "all"})
    assert memsizes(req) == [(i, v * GIB) for i, v in enumerate(expect)]
    assert req.passthrough == ()


def test_one_zero_zero_manages_only_the_first_gpu():
    req = parse(**{MEM_CONTAINER: "1,0,0", NVIDIA: "0,1,2,3"})
    assert memsizes(req) == [(0, GIB)]
    assert req.passthrough == (1, 2, 3)  # 1,0,0 → 1,0,0,0: the zeros are passed through whole
    req = parse(**{MEM_CONTAINER: "0,2", NVIDIA: "all"})
    assert memsizes(req) == [(1, 2 * GIB), (2, 2 * GIB), (3, 2 * GIB)] and req.passthrough == (0,)


@pytest.mark.parametrize("env", [
    {},
    {MEM_CONTAINER: ""},
    {MEM_CONTAINER: "0"},
    {MEM_CONTAINER: "0,0", NVIDIA: "all"},
    {MEM_CONTAINER: " 00 "},
    {MEM_DEV: "15", WEIGHT: "2"},  # the others without MEM_CONTAINER: not managed, and not examined
    {WEIGHT: "lots", VISIBLE: "GPU-nope"},
])
def test_unset_or_zero_is_not_managed(env):
    req = parse(**env)
    assert not req.managed and req.reason
    assert req.shares == () and req.count == 0 and req.sizing is None and req.passthrough == ()


@pytest.mark.parametrize("value", ["true", "1", "TRUE", "True", " true "])
def test_cgpu_disable_wins_over_everything(value):
    req = parse(**{DISABLE: value, MEM_CONTAINER: "6", MEM_DEV: "15"})
    assert not req.managed and DISABLE in req.reason
    # even over values that would be refused: the container is simply left alone
    assert not parse(**{DISABLE: value, MEM_CONTAINER: "letters", WEIGHT: "-3"}).managed


@pytest.mark.parametrize("value", ["false", "0", "False", ""])
def test_cgpu_disable_false_keeps_it_managed(value):
    assert parse(**{DISABLE: value, MEM_CONTAINER: "6"}).managed


def test_cgpu_disable_other_values_refused_only_when_managed():
    msg = refused(DISABLE, **{DISABLE: "yes", MEM_CONTAINER: "6"})
    assert "true, 1, false or 0" in msg
    assert not parse(**{DISABLE: "yes"}).managed


# ---- which GPUs: indices, UUIDs, NVIDIA_VISIBLE_DEVICES, the device plugin ----------


def test_visible_devices_by_index():
    req = parse(**{MEM_CONTAINER: "6", VISIBLE: "0,1"})
    assert memsizes(req) == [(0, 6 * GIB), (1, 6 * GIB)]
    assert req.gpus == (0, 1) and req.passthrough == () and req.count == 0


def test_visible_devices_by_uuid_in_the_order_named():
    req = parse(**{MEM_CONTAINER: "3,5", VISIBLE: f"{UUIDS[2]},{UUIDS[0]}"})
    assert memsizes(req) == [(2, 3 * GIB), (0, 5 * GIB)]  # the list applies in the order named
    req = parse(**{MEM_CONTAINER: "2", VISIBLE: f"{UUIDS[3].upper()}, 1"})  # case, mixed forms
    assert req.gpus == (3, 1)


def test_visible_devices_on_a_sim_node_by_uuid():
    gpus = parse_sim("4xT4")
    req = parse_env({MEM_CONTAINER: "6", MEM_DEV: "15", VISIBLE: f"{gpus[1].uuid},{gpus[3].uuid}"}, gpus)
    assert memsizes(req) == [(1, 6337173913), (3, 6337173913)]


def test_mixed_with_nvidia_only_the_listed_are_shared():
    req = parse(**{MEM_CONTAINER: "4", VISIBLE: "1,3", NVIDIA: "all"})
    assert memsizes(req) == [(1, 4 * GIB), (3, 4 * GIB)] and req.passthrough == (0, 2)
    req = parse(**{MEM_CONTAINER: "4", VISIBLE: "2", NVIDIA: f"0,{UUIDS[2]}"})
    assert memsizes(req) == [(2, 4 * GIB)] and req.passthrough == (0,)


def test_aliyun_gpus_must_be_among_nvidia_ones():
    msg = refused(VISIBLE, **{MEM_CONTAINER: "4", VISIBLE: "2", NVIDIA: "0,1"})
    assert "GPU 2" in msg and NVIDIA in msg
    msg = refused(VISIBLE, **{MEM_CONTAINER: "4", VISIBLE: "0", NVIDIA: "none"})
    assert "none" in msg


def test_nvidia_alone_names_the_shared_gpus():
    assert parse(**{MEM_CONTAINER: "2", NVIDIA: "all"}).gpus == (0, 1, 2, 3)
    assert parse(**{MEM_CONTAINER: "2", NVIDIA: f"{UUIDS[1]},3"}).gpus == (1, 3)
    msg = refused(NVIDIA, **{MEM_CONTAINER: "2", NVIDIA: "none"})
    assert "no GPU" in msg


def test_device_plugin_index_pod_and_dev():
    # what gpushare's Allocate writes: the GPU's UUID, its index, the pod's total, the device total
    req = parse(**{NVIDIA: UUIDS[2], MEM_IDX: "2", MEM_POD: "4", MEM_CONTAINER: "4", MEM_DEV: "15"})
    assert memsizes(req) == [(2, T4 * 4 // 15)]
    assert req.passthrough == () and req.pod_units == 4
    assert parse(**{MEM_IDX: "1", MEM_CONTAINER: "2"}).gpus == (1,)
    assert parse(**{MEM_IDX: "1", VISIBLE: UUIDS[1], MEM_CONTAINER: "2"}).gpus == (1,)


def test_device_plugin_failure_is_reported():
    msg = refused(MEM_IDX, **{MEM_IDX: "-1", NVIDIA: "no-gpu-has-8GiB-to-run", MEM_CONTAINER: "8"})
    assert "no GPU with room" in msg and "no-gpu-has-8GiB-to-run" in msg
    refused(MEM_IDX, **{MEM_IDX: "1", VISIBLE: "2", MEM_CONTAINER: "2"})
    refused(MEM_IDX, **{MEM_IDX: UUIDS[1], MEM_CONTAINER: "2"})  # indices only
    refused(MEM_POD, **{MEM_POD: "four", MEM_CONTAINER: "2"})


# ---- weight, policy 2, high priority ------------------------------------------------


def test_weight_two_sets_the_policy_2_flag():
    req = parse(**{MEM_CONTAINER: "6", NVIDIA: "0", WEIGHT: "2"})
    assert req.weight == 2 and req.policy2
    req = parse(**{MEM_CONTAINER: "6", NVIDIA: "0", WEIGHT: "1"})
    assert req.weight == 1 and not req.policy2
    assert parse(**{MEM_CONTAINER: "6", NVIDIA: "0"}).weight == 1
    assert parse(**{MEM_CONTAINER: "6", NVIDIA: "0", WEIGHT: "16"}).weight == 16  # = max_inst


def test_weight_is_checked_against_each_named_gpus_max_inst():
    assert parse(**{MEM_CONTAINER: "6", NVIDIA: "0", WEIGHT: "20"}, max_inst=20).weight == 20
    msg = refused(WEIGHT, **{MEM_CONTAINER: "6", NVIDIA: "0,1", WEIGHT: "10"}, max_inst=[16, 8, 16, 16])
    assert "max_inst 8 of GPU 1" in msg
    # a GPU passed through (0) has no instance, so its max_inst does not matter
    assert parse(**{MEM_CONTAINER: "6,0", NVIDIA: "0,1", WEIGHT: "10"}, max_inst=[16, 8, 16, 16]).weight == 10
    # the daemon picks: some GPU must allow it
    assert parse(**{MEM_CONTAINER: "6", WEIGHT: "10"}, max_inst=[8, 8, 8, 12]).weight == 10
    refused(WEIGHT, **{MEM_CONTAINER: "6", WEIGHT: "10"}, max_inst=[8, 8, 8, 8])


def test_high_priority():
    assert parse(**{MEM_CONTAINER: "6", HIGH_PRIO: "1"}).highprio
    assert not parse(**{MEM_CONTAINER: "6", HIGH_PRIO: "0"}).highprio
    assert not parse(**{MEM_CONTAINER: "6"}).highprio
    for bad in ("2", "yes", "-1", "true"):
        refused(HIGH_PRIO, **{MEM_CONTAINER: "6", HIGH_PRIO: bad})


# ---- multi-GPU placement requests: N over M ------------------------------------------


def test_count_splits_the_total_over_the_gpus():
    req = parse(**{MEM_CONTAINER: "8", COUNT: "2"})
    assert req.count == 2 and req.sizing == Sizing(4) and req.shares == ()
    req = parse(**{MEM_CONTAINER: "8", COUNT: "2", MEM_DEV: "15"})
    assert req.sizing == Sizing(4, GIB, 15)
    msg = refused(MEM_CONTAINER, **{MEM_CONTAINER: "7", COUNT: "2"})
    assert "not whole" in msg and COUNT in msg
    refused(COUNT, **{MEM_CONTAINER: "8", COUNT: "8"})  # all M GPUs on this node
    refused(COUNT, **{MEM_CONTAINER: "8", COUNT: "0"})
    assert parse(**{MEM_CONTAINER: "8", COUNT: "2", VISIBLE: "0,1"}).gpus == (0, 1)  # agrees: fine
    refused(COUNT, **{MEM_CONTAINER: "8", COUNT: "3", VISIBLE: "0,1"})


def test_share_mode_unit_is_128_mib():
    req = parse(unit=SHARE_UNIT, **{MEM_CONTAINER: "16", NVIDIA: "0"})
    assert memsizes(req) == [(0, 2 * GIB)]  # 16 × 128 MiB, as in the seed
    assert req.unit == SHARE_UNIT
    # with DEV the ratio does not depend on the unit: 118 × 128 MiB ≈ a T4
    req = parse(unit=SHARE_UNIT, **{MEM_CONTAINER: "59", MEM_DEV: "118", NVIDIA: "0"})
    assert memsizes(req) == [(0, T4 * 59 // 118)]
    assert parse(unit=SHARE_UNIT, **{MEM_CONTAINER: "118", NVIDIA: "0"}).shares[0].memsize == 118 * SHARE_UNIT
    with pytest.raises(EnvError, match=r"119 × 128 MiB is more than the 15109 MiB of GPU 0"):
        parse(unit=SHARE_UNIT, **{MEM_CONTAINER: "119", NVIDIA: "0"})


# ---- every bad value: one line naming the variable ------------------------------------


@pytest.mark.parametrize("variable, env, words", [
    (MEM_CONTAINER, {MEM_CONTAINER: "six"}, "not a whole number"),
    (MEM_CONTAINER, {MEM_CONTAINER: "6G"}, "not a whole number"),
    (MEM_CONTAINER, {MEM_CONTAINER: "3.5"}, "not a whole number"),
    (MEM_CONTAINER, {MEM_CONTAINER: "+3"}, "not a whole number"),
    (MEM_CONTAINER, {MEM_CONTAINER: "３"}, "not a whole number"),  # a fullwidth digit
    (MEM_CONTAINER, {MEM_CONTAINER: "-1"}, "negative"),
    (MEM_CONTAINER, {MEM_CONTAINER: "3,-1", NVIDIA: "all"}, "negative"),
    (MEM_CONTAINER, {MEM_CONTAINER: "3,,4", NVIDIA: "all"}, "empty entry"),
    (MEM_CONTAINER, {MEM_CONTAINER: "3,", NVIDIA: "all"}, "empty entry"),
    (MEM_CONTAINER, {MEM_CONTAINER: "9" * 40}, "too large"),
    (MEM_CONTAINER, {MEM_CONTAINER: "1,2,3,4,5", NVIDIA: "all"}, "5 values for the 4 GPUs"),
    (MEM_CONTAINER, {MEM_CONTAINER: "1,2,3", VISIBLE: "0,1"}, "3 values for the 2 GPUs"),
    (MEM_CONTAINER, {MEM_CONTAINER: "3,4"}, "needs GPUs named"),
    (MEM_CONTAINER, {MEM_CONTAINER: "15", NVIDIA: "0"}, "more than the 15109 MiB of GPU 0"),
    (MEM_CONTAINER, {MEM_CONTAINER: "16"}, "more than the 15109 MiB of the largest GPU"),
    (MEM_CONTAINER, {MEM_CONTAINER: "16", MEM_DEV: "15", NVIDIA: "0"}, "more than ALIYUN_COM_GPU_MEM_DEV=15"),
    (MEM_CONTAINER, {MEM_CONTAINER: "3,16", MEM_DEV: "15", NVIDIA: "all"}, "16 GiB is more than"),
    (MEM_DEV, {MEM_CONTAINER: "6", MEM_DEV: "0"}, "cannot be 0"),
    (MEM_DEV, {MEM_CONTAINER: "6", MEM_DEV: "fifteen"}, "not a whole number"),
    (MEM_DEV, {MEM_CONTAINER: "6", MEM_DEV: "-15"}, "negative"),
    (MEM_DEV, {MEM_CONTAINER: "6", MEM_DEV: "15,15"}, "not a whole number"),
    (MEM_DEV, {MEM_CONTAINER: "1", MEM_DEV: "99999999999999", NVIDIA: "0"}, "0 bytes"),
    (WEIGHT, {MEM_CONTAINER: "6", WEIGHT: "two"}, "not a whole number"),
    (WEIGHT, {MEM_CONTAINER: "6", WEIGHT: "-2"}, "negative"),
    (WEIGHT, {MEM_CONTAINER: "6", WEIGHT: "0"}, "below 1"),
    (WEIGHT, {MEM_CONTAINER: "6", WEIGHT: "17", NVIDIA: "0"}, "above max_inst 16 of GPU 0"),
    (WEIGHT, {MEM_CONTAINER: "6", WEIGHT: "26"}, "above 25"),
    (VISIBLE, {MEM_CONTAINER: "6", VISIBLE: "4"}, "no GPU 4 on this node"),
    (VISIBLE, {MEM_CONTAINER: "6", VISIBLE: "GPU-00000000-0000-0000-0000-000000000000"}, "no GPU with UUID"),
    (VISIBLE, {MEM_CONTAINER: "6", VISIBLE: "-1"}, "negative"),
    (VISIBLE, {MEM_CONTAINER: "6", VISIBLE: "first"}, "not a GPU index or UUID"),
    (VISIBLE, {MEM_CONTAINER: "6", VISIBLE: f"1,{UUIDS[1]}"}, "GPU 1 is named twice"),
    (VISIBLE, {MEM_CONTAINER: "6", VISIBLE: "0,,1"}, "empty entry"),
    (NVIDIA, {MEM_CONTAINER: "6", NVIDIA: "7"}, "no GPU 7"),
    (NVIDIA, {MEM_CONTAINER: "6", NVIDIA: "MIG-GPU-0/1/0"}, "not a GPU index or UUID"),
    (NVIDIA, {MEM_CONTAINER: "6", NVIDIA: "0,0"}, "named twice"),
    (MEM_IDX, {MEM_CONTAINER: "6", MEM_IDX: "9"}, "no GPU 9"),
    (COUNT, {MEM_CONTAINER: "6", COUNT: "many"}, "not a whole number"),
])
def test_bad_values(variable, env, words):
    msg = refused(variable, **env)
    assert words in msg, msg


def test_a_control_character_in_a_value_stays_on_one_line():
    msg = refused(VISIBLE, **{MEM_CONTAINER: "6", VISIBLE: "0\n1"})
    assert "\\n" in msg
    msg = refused(MEM_CONTAINER, **{MEM_CONTAINER: "6\r\n7"})
    assert "\\r" in msg


def test_a_node_without_gpus_refuses_managed_containers():
    refused(MEM_CONTAINER, gpus=[], **{MEM_CONTAINER: "6"})
    assert not parse(gpus=[], **{MEM_CONTAINER: "0"}).managed


def test_caller_mistakes_are_not_env_errors():
    with pytest.raises(ValueError, match="max_inst has 2 values for 4 GPUs"):
        parse(max_inst=[16, 16], **{MEM_CONTAINER: "6"})
    with pytest.raises(ValueError, match="unit"):
        parse(unit=0, **{MEM_CONTAINER: "6"})


# ---- properties -----------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 6),
    values=st.lists(st.integers(0, 14), min_size=1, max_size=6),
    dev=st.one_of(st.none(), st.integers(14, 30)),
    data=st.data(),
)
def test_list_rule_and_every_named_gpu_accounted_for(n, values, dev, data):
    named = data.draw(st.permutations(range(n)).flatmap(lambda p: st.integers(1, n).map(lambda k: p[:k])))
    env = {MEM_CONTAINER: ",".join(map(str, values)), VISIBLE: ",".join(map(str, named)), NVIDIA: "all"}
    if dev is not None:
        env[MEM_DEV] = str(dev)
    gpus = [GpuInfo(i, f"GPU-x{i}", "T4", T4) for i in range(n)]
    if not any(values):  # nothing asked: not managed, whatever else is set
        assert not parse_env(env, gpus).managed
        return
    if len(values) > len(named):
        with pytest.raises(EnvError, match=f"{len(values)} values for the {len(named)} GPU"):
            parse_env(env, gpus)
        return
    req = parse_env(env, gpus)
    full = values + [values[-1]] * (len(named) - len(values))
    want = [(g, (T4 * v // dev) if dev else v * GIB) for g, v in zip(named, full) if v]
    if not want:
        assert not req.managed
        return
    assert memsizes(req) == want
    # every GPU is either shared (with one instance) or passed through whole, never both
    assert set(req.gpus) | set(req.passthrough) == set(range(n))
    assert not set(req.gpus) & set(req.passthrough)
    assert list(req.passthrough) == sorted(req.passthrough)
    assert all(isinstance(s, Share) and 0 < s.memsize <= T4 for s in req.shares)


_text = st.text(alphabet=string.printable + "３é\x00-", max_size=12)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(VARIABLES), _text, max_size=len(VARIABLES)))
def test_any_environment_parses_or_is_refused_in_one_line(env):
    """Whatever the values, the parser answers a Request or one EnvError line
    naming one of the variables; never another exception."""
    try:
        req = parse_env(env, t4s(4))
    except EnvError as exc:
        msg = str(exc)
        assert exc.variable in VARIABLES and msg.startswith(exc.variable + "=")
        assert "\n" not in msg and "\r" not in msg
        return
    if req.managed:
        assert (req.shares == ()) != (req.count == 0)
        for s in req.shares:
            assert 0 < s.memsize <= T4
        if req.count:
            assert req.sizing is not None and req.sizing.units > 0
        assert 1 <= req.weight <= 16 and req.policy2 == (req.weight > 1)
