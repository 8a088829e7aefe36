"""core_mem (SPEC §6, docs/scheduler.md "core_mem"): a container's compute percentage
(ALIYUN_COM_GPU_CORE_PERCENTAGE, a multiple of 5 from 5 to 100) is its weight under policy 3 with
20 slots of 5 %, fixed even alone; the sum on a GPU never above 100; memory-only and percentage
containers never on one core_mem node. The environment's rules, the hook's, the daemon's
`register`, and the shares on real processes (`cgpu run --core`, frozen and thawed by a real
daemon: 30 % and 60 % give 1:2, and 30 % alone stays near 30 % — a weighted policy would give it
the whole GPU; on the stand-in card, gated by libcgpu, 30 % of the card's time for a job that leaves
it idle between kernels). The plan itself, cycle by cycle: tests/test_policies.py's core_mem cases."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cgpud.client import Client, ControlError
from cgpud.containers.envspec import CORE, MEM_CONTAINER, NVIDIA, WEIGHT, EnvError, parse_env
from cgpud.containers.hookd import HookError, core_mode_rule
from cgpud.core.model import GpuInfo
from test_sched_real import Workloads, usage

SMI = str(Path(sys.executable).parent / "cgpu-smi")
T4 = [GpuInfo(0, "GPU-t4", "Tesla T4", 15109 << 20)]


@pytest.mark.parametrize("raw,why", [("33", "multiple of 5"), ("0", "multiple of 5"), ("105", "multiple of 5"),
                                     ("x", "not a whole number"), ("-5", "negative")])
def test_a_bad_percentage_is_one_line_naming_the_variable(raw, why):
    with pytest.raises(EnvError) as err:
        parse_env({MEM_CONTAINER: "3", NVIDIA: "all", CORE: raw}, T4)
    assert str(err.value).startswith(f"{CORE}=") and why in str(err.value) and "\n" not in str(err.value)


def test_a_percentage_and_a_weight_are_not_both_given():
    with pytest.raises(EnvError, match=WEIGHT):
        parse_env({MEM_CONTAINER: "3", NVIDIA: "all", CORE: "30", WEIGHT: "2"}, T4)
    assert parse_env({MEM_CONTAINER: "3", NVIDIA: "all", CORE: "30"}, T4).percentage == 30


def test_memory_only_and_percentage_containers_never_share_a_core_mem_node():
    memory_only = parse_env({MEM_CONTAINER: "3", NVIDIA: "all"}, T4)
    with_core = parse_env({MEM_CONTAINER: "3", NVIDIA: "all", CORE: "30"}, T4)
    core_mode_rule(with_core, "core_mem")
    core_mode_rule(memory_only, "cgpu")
    with pytest.raises(HookError, match="runs in mode core_mem"):
        core_mode_rule(memory_only, "core_mem")
    with pytest.raises(HookError, match="not core_mem"):
        core_mode_rule(with_core, "cgpu")


def register(d, name: str, pct: int | None, **kw) -> dict:
    args = {"weight": pct // 5, "policy": 3, "core": True} if pct is not None else {}
    with Client(str(d.socket)) as c:
        return c.call("register", name=name, gpus=[0], memsize=1 << 30, **args, **kw)


def test_the_sum_on_a_gpu_never_passes_100_and_is_refused_not_lowered(daemon):
    register(daemon, "pctthirty001", 30)
    register(daemon, "pctsixty0002", 60)
    assert daemon.read("0/max_inst").strip() == "20" and daemon.read("0/policy").strip() == "3"
    with pytest.raises(ControlError) as err:
        register(daemon, "pcttwenty003", 20)
    assert "10 % of its compute left" in str(err.value)
    assert daemon.read("0/free_weight").strip() == "2", "the refused one changed nothing"
    register(daemon, "pctten000004", 10)
    assert daemon.read("0/free_weight").strip() == "0"
    smi = subprocess.run([SMI], capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, CGPUD_SOCKET=str(daemon.socket)))
    rows = {line.split()[2]: line for line in smi.stdout.splitlines() if line.startswith("|") and "pct" in line}
    for name, pct in (("pctthirty001", "30.0%"), ("pctsixty0002", "60.0%"), ("pctten000004", "10.0%")):
        assert pct in rows[name], (name, smi.stdout)  # cgpu-smi's Limit: the percentage


def test_a_percentage_is_refused_on_a_gpu_holding_memory_only_containers(daemon):
    register(daemon, "memonly00001", None)
    with pytest.raises(ControlError) as err:
        register(daemon, "pctthirty001", 30)
    assert "never share a GPU" in str(err.value)


def test_30_and_60_percent_give_1_to_2_and_30_alone_stays_near_30(daemon):
    daemon.write("default_memsize", str(64 << 20))
    w = Workloads(daemon)
    try:
        w.start("corethirty01", 9, "--core", "30")
        time.sleep(0.5)
        u0, t0 = usage("corethirty01"), time.monotonic()
        time.sleep(2.0)
        alone = (usage("corethirty01") - u0) / (time.monotonic() - t0)
        # fixed: 30 % even alone (a weighted or preemptive policy would give it the whole GPU, 1.0)
        assert 0.18 <= alone <= 0.40, alone
        w.start("coresixty002", 7, "--core", "60")
        time.sleep(0.5)
        seen = [(usage("corethirty01"), usage("coresixty002"))]
        for _ in range(4):
            time.sleep(1.0)
            seen.append((usage("corethirty01"), usage("coresixty002")))
        assert all(p.poll() is None for p in w.procs.values()), "a workload ended inside the window"
        ratios = sorted((b1 - b0) / (a1 - a0) for (a0, b0), (a1, b1) in zip(seen, seen[1:]))
        # 2 within 15 %: a fair or preemptive policy gives 1.0
        assert 1.7 <= ratios[len(ratios) // 2] <= 2.3, ratios
    finally:
        w.stop_all()


@pytest.fixture(scope="module")
def card_libs(tmp_path_factory) -> Path:
    """The stand-in card's driver, libcgpu and the queue client (tests/queue_client.py)."""
    from queue_client import build
    from test_libcgpu import build_libs

    d = build_libs(tmp_path_factory.mktemp("coremem"))
    build(d)
    return d


def test_30_percent_on_the_stand_in_card_is_30_percent_of_its_work_with_host_work_between_kernels(
        make_daemon, card_libs, tmp_path):
    """A gated instance (libcgpu, the switcher) at 30 % whose job leaves the card idle a third of its
    gate's time (a 2 ms kernel, a synchronize, 1 ms of host work): charged its GPU time, it is owed the
    rest as gate time, and that comes out of the wasted slots, so it still gets 30 % of the card's time
    (its kernel time over the window, from the card's log). Before: the owed gate time stretched the
    cycle past 20 slices and it got 0.25."""
    from queue_client import kernels

    d = make_daemon(extra_args=["--libcgpu", os.fspath(card_libs / "libcgpu.so"), "--compute", "gate"])
    name = f"cmcard{os.getpid() % 1000000:06d}"
    env = dict(os.environ, CGPUD_SOCKET=str(d.socket), LD_LIBRARY_PATH=os.fspath(card_libs),
               CGPU_STUB_CUDA_STATE=os.fspath(tmp_path / "card"), CGPU_STUB_CUDA_LOG=os.fspath(tmp_path / name),
               Q=os.fspath(card_libs / "queue-client"))
    p = subprocess.run([str(Path(sys.executable).parent / "cgpu"), "run", "--name", name, "--mem", "64M",
                        "--core", "30", "--", "sh", "-c",
                        'export CGPU_STUB_CUDA_DEVICE="$CGPU_DEVICE"; exec "$Q" host 4 2000 1000'],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert d.read("0/policy").strip() == "3" and d.read("0/max_inst").strip() == "20"
    ks = kernels(tmp_path / name)
    t0, t1 = min(s for _, s, _ in ks) + 300_000_000, max(e for _, _, e in ks) - 300_000_000
    assert t1 - t0 > 2e9
    share = sum(max(0, min(e, t1) - max(s, t0)) for _, s, e in ks) / (t1 - t0)
    # 0.30 of the card (SPEC §5: a share is the work the GPU did for the instance); the job alone
    # without cgpud keeps the card busy about 0.66, so 30 % of what it does alone would be 0.20
    assert 0.27 <= share <= 0.34, share
