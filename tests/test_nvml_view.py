"""nvidia-smi inside a container shows the container, never its neighbours (issue 23, item 3;
docs/isolation.md, "What nvidia-smi shows").

The client is NVIDIA's nvidia-ml-py making the calls nvidia-smi makes (tests/smi_view.py), with
libcgpu preloaded and the container's pages, on the stand-in driver and NVML (native/stubs), which
show the whole card as the real ones do: every process, every neighbour's memory and
utilisation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from smi_view import CARD_MIB, GIB, HOLDER, MIB, VIEW, Scene, query_compute_apps, query_gpu
from test_libcgpu import build_libs, run_prepared


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    return build_libs(tmp_path_factory.mktemp("nvml-view"))


@pytest.fixture
def scene(libs, tmp_path):
    s = Scene(libs, tmp_path)
    yield s
    s.close()


def neighbours(scene: Scene, big: bool) -> None:
    """Neighbours' usage: a CUDA process of another container holding memory on the card, processes
    of others listed as compute, graphics and MPS processes with utilisation samples, the card's
    rates. `big`: all of it changed (more memory, another process, other samples and rates)."""
    stub = scene.stub
    pids = [scene.idle() for _ in range(3 if big else 2)]
    stub.procs = {(0, pid): (3 if big else 1) * GIB for pid in pids[:1] + pids[2:]}
    stub.graphics = {(0, pids[1]): (2 if big else 1) * 256 * MIB}
    stub.mps = {(0, pids[-1]): 64 * MIB * (2 if big else 1)}
    stub.putil = {(0, pid): ((90, 40, 5, 5) if big else (10, 5, 0, 0)) for pid in pids}
    stub.gpus[0].util, stub.gpus[0].memutil, stub.gpus[0].used = (97, 60, GIB) if big else (12, 7, 0)
    # power, temperature, fan, performance state, SM clock, energy, encoder, decoder: the card's load
    stub.gpus[0].sensors = (68000, 83, 90, 0, 1590, 7 * 10**9, 40, 30) if big else (31000, 41, 30, 8, 300, 10**9, 2, 1)


def own_scene(scene: Scene):
    """The container: two processes through libcgpu holding 1 GiB and 512 MiB, one of them running
    (its utilisation sample: 30 % SM, 10 % memory), beside a neighbour's CUDA process (no libcgpu)."""
    a, b = scene.holder(True), scene.holder(True)
    scene.alloc(a, GIB)
    scene.alloc(b, 512 * MIB)
    other = scene.holder(False)
    scene.alloc(other, 8 * GIB)
    return a, b, other


def test_the_container_sees_its_own_processes_memory_and_utilisation_only(scene):
    a, b, other = own_scene(scene)
    neighbours(scene, big=False)
    scene.stub.putil[(0, a.pid)] = (30, 10, 3, 4)
    scene.stub.write()
    v = scene.view()
    own = sorted([[a.pid, GIB], [b.pid, 512 * MIB]])
    assert v["count"] == 1 and v["gpu0.name"] == "Tesla T4"
    # nvidia-smi's default screen and --query-*: memsize as the card, the container's usage,
    # its own processes with their memory, its own utilisation
    assert query_gpu(v) == [4096, 1536, 30]
    assert query_compute_apps(v) == [[pid, used // MIB] for pid, used in own]
    assert v["gpu0.utilization.memory"] == 10
    assert v["gpu0.utilization.encoder"] == 3 and v["gpu0.utilization.decoder"] == 4  # its own samples'
    # the card's sensors follow everyone's load: not the container's to see
    for sensor in ("fan.speed", "temperature.gpu", "pstate", "power.draw", "clocks.sm", "total_energy_consumption"):
        assert v[f"gpu0.{sensor}"] == "error: Not Supported", sensor
    assert v["gpu0.memory_v2"] == [4 * GIB, 0, 1536 * MIB, 4 * GIB - 1536 * MIB]
    for version in ("", "_v2", "_v3"):
        assert v[f"gpu0.nvmlDeviceGetComputeRunningProcesses{version}"] == own
        assert v[f"gpu0.nvmlDeviceGetGraphicsRunningProcesses{version}"] == []
        assert v[f"gpu0.nvmlDeviceGetMPSComputeRunningProcesses{version}"] == []
    assert v["gpu0.detail0"] == own and v["gpu0.detail1"] == v["gpu0.detail2"] == []
    assert v["gpu0.process_utilization"] == [[a.pid, 30, 10, 3, 4]]
    assert v["gpu0.processes_utilization_info"] == [[a.pid, 30, 10, 3, 4, 0, 0]]
    assert v["cuMemGetInfo"] == [4 * GIB - 1536 * MIB, 4 * GIB]


def test_no_value_the_container_sees_changes_when_its_neighbours_usage_does(scene):
    """Between two reads the neighbours change their memory, processes and utilisation (and the
    card's rates): every value the container sees stays as it was. The same calls outside the
    container see them change (the stand-in is the whole card, as the driver is)."""
    own_scene(scene)
    neighbours(scene, big=False)
    scene.stub.write()
    before, outside = scene.view(), scene.view(contained=False)
    other = scene.holder(False)
    scene.alloc(other, 4 * GIB)  # the card now has less free than the container's memsize left
    neighbours(scene, big=True)
    scene.stub.write()
    after, outside_after = scene.view(), scene.view(contained=False)
    assert {k: (before[k], after[k]) for k in before if before[k] != after[k]} == {}
    changed = [k for k in outside if outside[k] != outside_after[k]]
    assert len(changed) >= 23, changed  # what it would have told: memory, rates, every process list


def test_a_short_buffer_gets_the_containers_count_as_nvml_documents(scene):
    """NVML_ERROR_INSUFFICIENT_SIZE with the count needed is the container's count, and a buffer of
    exactly that many is filled: a client sizing its buffer by it never sees a neighbour."""
    a, b, other = own_scene(scene)
    neighbours(scene, big=True)
    scene.stub.write()
    r = subprocess.run([sys.executable, "-c", SHORT], env=scene.env(True), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout.split()
    assert out[:4] == ["7", "2", "0", "2"]  # NVML_ERROR_INSUFFICIENT_SIZE, 2 needed; then NVML_SUCCESS, 2
    assert sorted(map(int, out[4:])) == sorted([a.pid, b.pid])


SHORT = r"""
import ctypes, pynvml as N
N.nvmlInit(); h = N.nvmlDeviceGetHandleByIndex(0)
fn = N._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
n = ctypes.c_uint(1); buf = (N.c_nvmlProcessInfo_v3_t * 1)()
r = fn(h, ctypes.byref(n), buf)
print(r, n.value)
buf = (N.c_nvmlProcessInfo_v3_t * n.value)()
r = fn(h, ctypes.byref(n), buf)
print(r, n.value, *[buf[k].pid for k in range(min(n.value, len(buf)))])
"""


def test_in_a_real_container_nvidia_smi_shows_its_own_processes_by_its_own_pids(make_daemon, libs, tmp_path):
    """cgpu-runtime in front of real runc (a PID namespace of the container's own; libcgpu through
    /etc/ld.so.preload and its pages at /run/cgpu): a process of the container holding 256 MiB is
    shown by its pid in the container, with its memory; a neighbour's CUDA process on the host and
    the stand-in's listed neighbours are not, and the container's reads do not change when they do."""
    share = tmp_path / "share"
    (share / "lib").mkdir(parents=True)
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        subprocess.run(["cp", str(libs / name), str(share / "lib" / name)], check=True)
    (share / "view.py").write_text(VIEW)
    (share / "holder.py").write_text(HOLDER)
    scene = Scene(libs, tmp_path)
    scene.stub.config = share / "nvml.conf"
    scene.stub.cuda_state = "/share/card"  # (read inside the container)
    try:
        other = scene.holder(False, CGPU_STUB_CUDA_STATE=str(share / "card"))  # a neighbour on the host
        scene.alloc(other, 2 * GIB)
        neighbours(scene, big=False)
        scene.stub.write()
        py = sys.executable
        script = f"""
            export CGPU_NVML_STUB=/share/nvml.conf CGPU_STUB_CUDA_MIB={CARD_MIB}
            mkfifo /tmp/in || exit 1
            {py} /share/holder.py < /tmp/in > /share/holder.out 2> /share/holder.err &
            exec 3>/tmp/in
            echo alloc {256 * MIB} >&3
            n=0; while ! grep -q ok /share/holder.out; do sleep 0.05; n=$((n+1)); [ $n -lt 400 ] || exit 2; done
            {py} /share/view.py > /share/view1.json 2> /share/view.err && touch /share/ready || exit 3
            n=0; while [ ! -e /share/go ]; do sleep 0.05; n=$((n+1)); [ $n -lt 400 ] || exit 4; done
            {py} /share/view.py > /share/view2.json 2> /share/view.err || exit 5
            exec 3>&-; wait
        """
        pythons = {str(Path(sys.executable).parent.parent), sys.base_prefix}  # (the venv and its Python)
        mounts = [{"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]}]
        mounts += [{"destination": p, "type": "bind", "source": p, "options": ["rbind", "ro"]} for p in pythons]
        rootfs = tmp_path / "rootfs"
        for sub in ("usr", "proc", "dev", "sys", "run", "tmp", "share", *(p.lstrip("/") for p in pythons)):
            (rootfs / sub).mkdir(parents=True, exist_ok=True)
        for link in ("bin", "lib", "lib64", "sbin"):
            os.symlink(f"usr/{link}", rootfs / link)
        result = {}
        t = threading.Thread(target=lambda: result.update(r=run_prepared(
            make_daemon, libs / "libcgpu.so", tmp_path, rootfs, share, script, mounts)[0]))
        t.start()
        deadline = time.monotonic() + 60
        while not (share / "ready").exists() and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        scene.alloc(other, GIB)  # the neighbours change: more memory, processes, utilisation
        neighbours(scene, big=True)
        scene.stub.write()
        (share / "go").touch()
        t.join(90)
        r = result["r"]
        errs = "".join(f.read_text() for f in share.glob("*.err"))
        assert r.returncode == 0, r.stdout + r.stderr + errs
        own_pid = int((share / "holder.out").read_text().split()[1])
        v1, v2 = (json.loads((share / f"view{k}.json").read_text()) for k in (1, 2))
    finally:
        scene.close()
    assert own_pid < 100, "the container has a PID namespace of its own"
    assert query_compute_apps(v1) == [[own_pid, 256]]
    assert query_gpu(v1) == [1024, 256, 0]
    assert v1["gpu0.nvmlDeviceGetGraphicsRunningProcesses_v3"] == v1["gpu0.nvmlDeviceGetMPSComputeRunningProcesses_v3"] == []
    assert v1["cuMemGetInfo"] == [768 * MIB, GIB]
    assert {k: (v1[k], v2[k]) for k in v1 if v1[k] != v2[k]} == {}
