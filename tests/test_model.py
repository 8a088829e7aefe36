"""The model's exact rules (SPEC §1–§4), one example each.

Fast tier: cgpud.core.model.Node and cgpud.state.durable.Durable called directly, no mount.
"""
from __future__ import annotations

import copy
import errno
import json
import os
import subprocess
import uuid

import pytest

from cgpud.state.durable import Durable
from cgpud.core.model import (
    DEFAULT_MAX_INST,
    DEFAULT_PRIO_RATIO,
    Busy,
    Exists,
    GpuInfo,
    InvalidValue,
    ModelError,
    Node,
    NoSpace,
    NotFound,
    OutOfMemory,
)
from cgpud.state.store import Store
from cgpud.core.model import ERRNOS

MIB = 1 << 20
T4 = 15109 * MIB
A = "abcdef012345"
B = "bcdef0123456"
C = "cdef01234567"


def infos(*memories: int) -> list[GpuInfo]:
    return [GpuInfo(i, f"GPU-test-{i}", f"Sim{i}", m, 243) for i, m in enumerate(memories)]


def node(*memories: int) -> Node:
    return Node(infos(*(memories or (T4,))))


def snapshot(n: Node):
    return n.to_state(), {(i.gpu, i.name): dict(i.procs) for i in n.instances()}, n.version


def refused(n: Node, exc: type[ModelError], fn, *args, **kw) -> ModelError:
    """`fn` raises exactly `exc` and leaves the node as it was."""
    before = snapshot(n)
    with pytest.raises(exc) as info:
        fn(*args, **kw)
    assert type(info.value) is exc
    assert snapshot(n) == before
    return info.value


# ---- errno mapping ---------------------------------------------------------


def test_error_classes_map_to_the_spec_errnos():
    assert ERRNOS == {
        InvalidValue: errno.EINVAL,
        Busy: errno.EBUSY,
        NoSpace: errno.ENOSPC,
        Exists: errno.EEXIST,
        NotFound: errno.ENOENT,
        OutOfMemory: errno.ENOMEM,
    }


# ---- defaults --------------------------------------------------------------


def test_a_new_node_has_the_documented_defaults():
    n = node(T4, T4)
    assert n.default_memsize == 0
    for i, g in enumerate(n.gpus):
        assert (g.index, g.policy, g.max_inst, g.prio_ratio) == (i, 0, DEFAULT_MAX_INST, DEFAULT_PRIO_RATIO)
        assert g.max_inst == 16 and g.free_weight == 16 and g.instances == {}


def test_gpu_indices_must_be_in_order():
    with pytest.raises(ValueError):
        Node([GpuInfo(1, "GPU-a", "x", 10)])


# ---- create ----------------------------------------------------------------


def test_default_memsize_zero_gives_the_whole_device():
    n = node(T4)
    inst = n.create_instance(0, A)
    assert inst.memsize == T4 and not inst.promised
    assert n.gpus[0].free_memory == T4  # it promises nothing


def test_default_memsize_is_used_when_no_memsize_is_given():
    n = node(T4)
    n.set_default_memsize(6 * 1024 * MIB)
    assert n.create_instance(0, A).memsize == 6 * 1024 * MIB
    assert n.create_instance(0, B, memsize=123).memsize == 123
    assert n.create_instance(0, C, memsize=0).memsize == 0  # an explicit 0 is 0, not the device


def test_memsizes_overcommit_as_on_the_real_module():
    """SPEC §3: a second whole-device instance is created; memsizes may sum past the device."""
    n = node(T4)
    n.create_instance(0, A)
    n.create_instance(0, B)
    assert n.gpus[0].memsize_sum == 2 * T4 and n.gpus[0].promised_sum == 0


def test_promised_memory_that_does_not_fit_is_nospace():
    n = node(1000)
    n.create_instance(0, A, memsize=600, promise=True)
    refused(n, NoSpace, n.create_instance, 0, B, memsize=401, promise=True)
    assert n.create_instance(0, B, memsize=400, promise=True).memsize == 400  # exactly full is fine
    refused(n, NoSpace, n.create_instance, 0, C, memsize=1, promise=True)
    assert n.create_instance(0, C, memsize=1000).memsize == 1000  # promising nothing, it still may be made


def test_unpromised_instances_do_not_take_from_promises():
    n = node(1000)
    n.create_instance(0, A)  # the whole device, no promise
    assert n.create_instance(0, B, memsize=1000, promise=True).promised


def test_a_memsize_past_the_device_is_nospace_on_create():
    # e.g. a node with a T4 and a V100 and a default sized for the V100
    n = node(1000, 2000)
    n.set_default_memsize(1500)
    refused(n, NoSpace, n.create_instance, 0, A)
    refused(n, NoSpace, n.create_instance, 0, A, memsize=1001)
    assert n.create_instance(1, A).memsize == 1500


def test_create_at_max_inst_is_nospace():
    n = node(1000)
    n.set_max_inst(0, 2)
    n.create_instance(0, A, memsize=1)
    n.create_instance(0, B, memsize=1)
    err = refused(n, NoSpace, n.create_instance, 0, C, memsize=1)
    assert "max_inst" in str(err)


def test_same_name_on_same_gpu_is_exists_but_other_gpu_is_fine():
    n = node(1000, 1000)
    n.create_instance(0, A, memsize=10)
    refused(n, Exists, n.create_instance, 0, A, memsize=10)
    inst = n.create_instance(1, A, memsize=10)
    assert inst.gpu == 1 and [i.gpu for i in n.instances_named(A)] == [0, 1]


def test_exists_is_checked_before_max_inst():
    n = node(1000)
    n.set_max_inst(0, 1)
    n.create_instance(0, A, memsize=10)
    refused(n, Exists, n.create_instance, 0, A, memsize=10)


def test_create_on_a_missing_gpu_is_notfound():
    n = node(1000)
    refused(n, NotFound, n.create_instance, 1, A, memsize=1)
    refused(n, NotFound, n.create_instance, -1, A, memsize=1)


def test_weight_granted_is_min_of_requested_and_free_weight():
    n = node(1000)
    n.set_max_inst(0, 4)
    assert n.create_instance(0, A, memsize=1, weight=3).weight == 3
    assert n.create_instance(0, B, memsize=1, weight=3).weight == 1  # only 1 left
    assert n.gpus[0].free_weight == 0
    assert n.create_instance(0, C, memsize=1).weight == 0  # none left: weight 0, no compute
    assert n.gpus[0].weight_sum == 4


def test_default_weight_is_one():
    n = node(1000)
    assert n.create_instance(0, A, memsize=1).weight == 1
    assert n.gpus[0].free_weight == DEFAULT_MAX_INST - 1


def test_requested_weight_above_max_inst_is_invalid():
    n = node(1000)
    n.set_max_inst(0, 4)
    refused(n, InvalidValue, n.create_instance, 0, A, memsize=1, weight=5)
    refused(n, InvalidValue, n.create_instance, 0, A, memsize=1, weight=-1)


def test_ids_are_unique_across_gpus_and_reused_after_destroy():
    n = node(1000, 1000)
    a0 = n.create_instance(0, A, memsize=1)
    a1 = n.create_instance(1, A, memsize=1)
    b0 = n.create_instance(0, B, memsize=1)
    assert sorted([a0.id, a1.id, b0.id]) == [1, 2, 3]
    n.destroy(A)
    assert n.create_instance(1, C, memsize=1).id == 1  # the smallest free minor


def test_version_moves_when_directories_appear_or_go():
    n = node(1000)
    v = n.version
    n.create_instance(0, A, memsize=1)
    assert n.version > v
    v = n.version
    n.set_weight(0, A, 2)
    n.set_policy(0, 3)
    assert n.version == v  # settings do not change the listing
    n.destroy(A)
    assert n.version > v


# ---- names -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["abcdef012345", "ABCDEF-_.xyz", "............", "0123456789ab", "a_b-c.d_E-F."])
def test_valid_names(name):
    n = node(1000)
    assert n.create_instance(0, name, memsize=1).name == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "abcdef01234",  # 11
        "abcdef0123456",  # 13
        "abcdef 12345",
        "abcdef/12345",
        "abcdef\n12345",
        "abcdef01234\n",
        "abcdéf012345",  # non-ASCII letter
        "abcdef01234٣",  # non-ASCII digit
        "abcdef:12345",
        "abcdef\x0012345",
        b"abcdef012345",
        None,
    ],
)
def test_invalid_names_are_invalid_and_change_nothing(name):
    n = node(1000)
    n.create_instance(0, A, memsize=1)
    refused(n, InvalidValue, n.create_instance, 0, name, memsize=1)
    refused(n, InvalidValue, n.destroy, name)


# ---- destroy ---------------------------------------------------------------


def test_destroy_removes_the_name_on_every_gpu_and_only_it():
    n = node(1000, 1000, 1000)
    n.create_instance(0, A, memsize=1)
    n.create_instance(2, A, memsize=1)
    n.create_instance(1, B, memsize=1)
    gone = n.destroy(A)
    assert sorted(i.gpu for i in gone) == [0, 2]
    assert n.instances_named(A) == []
    assert [i.name for i in n.instances()] == [B]
    assert n.gpus[0].free_weight == DEFAULT_MAX_INST and n.gpus[0].free_memory == 1000


def test_destroy_unknown_name_is_notfound():
    n = node(1000)
    n.create_instance(0, A, memsize=1)
    refused(n, NotFound, n.destroy, B)


# ---- settings --------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, 2, 3, 4, 5])
def test_policy_accepts_0_to_5(value):
    n = node(1000)
    n.set_policy(0, value)
    assert n.gpus[0].policy == value


@pytest.mark.parametrize("value", [-1, 6, 10, True, "2", 2.0, None])
def test_policy_refuses_the_rest(value):
    n = node(1000)
    refused(n, InvalidValue, n.set_policy, 0, value)


def test_settings_on_a_missing_gpu_are_notfound():
    n = node(1000)
    refused(n, NotFound, n.set_policy, 1, 0)
    refused(n, NotFound, n.set_max_inst, 1, 4)
    refused(n, NotFound, n.set_prio_ratio, 1, 50)
    refused(n, NotFound, n.set_policy, True, 0)


@pytest.mark.parametrize("value,ok", [(0, False), (1, True), (25, True), (26, False), (-3, False)])
def test_max_inst_range(value, ok):
    n = node(1000)
    if ok:
        n.set_max_inst(0, value)
        assert n.gpus[0].max_inst == value and n.gpus[0].free_weight == value
    else:
        refused(n, InvalidValue, n.set_max_inst, 0, value)


def test_max_inst_below_instance_count_is_busy():
    n = node(1000)
    for name in (A, B, C):
        n.create_instance(0, name, memsize=1, weight=0)
    err = refused(n, Busy, n.set_max_inst, 0, 2)
    assert "3 instances" in str(err)
    n.set_max_inst(0, 3)  # equal is fine
    assert n.gpus[0].max_inst == 3


def test_max_inst_below_weight_sum_is_busy():
    n = node(1000)
    n.create_instance(0, A, memsize=1, weight=5)
    n.create_instance(0, B, memsize=1, weight=3)
    refused(n, Busy, n.set_max_inst, 0, 7)
    n.set_max_inst(0, 8)
    assert n.gpus[0].free_weight == 0


@pytest.mark.parametrize("value,ok", [(19, False), (20, True), (99, True), (100, False)])
def test_prio_ratio_range(value, ok):
    n = node(1000)
    if ok:
        n.set_prio_ratio(0, value)
        assert n.gpus[0].prio_ratio == value
    else:
        refused(n, InvalidValue, n.set_prio_ratio, 0, value)


def test_weight_above_free_weight_is_busy():
    n = node(1000)
    n.set_max_inst(0, 4)
    n.create_instance(0, A, memsize=1, weight=2)
    n.create_instance(0, B, memsize=1, weight=1)
    refused(n, Busy, n.set_weight, 0, B, 3)  # 2 + 3 > 4
    n.set_weight(0, B, 2)  # 2 + 2 == 4: its own weight counts as free
    assert n.gpus[0].free_weight == 0
    n.set_weight(0, A, 0)
    assert n.gpus[0].free_weight == 2


def test_weight_outside_0_to_max_inst_is_invalid():
    n = node(1000)
    n.set_max_inst(0, 4)
    n.create_instance(0, A, memsize=1)
    refused(n, InvalidValue, n.set_weight, 0, A, 5)
    refused(n, InvalidValue, n.set_weight, 0, A, -1)
    refused(n, InvalidValue, n.set_weight, 0, A, "2")


def test_instance_settings_on_a_missing_instance_are_notfound():
    n = node(1000)
    n.create_instance(0, A, memsize=1)
    refused(n, NotFound, n.set_weight, 0, B, 1)
    refused(n, NotFound, n.set_memsize, 0, B, 1)
    refused(n, NotFound, n.set_highprio, 0, B, 1)
    refused(n, NotFound, n.alloc, 0, B, 1, 1)
    refused(n, NotFound, n.set_weight, 1, A, 1)


def test_highprio_accepts_0_1_and_bools_only():
    n = node(1000)
    n.create_instance(0, A, memsize=1)
    n.set_highprio(0, A, 1)
    assert n.instance(0, A).highprio is True
    n.set_highprio(0, A, False)
    assert n.instance(0, A).highprio is False
    for bad in (2, -1, "1", "x", 1.0, None):
        refused(n, InvalidValue, n.set_highprio, 0, A, bad)


def test_memsize_below_used_is_busy():
    n = node(1000)
    n.create_instance(0, A, memsize=500)
    n.alloc(0, A, 42, 300)
    err = refused(n, Busy, n.set_memsize, 0, A, 299)
    assert "300" in str(err)
    n.set_memsize(0, A, 300)
    assert n.instance(0, A).free == 0


def test_memsize_writes_keep_promises_and_the_device():
    n = node(1000)
    n.create_instance(0, A, memsize=600, promise=True)
    n.create_instance(0, B, memsize=300, promise=True)
    n.create_instance(0, C, memsize=900)  # overcommitted, promising nothing
    refused(n, Busy, n.set_memsize, 0, B, 401)  # 600 + 401 promised > 1000
    refused(n, InvalidValue, n.set_memsize, 0, C, 1001)  # one memsize past the device: EINVAL (SPEC §3)
    refused(n, InvalidValue, n.set_memsize, 0, B, 10**14)  # past what the file takes
    refused(n, InvalidValue, n.set_memsize, 0, B, -1)
    n.set_memsize(0, B, 400)
    n.set_memsize(0, C, 1000)  # not promised: may overcommit
    assert n.gpus[0].free_memory == 0 and n.gpus[0].memsize_sum == 2000


def test_memory_held_never_passes_the_device():
    """Memsizes overcommit; what processes hold cannot: past the device is out of memory."""
    n = node(1000)
    n.create_instance(0, A)
    n.create_instance(0, B)
    n.alloc(0, A, 1, 700)
    refused(n, OutOfMemory, n.alloc, 0, B, 2, 301)
    n.alloc(0, B, 2, 300)
    assert n.gpus[0].used == 1000


def test_a_state_from_before_overcommit_keeps_its_memsizes_promised():
    n = node(1000)
    state = n.to_state()
    state["gpus"][0]["instances"] = [{"name": A, "id": 1, "memsize": 600, "weight": 1, "highprio": False}]
    n.load_state(state)
    assert n.instance(0, A).promised
    refused(n, NoSpace, n.create_instance, 0, B, memsize=401, promise=True)


def test_default_memsize_range():
    n = node(1000)
    n.set_default_memsize(10**14 - 1)
    assert n.default_memsize == 10**14 - 1
    refused(n, InvalidValue, n.set_default_memsize, 10**14)
    refused(n, InvalidValue, n.set_default_memsize, -1)
    n.set_default_memsize(0)
    assert n.default_memsize == 0


# ---- process memory --------------------------------------------------------


def test_alloc_up_to_memsize_then_out_of_memory():
    n = node(1000)
    n.create_instance(0, A, memsize=100)
    n.alloc(0, A, 1, 60)
    n.alloc(0, A, 2, 40)
    refused(n, OutOfMemory, n.alloc, 0, A, 1, 1)
    inst = n.instance(0, A)
    assert inst.used == 100 and inst.free == 0 and inst.procs == {1: 60, 2: 40}


def test_alloc_refuses_negative_or_non_integer_sizes():
    n = node(1000)
    n.create_instance(0, A, memsize=100)
    for bad in (-1, 1.5, "1", True):
        refused(n, InvalidValue, n.alloc, 0, A, 1, bad)


def test_free_part_all_and_unknown_pid():
    n = node(1000)
    n.create_instance(0, A, memsize=100)
    n.alloc(0, A, 1, 60)
    n.free(0, A, 1, 20)
    assert n.instance(0, A).procs == {1: 40}
    n.free(0, A, 1, 1000)  # more than held: all of it
    assert n.instance(0, A).procs == {}
    n.alloc(0, A, 1, 10)
    n.free(0, A, 1)
    n.free(0, A, 99)  # holds nothing: nothing to do
    assert n.instance(0, A).procs == {}


def test_free_refuses_negative_sizes():
    n = node(1000)
    n.create_instance(0, A, memsize=100)
    n.alloc(0, A, 1, 60)
    refused(n, InvalidValue, n.free, 0, A, 1, -50)
    refused(n, InvalidValue, n.free, 0, A, 7, -50)
    assert n.instance(0, A).used == 60


def test_drop_process_frees_it_everywhere():
    n = node(1000, 1000)
    n.create_instance(0, A, memsize=100)
    n.create_instance(1, A, memsize=100)
    n.alloc(0, A, 5, 10)
    n.alloc(1, A, 5, 20)
    n.alloc(1, A, 6, 30)
    n.drop_process(5)
    assert n.instance(0, A).procs == {} and n.instance(1, A).procs == {6: 30}


# ---- state -----------------------------------------------------------------


def populated() -> Node:
    n = node(1000, 2000)
    n.set_default_memsize(300)
    n.set_policy(0, 2)
    n.set_max_inst(1, 5)
    n.set_prio_ratio(1, 33)
    n.create_instance(0, A, weight=4, highprio=True)
    n.create_instance(1, A, memsize=700)
    n.create_instance(1, B, memsize=0, weight=3)
    n.destroy(A)
    n.create_instance(0, C, memsize=10)  # takes id 1 again
    n.create_instance(1, A, memsize=5, weight=2)
    return n


def test_state_round_trips_through_json_into_a_fresh_node():
    n = populated()
    state = json.loads(json.dumps(n.to_state()))
    fresh = Node([g.info for g in n.gpus])
    fresh.load_state(state)
    assert fresh.to_state() == n.to_state()
    for i in n.instances():
        j = fresh.instance(i.gpu, i.name)
        assert (j.id, j.memsize, j.weight, j.highprio) == (i.id, i.memsize, i.weight, i.highprio)


def test_load_state_keeps_memory_held_by_live_processes():
    n = populated()
    n.alloc(1, B, 9, 0)
    n.alloc(1, A, 9, 5)
    state = n.to_state()
    n.set_weight(1, A, 0)
    n.load_state(state)
    assert n.instance(1, A).procs == {9: 5} and n.instance(1, A).weight == 2


def _bad_states(n: Node):
    """(why, state): `n`'s own state with one thing wrong."""
    good = n.to_state()

    def variant(fn):
        s = copy.deepcopy(good)
        fn(s["gpus"][0], s["gpus"][1], s)
        return s

    def first(gs: dict, **fields) -> None:
        gs["instances"][0].update(fields)

    def more_instances_than_max_inst(g0, g1, s):
        g1["max_inst"] = 1
        for i in g1["instances"]:
            i["weight"] = 0

    yield "other uuid", variant(lambda g0, g1, s: g1.update(uuid="GPU-" + str(uuid.uuid4())))
    yield "fewer gpus", variant(lambda g0, g1, s: s["gpus"].pop())
    yield "duplicate id", variant(lambda g0, g1, s: first(g1, id=g0["instances"][0]["id"]))
    yield "over weight", variant(lambda g0, g1, s: first(g1, weight=5))
    yield "max_inst below count", variant(more_instances_than_max_inst)
    yield "over memory", variant(lambda g0, g1, s: first(g0, memsize=1001))
    yield "bad name", variant(lambda g0, g1, s: first(g0, name="short"))
    yield "duplicate name", variant(lambda g0, g1, s: g1["instances"].append(dict(g1["instances"][0], id=77)))
    yield "bad policy", variant(lambda g0, g1, s: g0.update(policy=9))
    yield "missing field", variant(lambda g0, g1, s: g0.pop("prio_ratio"))
    yield "wrong type", variant(lambda g0, g1, s: s.update(gpus=3))
    yield "id zero", variant(lambda g0, g1, s: first(g0, id=0))
    yield "not a dict", []


def test_load_state_rejects_inconsistent_states_and_changes_nothing():
    n = populated()
    n.alloc(1, A, 3, 4)
    for why, bad in _bad_states(n):
        before = snapshot(n)
        with pytest.raises(InvalidValue):
            n.load_state(bad)
        assert snapshot(n) == before, why


def test_load_state_message_names_the_gpus():
    n = node(1000)
    s = n.to_state()
    s["gpus"][0]["uuid"] = "GPU-elsewhere"
    with pytest.raises(InvalidValue, match="GPU-elsewhere"):
        n.load_state(s)


# ---- durability: a save that fails for real --------------------------------


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 64 KiB tmpfs (we run as root): a full disk, for real."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)  # something still open: detach anyway
            pytest.fail(f"{mnt} was still in use at teardown")


@pytest.fixture
def tiny_store(tiny_fs):
    store = Store(str(tiny_fs / "state"))
    yield store
    store.close()


def fill(directory) -> None:
    fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as info:
            while True:
                os.write(fd, b"\0" * 4096)
        assert info.value.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_durable_apply_rolls_back_when_the_disk_is_full(tiny_fs, tiny_store):
    store = tiny_store
    n = node(1000, 1000)
    d = Durable(n, store)
    d.apply(lambda n: n.create_instance(0, A, memsize=100))
    d.apply(lambda n: n.create_instance(1, A, memsize=100))
    d.apply(lambda n: n.set_policy(0, 2))
    n.alloc(0, A, 7, 50)  # a live process holds memory (not part of the state)
    on_disk = store.load()
    assert on_disk == n.to_state()

    fill(tiny_fs)
    before = snapshot(n)
    changes = [
        lambda n: n.create_instance(0, B, memsize=100, weight=3),
        lambda n: n.destroy(A),
        lambda n: n.set_policy(0, 4),
        lambda n: n.set_max_inst(1, 3),
        lambda n: n.set_weight(0, A, 5),
        lambda n: n.set_memsize(0, A, 60),
        lambda n: n.set_default_memsize(5),
    ]
    for change in changes:
        with pytest.raises(OSError) as info:
            d.apply(change)
        assert info.value.errno == errno.ENOSPC
        assert snapshot(n)[:2] == before[:2]  # settings, instances and process memory as they were
        assert store.load() == on_disk  # the old state is intact on disk
        assert sorted(os.listdir(store.directory)) == ["state.json"]  # no .tmp left behind

    # a change that changes nothing needs no save and succeeds on a full disk
    assert d.apply(lambda n: n.set_policy(0, 2)) is None
    # room again: the same change goes through and is on disk
    os.unlink(tiny_fs / "filler")
    d.apply(lambda n: n.destroy(A))
    assert store.load() == n.to_state() and list(n.instances()) == []


def test_durable_apply_passes_model_errors_and_saves_nothing(tmp_path):
    store = Store(str(tmp_path / "s"))
    n = node(1000)
    d = Durable(n, store)
    try:
        with pytest.raises(NoSpace):
            d.apply(lambda n: n.create_instance(0, A, memsize=2000))
        assert store.load() is None
        d.apply(lambda n: n.create_instance(0, A, memsize=10))
        assert store.load() == n.to_state()
    finally:
        store.close()
