"""The model under random sequences of operations (SPEC §4).

A hypothesis state machine drives cgpud.core.model.Node on three small simulated
GPUs. Before each operation the test works out, from the node as it is, which
refusals the rules allow (several may apply at once: the model may report any
of them); the operation must then either succeed, doing exactly what it says,
or raise one of those errors and change nothing at all (settings, instances,
process memory and the directory version).

After every step every invariant of SPEC §4 is checked.
"""
from __future__ import annotations

import json

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cgpud.core.model import (
    MAX_INST,
    MEMSIZE_MAX_DIGITS,
    NAME_RE,
    POLICIES,
    PRIO_RATIO,
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

MEMORIES = (1000, 1500, 700)
INFOS = [GpuInfo(i, f"GPU-sm-{i}", f"Sim{i}", m, 243) for i, m in enumerate(MEMORIES)]
VALID = ["abcdef012345", "ABC-def_.789", "000000000000", "zzzzzzzzzzzz"]
INVALID = ["short", "abcdef0123456", "abc def01234", "abcdéf012345"]
MEM_MAX = 10**MEMSIZE_MAX_DIGITS - 1

# mostly values that work, so that instances pile up and limits are reached
existing_gpus = st.integers(0, len(MEMORIES) - 1)
gpus = st.one_of(existing_gpus, existing_gpus, existing_gpus, st.sampled_from([-1, len(MEMORIES)]))
valid_names = st.sampled_from(VALID)
names = st.one_of(valid_names, valid_names, valid_names, st.sampled_from(INVALID))
memsizes = st.one_of(
    st.integers(0, 400),
    st.integers(0, 400),
    st.integers(-5, 1600),
    st.sampled_from([0, 350, 500, 700, 1000, 1500, MEM_MAX + 1]),
)
weights = st.one_of(st.integers(0, 4), st.integers(0, 4), st.integers(-1, MAX_INST[1] + 1))
pids = st.integers(1, 4)


def snapshot(n: Node):
    return (
        json.dumps(n.to_state(), sort_keys=True),
        sorted((i.gpu, i.name, sorted(i.procs.items())) for i in n.instances()),
        n.version,
    )


class NodeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.node = Node(INFOS)
        self.keys = set()
        self.version = self.node.version

    # ---- the one place that runs an operation ------------------------------

    def attempt(self, allowed: set[type], fn, *args, **kw):
        """Run fn. `allowed` are the refusals the rules permit now; with none,
        it must succeed. A refusal must change nothing."""
        before = snapshot(self.node)
        try:
            result = fn(*args, **kw)
        except ModelError as exc:
            assert type(exc) in allowed, f"{fn.__name__}{args}{kw}: {type(exc).__name__}({exc}) not in {allowed}"
            assert snapshot(self.node) == before, f"{fn.__name__}{args}{kw} was refused but changed the node"
            return exc
        assert not allowed, f"{fn.__name__}{args}{kw} succeeded; expected one of {allowed}"
        return result

    def refused(self, result) -> bool:
        return isinstance(result, ModelError)

    # ---- instances ---------------------------------------------------------

    @initialize(
        max_inst=st.lists(st.integers(1, 6) | st.just(16), min_size=len(MEMORIES), max_size=len(MEMORIES)),
        creates=st.lists(
            st.tuples(existing_gpus, valid_names, st.integers(0, 300), st.integers(0, 4)), max_size=10
        ),
    )
    def populate(self, max_inst, creates):
        """Start most runs from a node that already holds instances near its limits."""
        for gpu, value in enumerate(max_inst):
            self.set_max_inst(gpu, value)
        for gpu, name, memsize, weight in creates:
            self.create_instance(gpu, name, memsize, weight, False, True)

    @rule(gpu=gpus, name=names, memsize=st.none() | memsizes, weight=weights, highprio=st.booleans(),
          promise=st.booleans())
    def create_instance(self, gpu, name, memsize, weight, highprio, promise=False):
        n = self.node
        allowed: set[type] = set()
        if not NAME_RE.match(name):
            allowed.add(InvalidValue)
        if not 0 <= gpu < len(n.gpus):
            allowed.add(NotFound)
            g = None
        else:
            g = n.gpus[gpu]
        want_mem = memsize if memsize is not None else (n.default_memsize or (g.info.memory if g else 0))
        if g is not None:
            if name in g.instances:
                allowed.add(Exists)
            if len(g.instances) >= g.max_inst:
                allowed.add(NoSpace)
            if not 0 <= want_mem <= MEM_MAX:
                allowed.add(InvalidValue)
            elif want_mem > g.info.memory or (promise and want_mem > g.free_memory):
                allowed.add(NoSpace)  # past the device, or past what is not promised yet (SPEC §3)
            if not 0 <= weight <= g.max_inst:
                allowed.add(InvalidValue)
            free_weight = g.free_weight
            expected_id = min(set(range(1, 100)) - {i.id for i in n.instances()})
        result = self.attempt(allowed, n.create_instance, gpu, name, memsize=memsize, weight=weight, highprio=highprio,
                              promise=promise)
        if self.refused(result):
            return
        assert result is n.instance(gpu, name)
        assert (result.gpu, result.name, result.memsize, result.highprio) == (gpu, name, want_mem, highprio)
        assert result.promised == promise
        assert result.weight == min(weight, free_weight), "granted weight is min(requested, free_weight)"
        assert result.id == expected_id, "a new instance takes the smallest free id"
        assert result.procs == {}

    @rule(gpu=existing_gpus, name=valid_names, memsize=st.integers(0, 300), weight=st.integers(0, 4),
          promise=st.booleans())
    def create_likely(self, gpu, name, memsize, weight, promise):
        self.create_instance(gpu, name, memsize, weight, False, promise)

    @rule(data=st.data())
    def destroy(self, data):
        _, name = self.target(data)
        n = self.node
        allowed = self._name_errors(name)
        where = sorted(i.gpu for i in n.instances_named(name)) if NAME_RE.match(name) else []
        others = snapshot_without(n, name)
        result = self.attempt(allowed, n.destroy, name)
        if self.refused(result):
            return
        assert sorted(i.gpu for i in result) == where
        assert n.instances_named(name) == []
        assert snapshot_without(n, name) == others, "destroy touched another instance"

    @rule(
        data=st.data(),
        where=st.sampled_from(
            [None, {"kind": "pgid", "pgid": 5}, {"kind": "cgroup2", "path": "/sys/fs/cgroup/c1"}, {"pgid": 3}, "x"]
        ),
    )
    def attach(self, data, where):
        _, name = self.target(data)
        n = self.node
        allowed = self._name_errors(name)
        if where is not None and not (isinstance(where, dict) and isinstance(where.get("kind"), str)):
            allowed.add(InvalidValue)
        if not self.refused(self.attempt(allowed, n.attach, name, where)):
            assert all(i.target == where for i in n.instances_named(name))

    # ---- per-GPU settings --------------------------------------------------

    @rule(gpu=gpus, value=st.integers(-1, 7))
    def set_policy(self, gpu, value):
        allowed = self._gpu_errors(gpu)
        if value not in POLICIES:
            allowed.add(InvalidValue)
        if not self.refused(self.attempt(allowed, self.node.set_policy, gpu, value)):
            assert self.node.gpus[gpu].policy == value

    @rule(gpu=gpus, value=st.integers(-1, MAX_INST[1] + 2) | st.integers(1, 4))
    def set_max_inst(self, gpu, value):
        allowed = self._gpu_errors(gpu)
        if not MAX_INST[0] <= value <= MAX_INST[1]:
            allowed.add(InvalidValue)
        if not allowed:
            g = self.node.gpus[gpu]
            if value < len(g.instances) or value < g.weight_sum:
                allowed.add(Busy)
        if not self.refused(self.attempt(allowed, self.node.set_max_inst, gpu, value)):
            assert self.node.gpus[gpu].max_inst == value

    @rule(gpu=gpus, value=st.integers(PRIO_RATIO[0] - 2, PRIO_RATIO[1] + 2))
    def set_prio_ratio(self, gpu, value):
        allowed = self._gpu_errors(gpu)
        if not PRIO_RATIO[0] <= value <= PRIO_RATIO[1]:
            allowed.add(InvalidValue)
        if not self.refused(self.attempt(allowed, self.node.set_prio_ratio, gpu, value)):
            assert self.node.gpus[gpu].prio_ratio == value

    @rule(value=st.sampled_from([0, 1, 100, 300, 700, 1000, 1500, 2000, MEM_MAX, MEM_MAX + 1, -1]))
    def set_default_memsize(self, value):
        allowed = set() if 0 <= value <= MEM_MAX else {InvalidValue}
        if not self.refused(self.attempt(allowed, self.node.set_default_memsize, value)):
            assert self.node.default_memsize == value

    # ---- per-instance settings ---------------------------------------------

    @rule(data=st.data(), value=weights)
    def set_weight(self, data, value):
        gpu, name = self.target(data)
        self.do_set_weight(gpu, name, value)

    def do_set_weight(self, gpu, name, value):
        allowed, g, inst = self._inst_errors(gpu, name)
        if g is not None and not 0 <= value <= g.max_inst:
            allowed.add(InvalidValue)
        if not allowed and g.weight_sum - inst.weight + value > g.max_inst:
            allowed.add(Busy)
        if not self.refused(self.attempt(allowed, self.node.set_weight, gpu, name, value)):
            assert self.node.instance(gpu, name).weight == value

    @rule(data=st.data(), value=st.sampled_from([0, 1, True, False, 2, -1]))
    def set_highprio(self, data, value):
        gpu, name = self.target(data)
        self.do_set_highprio(gpu, name, value)

    def do_set_highprio(self, gpu, name, value):
        allowed, _, _ = self._inst_errors(gpu, name)
        if value not in (0, 1):
            allowed.add(InvalidValue)
        if not self.refused(self.attempt(allowed, self.node.set_highprio, gpu, name, value)):
            assert self.node.instance(gpu, name).highprio is bool(value)

    @rule(data=st.data(), value=memsizes)
    def set_memsize(self, data, value):
        gpu, name = self.target(data)
        self.do_set_memsize(gpu, name, value)

    def do_set_memsize(self, gpu, name, value):
        allowed, g, inst = self._inst_errors(gpu, name)
        if g is not None and not 0 <= value <= MEM_MAX:
            allowed.add(InvalidValue)
        if g is not None and value > g.info.memory:
            allowed.add(InvalidValue)  # one memsize past the device (SPEC §3)
        if not allowed:
            if (inst.promised and g.promised_sum - inst.memsize + value > g.info.memory) or value < inst.used:
                allowed.add(Busy)
        if not self.refused(self.attempt(allowed, self.node.set_memsize, gpu, name, value)):
            assert self.node.instance(gpu, name).memsize == value

    # ---- the same operations aimed at the edge of each limit ---------------

    def existing(self, data):
        return data.draw(st.sampled_from(sorted((i.gpu, i.name) for i in self.node.instances())))

    def has_instances(self) -> bool:
        return any(g.instances for g in self.node.gpus)

    @precondition(has_instances)
    @rule(data=st.data(), d=st.integers(-2, 2))
    def set_weight_at_the_limit(self, data, d):
        gpu, name = self.existing(data)
        inst = self.node.instance(gpu, name)
        self.do_set_weight(gpu, name, inst.weight + self.node.gpus[gpu].free_weight + d)

    @precondition(has_instances)
    @rule(data=st.data(), d=st.integers(-2, 2))
    def set_memsize_at_the_limit(self, data, d):
        gpu, name = self.existing(data)
        inst = self.node.instance(gpu, name)
        self.do_set_memsize(gpu, name, inst.memsize + self.node.gpus[gpu].free_memory + d)

    @precondition(lambda self: any(i.used for i in self.node.instances()))
    @rule(data=st.data())
    def set_memsize_near_used(self, data):
        gpu, name = data.draw(st.sampled_from(sorted((i.gpu, i.name) for i in self.node.instances() if i.used)))
        used = self.node.instance(gpu, name).used
        self.do_set_memsize(gpu, name, data.draw(st.integers(max(0, used - 3), used + 1)))

    @precondition(has_instances)
    @rule(data=st.data(), pid=pids, d=st.integers(-2, 2))
    def alloc_at_the_limit(self, data, pid, d):
        gpu, name = self.existing(data)
        self.do_alloc(gpu, name, pid, max(0, self.node.instance(gpu, name).free + d))

    @rule(gpu=existing_gpus, count=st.booleans(), d=st.integers(-2, 1))
    def set_max_inst_at_the_limit(self, gpu, count, d):
        g = self.node.gpus[gpu]
        self.set_max_inst(gpu, (len(g.instances) if count else g.weight_sum) + d)

    @precondition(lambda self: any(len(g.instances) >= g.max_inst for g in self.node.gpus))
    @rule(data=st.data(), name=valid_names, weight=st.integers(0, 2))
    def create_on_a_full_gpu(self, data, name, weight):
        gpu = data.draw(st.sampled_from([g.index for g in self.node.gpus if len(g.instances) >= g.max_inst]))
        self.create_instance(gpu, name, 0, weight, False)

    @precondition(lambda self: any(i.procs for i in self.node.instances()))
    @rule(data=st.data())
    def free_part(self, data):
        gpu, name, pid = data.draw(
            st.sampled_from(sorted((i.gpu, i.name, pid) for i in self.node.instances() for pid in i.procs))
        )
        held = self.node.instance(gpu, name).procs[pid]
        self.do_free(gpu, name, pid, data.draw(st.integers(-2, held + 1)))

    # ---- process memory ----------------------------------------------------

    @rule(data=st.data(), pid=pids, nbytes=st.one_of(st.integers(0, 200), st.integers(-1, 600)))
    def alloc(self, data, pid, nbytes):
        gpu, name = self.target(data)
        self.do_alloc(gpu, name, pid, nbytes)

    def do_alloc(self, gpu, name, pid, nbytes):
        allowed, _, inst = self._inst_errors(gpu, name)
        if nbytes < 0:
            allowed.add(InvalidValue)
        elif inst is not None and (inst.used + nbytes > inst.memsize
                                   or self.node.gpus[gpu].used + nbytes > self.node.gpus[gpu].info.memory):
            allowed.add(OutOfMemory)  # past its memsize, or past the device (memsizes overcommit)
        held = inst.procs.get(pid, 0) if inst is not None else 0
        if not self.refused(self.attempt(allowed, self.node.alloc, gpu, name, pid, nbytes)):
            assert self.node.instance(gpu, name).procs[pid] == held + nbytes

    @rule(data=st.data(), pid=pids, nbytes=st.none() | st.integers(-5, 600) | st.integers(-2, -1))
    def free(self, data, pid, nbytes):
        gpu, name = self.target(data)
        self.do_free(gpu, name, pid, nbytes)

    def do_free(self, gpu, name, pid, nbytes):
        allowed, _, inst = self._inst_errors(gpu, name)
        if nbytes is not None and nbytes < 0:
            allowed.add(InvalidValue)
        held = inst.procs.get(pid, 0) if inst is not None else 0
        if not self.refused(self.attempt(allowed, self.node.free, gpu, name, pid, nbytes)):
            left = 0 if nbytes is None else max(0, held - nbytes)
            assert self.node.instance(gpu, name).procs.get(pid, 0) == left

    @rule(pid=pids)
    def drop_process(self, pid):
        state = self.node.to_state()
        self.node.drop_process(pid)
        assert all(pid not in i.procs for i in self.node.instances())
        assert self.node.to_state() == state

    # ---- state -------------------------------------------------------------

    @rule()
    def round_trip_into_a_fresh_node(self):
        state = json.loads(json.dumps(self.node.to_state()))
        fresh = Node(INFOS)
        fresh.load_state(state)
        assert fresh.to_state() == self.node.to_state()

    @rule()
    def reload_own_state(self):
        before = snapshot(self.node)
        self.node.load_state(self.node.to_state())
        after = snapshot(self.node)
        assert after[:2] == before[:2], "reloading the node's own state changed it (or lost process memory)"

    @precondition(lambda self: any(True for _ in self.node.instances()))
    @rule(
        data=st.data(),
        how=st.sampled_from(["uuid", "dup_id", "weight", "memsize", "name", "max_inst", "max_inst_high"]),
    )
    def load_a_bad_state(self, data, how):
        state = self.node.to_state()
        gi = data.draw(st.sampled_from([i for i, g in enumerate(state["gpus"]) if g["instances"]]))
        gs = state["gpus"][gi]
        inst = gs["instances"][0]
        if how == "uuid":
            gs["uuid"] = "GPU-not-this-one"
        elif how == "dup_id":
            gs["instances"].append(dict(inst, name="dupdupdupdup", memsize=0, weight=0))
        elif how == "weight":
            inst["weight"] = gs["max_inst"] + 1
        elif how == "memsize":  # promises past the device (a lone memsize past it, when nothing else is promised)
            inst["promised"] = True
            inst["memsize"] = MEMORIES[gi] - sum(i["memsize"] for i in gs["instances"][1:] if i["promised"]) + 1
        elif how == "name":
            inst["name"] = "bad"
        elif how == "max_inst":
            gs["max_inst"] = 0
        elif how == "max_inst_high":
            gs["max_inst"] = MAX_INST[1] + 1
        self.attempt({InvalidValue}, self.node.load_state, state)

    # ---- helpers -----------------------------------------------------------

    def target(self, data) -> tuple[int, str]:
        """Mostly an instance that exists; sometimes anything at all."""
        anything = st.tuples(gpus, names)
        existing = sorted((i.gpu, i.name) for i in self.node.instances())
        if not existing:
            return data.draw(anything)
        there = st.sampled_from(existing)
        return data.draw(st.one_of(there, there, there, anything))

    def _name_errors(self, name) -> set[type]:
        """For operations on every instance of a name."""
        if not NAME_RE.match(name):
            return {InvalidValue}
        return set() if self.node.instances_named(name) else {NotFound}

    def _gpu_errors(self, gpu) -> set[type]:
        return set() if 0 <= gpu < len(self.node.gpus) else {NotFound}

    def _inst_errors(self, gpu, name):
        if not 0 <= gpu < len(self.node.gpus):
            return {NotFound}, None, None
        g = self.node.gpus[gpu]
        if name not in g.instances:
            return {NotFound}, g, None
        return set(), g, g.instances[name]

    # ---- SPEC §4, after every step -----------------------------------------

    @invariant()
    def spec_invariants(self):
        n = self.node
        ids = []
        assert 0 <= n.default_memsize <= MEM_MAX
        for index, g in enumerate(n.gpus):
            assert g.index == index and g.info is INFOS[index]
            assert MAX_INST[0] <= g.max_inst <= MAX_INST[1]
            assert g.policy in POLICIES
            assert PRIO_RATIO[0] <= g.prio_ratio <= PRIO_RATIO[1]
            assert len(g.instances) <= g.max_inst
            weight_sum = sum(i.weight for i in g.instances.values())
            assert weight_sum <= g.max_inst
            assert g.free_weight == g.max_inst - weight_sum >= 0
            assert sum(i.memsize for i in g.instances.values() if i.promised) <= g.info.memory
            assert g.free_memory >= 0
            assert sum(i.used for i in g.instances.values()) <= g.info.memory
            for name, i in g.instances.items():
                assert i.name == name and NAME_RE.match(name)
                assert i.gpu == index
                assert 0 <= i.weight <= g.max_inst
                assert 0 <= i.memsize <= g.info.memory
                assert isinstance(i.highprio, bool)
                assert all(b >= 0 for b in i.procs.values())
                assert i.used <= i.memsize
                assert i.free == i.memsize - i.used
                ids.append(i.id)
        assert len(ids) == len(set(ids)), f"ids not unique: {ids}"
        assert all(i >= 1 for i in ids)

    @invariant()
    def version_moves_with_the_listing(self):
        keys = {(i.gpu, i.name) for i in self.node.instances()}
        assert self.node.version >= self.version
        if keys != self.keys:
            assert self.node.version > self.version, "instances came or went but version did not move"
        self.keys, self.version = keys, self.node.version

    @invariant()
    def state_is_plain_json(self):
        state = self.node.to_state()
        assert json.loads(json.dumps(state)) == state


def snapshot_without(n: Node, name: str):
    return sorted(
        (i.gpu, i.name, i.id, i.memsize, i.weight, i.highprio, sorted(i.procs.items()))
        for i in n.instances()
        if i.name != name
    )


NodeMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestNodeMachine = NodeMachine.TestCase
