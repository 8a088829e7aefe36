"""CUDA graphs' own memory (issue 45, item 6; docs/memory.md, "Graph memory").

A graph's allocation nodes (cuMemAllocAsync captured: PyTorch's cudaMallocAsync backend under CUDA
graphs; cuGraphAddMemAllocNode) take nothing at capture: the driver maps their physical memory from
the device's graph memory pool at instantiation, upload or the first launch, and the pool keeps it
across replays and past the graph's destruction until cuDeviceGraphMemTrim (the CUDA Programming
Guide, "Graph Memory Nodes"). The stand-in libcuda does so (native/stubs/cuda_graphnodes.c, the
latest the Guide allows: the first launch); libcgpu holds what a graph may map at its instantiation
and refuses it with out-of-memory past memsize. Expected figures are worked out here from the
sizes asked and 2 MiB pages (each executable graph's own 70 MiB of driver memory, CGPU_STUB_GRAPH_KIB,
set to 0 so the figures are the graph memory's alone)."""
from __future__ import annotations

import json
import os

from cgpud.gpus import pages
from test_pools import SEEN, card, libs, run  # noqa: F401 (the fixtures)

MIB = 1 << 20

GRAPH_ATTRS = """
import json
GA = d.CUgraphMem_attribute
def gattr(a):
    return int(ok(d.cuDeviceGetGraphMemAttribute(0, getattr(GA, "CU_GRAPH_MEM_ATTR_" + a))))
ok(d.cuInit(0)); dev = ok(d.cuDeviceGet(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(dev))))
s = ok(d.cuStreamCreate(1))
ok(d.cuMemGetInfo())  # (the card's state file made)
def capture(*mib, free_first=False):
    '''a graph of allocations of `mib` MiB each, captured (the first freed in it if free_first)'''
    ok(d.cuStreamBeginCapture(s, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    ptrs = [ok(d.cuMemAllocAsync(m * 2**20, s)) for m in mib]
    ok(d.cuLaunchKernel(d.CUfunction(), 100, 1, 1, 1, 1, 1, 0, s, 0, 0))
    if free_first:
        ok(d.cuMemFreeAsync(ptrs[0], s))
    return ok(d.cuStreamEndCapture(s))
"""


def test_the_stand_ins_graph_memory_is_mapped_at_the_first_launch_and_kept_until_a_trim(card):
    """Without libcgpu: a captured graph of 100 MiB and 3 MiB (freed in it) allocations takes nothing
    from the card at capture or instantiation; its first launch maps 104 MiB (52 pages) from the
    graph pool, which replays reuse; the pool keeps them past cuGraphExecDestroy (used 0, reserved
    104 MiB), and cuDeviceGraphMemTrim gives them back (the high mark stays)."""
    env, _, _ = card
    env = {k: v for k, v in env.items() if k not in ("CGPU_PAGE_DIR", "LD_PRELOAD")}
    env["CGPU_STUB_GRAPH_KIB"] = "0"
    r = run(env, SEEN, GRAPH_ATTRS, """
        def look():
            return [on_card(), nvml_mine(), gattr("USED_MEM_CURRENT"), gattr("RESERVED_MEM_CURRENT")]
        g = capture(100, 3, free_first=False)
        out = {"captured": look()}
        nodes, n = ok(d.cuGraphGetNodes(g, 8))
        out["types"] = [ok(d.cuGraphNodeGetType(x)).name[len("CU_GRAPH_NODE_TYPE_"):] for x in nodes[:n]]
        e = ok(d.cuGraphInstantiate(g, 0)); out["instantiated"] = look()
        ok(d.cuGraphLaunch(e, s)); ok(d.cuStreamSynchronize(s)); out["launched"] = look()
        ok(d.cuGraphLaunch(e, s)); ok(d.cuStreamSynchronize(s)); out["replayed"] = look()
        ok(d.cuGraphExecDestroy(e)); out["destroyed"] = look()
        ok(d.cuDeviceGraphMemTrim(dev)); out["trimmed"] = look() + [gattr("RESERVED_MEM_HIGH")]
        print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr
    held = 104 * MIB
    assert json.loads(r.stdout) == {"captured": [0, 0, 0, 0], "types": ["MEM_ALLOC", "MEM_ALLOC", "KERNEL"],
                                    "instantiated": [0, 0, 0, 0], "launched": [held, held, held, held],
                                    "replayed": [held, held, held, held], "destroyed": [held, held, 0, held],
                                    "trimmed": [0, 0, 0, 0, held]}


def test_a_graphs_first_replay_never_takes_the_container_past_memsize(card):
    """PyTorch's pattern (its cudaMallocAsync backend, the pool's release threshold at its highest):
    128 MiB of eager tensors in a 384 MiB container, then a graph captured with 160 + 160 MiB of
    allocations. On main the capture, the instantiation and the first launch all passed, and the card
    held 448 MiB of a 384 MiB memsize (the watchdog's kill). Now the instantiation is refused with
    out-of-memory and the card never holds more than memsize. A graph of 224 MiB (352 MiB in all,
    under 97 % of memsize) is instantiated and replayed; its pages, kept by the pool after its
    executable graph is destroyed, stay charged (40 MiB more is refused: the card would pass
    memsize) and are reused by the next instantiation without a second charge; cuDeviceGraphMemTrim
    gives them back, and then the 40 MiB fit."""
    env, dirp, _ = card
    env = {**env, "CGPU_STUB_GRAPH_KIB": "0"}
    memsize = 384 * MIB
    pages.create(os.fspath(dirp), [memsize])
    r = run(env, SEEN, GRAPH_ATTRS, """
        OOM = d.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        pool = ok(d.cuDeviceGetMemPool(dev)); set_threshold(pool, 2**64 - 1)
        eager = ok(d.cuMemAllocAsync(128 * 2**20, s)); ok(d.cuStreamSynchronize(s))
        big = capture(160, 160)
        got = d.cuGraphInstantiate(big, 0)
        out = {"big instantiated": got[0].name}
        if got[0] == d.CUresult.CUDA_SUCCESS:
            out["big launched"] = d.cuGraphLaunch(got[1], s)[0].name; ok(d.cuStreamSynchronize(s))
        out["card after big"] = on_card()
        small = capture(96, 128, free_first=True)
        e = ok(d.cuGraphInstantiate(small, 0))
        for _ in range(3):
            ok(d.cuGraphLaunch(e, s)); ok(d.cuStreamSynchronize(s))
        out["replayed"] = [on_card(), gattr("RESERVED_MEM_CURRENT")]
        ok(d.cuGraphExecDestroy(e))
        out["40 MiB refused while the pool keeps it"] = d.cuMemAlloc(40 * 2**20)[0] == OOM
        e = ok(d.cuGraphInstantiate(small, 0)); ok(d.cuGraphLaunch(e, s)); ok(d.cuStreamSynchronize(s))
        out["reused"] = [on_card(), ok(d.cuMemGetInfo())[0]]
        ok(d.cuGraphExecDestroy(e)); ok(d.cuDeviceGraphMemTrim(dev))
        out["trimmed"] = [on_card(), ok(d.cuMemGetInfo())[0], d.cuMemAlloc(40 * 2**20)[0].name]
        print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out == {"big instantiated": "CUDA_ERROR_OUT_OF_MEMORY", "card after big": 128 * MIB,
                   "replayed": [352 * MIB, 224 * MIB], "40 MiB refused while the pool keeps it": True,
                   "reused": [352 * MIB, 32 * MIB], "trimmed": [128 * MIB, 256 * MIB, "CUDA_SUCCESS"]}
    assert pages.used(os.fspath(dirp))[0] == 0, "what the graph pool held comes back when the process ends"


def test_graph_memory_inside_a_child_graph_is_foreseen(card):
    """A child graph node whose graph holds allocation nodes (cuGraphAddNode's GRAPH, its ownership
    moved: CUDA 12.4's way to nest memory nodes): 300 MiB inside a 256 MiB container is refused at
    the instantiation, and the card holds nothing. On main the child counted as nothing: the first
    launch mapped 300 MiB."""
    env, dirp, _ = card
    env = {**env, "CGPU_STUB_GRAPH_KIB": "0"}
    pages.create(os.fspath(dirp), [256 * MIB])
    r = run(env, SEEN, GRAPH_ATTRS, """
        inner = capture(300)
        outer = ok(d.cuGraphCreate(0))
        p = d.CUgraphNodeParams(); p.type = d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_GRAPH
        p.graph.graph = inner
        p.graph.ownership = d.CUgraphChildGraphNodeOwnership.CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE
        ok(d.cuGraphAddNode(outer, None, None, 0, p))
        got = d.cuGraphInstantiate(outer, 0)
        out = [got[0].name]
        if got[0] == d.CUresult.CUDA_SUCCESS:
            d.cuGraphLaunch(got[1], s); ok(d.cuStreamSynchronize(s))
        print(json.dumps(out + [on_card()]))
    """)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == ["CUDA_ERROR_OUT_OF_MEMORY", 0]


def test_the_stand_in_builds_child_and_conditional_nodes_as_the_driver_does(card):
    """Issue 45, item 9's stand-in, without libcgpu, each rule the driver API reference's: a child graph
    node clones its graph (cuGraphChildGraphNodeGetGraph gives the clone, of the same nodes, to
    which no allocation node may be added), and refuses a graph holding memory nodes unless its
    ownership is moved (cuGraphAddNode); a conditional node's bodies are made by the driver
    (phGraph_out) and described by cuGraphNodeGetParams; cuGraphNodeGetType names each kind."""
    env, _, _ = card
    env = {k: v for k, v in env.items() if k not in ("CGPU_PAGE_DIR", "LD_PRELOAD")}
    r = run(env, SEEN, GRAPH_ATTRS, """
        E = d.CUresult
        T = d.CUgraphNodeType
        kernels = capture()
        with_memory = capture(4)
        outer = ok(d.cuGraphCreate(0))
        child = ok(d.cuGraphAddChildGraphNode(outer, None, 0, kernels))
        clone = ok(d.cuGraphChildGraphNodeGetGraph(child))
        out = {"clone": [int(clone) != int(kernels), ok(d.cuGraphGetNodes(clone, 0))[1]]}
        p = d.CUDA_MEM_ALLOC_NODE_PARAMS(); p.bytesize = 2**20
        p.poolProps.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        p.poolProps.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        out["memory into the clone"] = d.cuGraphAddMemAllocNode(clone, None, 0, p)[0].name
        out["a child with memory, cloned"] = d.cuGraphAddChildGraphNode(outer, None, 0, with_memory)[0].name
        q = d.CUgraphNodeParams(); q.type = T.CU_GRAPH_NODE_TYPE_GRAPH; q.graph.graph = with_memory
        q.graph.ownership = d.CUgraphChildGraphNodeOwnership.CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE
        moved = ok(d.cuGraphAddNode(outer, None, None, 0, q))
        c = d.CUgraphNodeParams(); c.type = T.CU_GRAPH_NODE_TYPE_CONDITIONAL
        c.conditional.handle = ok(d.cuGraphConditionalHandleCreate(outer, None, 1, d.CU_GRAPH_COND_ASSIGN_DEFAULT))
        c.conditional.type = d.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_SWITCH
        c.conditional.size = 3
        cond = ok(d.cuGraphAddNode(outer, None, None, 0, c))
        got = ok(d.cuGraphNodeGetParams(cond))
        out["bodies"] = [got.conditional.size, got.conditional.type.name,
                         [int(got.conditional.phGraph_out[i]) == int(c.conditional.phGraph_out[i]) for i in range(3)]]
        nodes, n = ok(d.cuGraphGetNodes(outer, 8))
        out["types"] = [ok(d.cuGraphNodeGetType(x)).name[len("CU_GRAPH_NODE_TYPE_"):] for x in nodes[:n]]
        out["moved"] = int(ok(d.cuGraphChildGraphNodeGetGraph(moved))) == int(with_memory)
        print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"clone": [True, 1], "memory into the clone": "CUDA_ERROR_INVALID_VALUE",
                                    "a child with memory, cloned": "CUDA_ERROR_INVALID_VALUE",
                                    "bodies": [3, "CU_GRAPH_COND_TYPE_SWITCH", [True, True, True]],
                                    "types": ["GRAPH", "GRAPH", "CONDITIONAL"], "moved": True}


def test_an_address_the_graph_reuses_is_charged_once(card):
    """The driver may give an allocation made in a graph after a free of the graph's own the same
    address (the Guide's "Address Reuse within a Graph": their lifetimes do not overlap), and so the
    same pages: PyTorch's captured temporaries, freed and allocated again and again. 200 MiB
    allocated, freed and allocated again in one graph, in a 256 MiB container: the stand-in reuses
    the address, the graph maps 200 MiB, and libcgpu charges what the addresses cover: the
    instantiation and the launch pass (the sum, 400 MiB, was a false out-of-memory)."""
    env, dirp, _ = card
    env = {**env, "CGPU_STUB_GRAPH_KIB": "0"}
    pages.create(os.fspath(dirp), [256 * MIB])
    r = run(env, SEEN, GRAPH_ATTRS, """
        ok(d.cuStreamBeginCapture(s, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
        a = ok(d.cuMemAllocAsync(200 * 2**20, s)); ok(d.cuMemFreeAsync(a, s))
        b = ok(d.cuMemAllocAsync(200 * 2**20, s)); ok(d.cuMemFreeAsync(b, s))
        g = ok(d.cuStreamEndCapture(s))
        got = d.cuGraphInstantiate(g, 0)
        out = [int(a) == int(b), got[0].name]
        if got[0] == d.CUresult.CUDA_SUCCESS:
            out.append(d.cuGraphLaunch(got[1], s)[0].name); ok(d.cuStreamSynchronize(s))
        print(json.dumps(out + [on_card()]))
    """)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [True, "CUDA_SUCCESS", "CUDA_SUCCESS", 200 * MIB]


def test_the_stand_ins_graph_memory_past_the_cards_free_memory_fails_the_launch(card):
    """Without libcgpu, on a 256 MiB card: a graph of 300 MiB is captured and instantiated (nothing
    mapped yet), and its first launch fails with CUDA_ERROR_OUT_OF_MEMORY, the card unchanged; so
    does cuGraphUpload, and an instantiation with CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD."""
    env, _, _ = card
    env = {k: v for k, v in env.items() if k not in ("CGPU_PAGE_DIR", "LD_PRELOAD")}
    env.update(CGPU_STUB_GRAPH_KIB="0", CGPU_STUB_CUDA_MIB="256")
    r = run(env, SEEN, GRAPH_ATTRS, """
        g = capture(300)
        e = ok(d.cuGraphInstantiate(g, 0))
        out = [d.cuGraphLaunch(e, s)[0].name, d.cuGraphUpload(e, s)[0].name, on_card()]
        p = d.CUDA_GRAPH_INSTANTIATE_PARAMS()
        p.flags = d.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD; p.hUploadStream = s
        out += [d.cuGraphInstantiateWithParams(g, p)[0].name, on_card(), gattr("RESERVED_MEM_CURRENT")]
        print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr
    oom = "CUDA_ERROR_OUT_OF_MEMORY"
    assert json.loads(r.stdout) == [oom, oom, 0, oom, 0, 0]


def test_graph_memory_is_charged_on_the_gpu_it_is_placed_on(card):
    """Two GPUs of 256 MiB each, the context on GPU 0: a graph's allocation nodes placed by their pool
    properties (cuGraphAddMemAllocNode's poolProps.location), 200 MiB on each GPU, fit (each GPU's
    pool holds 200 MiB after the launch); 300 MiB on GPU 1 is refused at the instantiation though
    GPU 0 has room. Charged all on the instantiating context's GPU, the first was refused (400 MiB
    on GPU 0) and the second passed."""
    env, dirp, _ = card
    env = {**env, "CGPU_STUB_GRAPH_KIB": "0", "CGPU_STUB_CUDA_DEVICES": "2"}
    pages.create(os.fspath(dirp), [256 * MIB, 256 * MIB])
    r = run(env, SEEN, GRAPH_ATTRS, """
        def on(dev):
            with open(os.environ["CGPU_STUB_CUDA_STATE"], "rb") as f:
                f.seek(16 * dev); return int.from_bytes(f.read(8), "little")
        def graph(*placed):
            g = ok(d.cuGraphCreate(0))
            for dev, mib in placed:
                p = d.CUDA_MEM_ALLOC_NODE_PARAMS(); p.bytesize = mib * 2**20
                p.poolProps.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                p.poolProps.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                p.poolProps.location.id = dev
                ok(d.cuGraphAddMemAllocNode(g, None, 0, p))
            return g
        out = {}
        got = d.cuGraphInstantiate(graph((0, 200), (1, 200)), 0)
        out["both"] = [got[0].name]
        if got[0] == d.CUresult.CUDA_SUCCESS:
            out["both"].append(d.cuGraphLaunch(got[1], s)[0].name); ok(d.cuStreamSynchronize(s))
        out["both"] += [on(0), on(1)]
        out["300 MiB on GPU 1"] = [d.cuGraphInstantiate(graph((1, 300)), 0)[0].name, on(0), on(1)]
        print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"both": ["CUDA_SUCCESS", "CUDA_SUCCESS", 200 * MIB, 200 * MIB],
                                    "300 MiB on GPU 1": ["CUDA_ERROR_OUT_OF_MEMORY", 200 * MIB, 200 * MIB]}
