"""The NVML backend (`--gpus nvml`) and the memory watchdog, without a GPU:
the real pynvml binding loads a stand-in libnvidia-ml.so.1 (native/stubs/libnvidia-ml.c,
built with gcc here) through LD_LIBRARY_PATH, and the tests script what it
reports — GPUs, their processes and memory, failing calls."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cgpud.containers.cgroups import v2_root
from cgpud.client import Client
from conftest import cgpud_script
from nvml_stub import MIB, T4_TOTAL, NvmlStub, StubGpu
from test_cgpu_run import wait_for

GIB = 1 << 30
UUID0 = "GPU-1c5b6f0e-aaaa-4d3e-9a51-0123456789ab"
UUID1 = "GPU-2d6c7a1f-bbbb-4e4f-8b62-fedcba987654"
A10_TOTAL = 23028 * MIB


@pytest.fixture(scope="module")
def libdir(tmp_path_factory) -> Path:
    return NvmlStub.build(tmp_path_factory.mktemp("nvml")).libdir


@pytest.fixture
def stub(libdir, tmp_path) -> NvmlStub:
    s = NvmlStub(libdir, tmp_path / "nvml-stub.conf")
    s.gpus = [StubGpu(UUID0, "Tesla T4", T4_TOTAL, util=37, memutil=12),
              StubGpu(UUID1, "NVIDIA A10", A10_TOTAL, minor=3)]
    s.write()
    return s


def py(stub: NvmlStub, code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**stub.env(), **env}, capture_output=True,
                          text=True, timeout=30)


def discover_json(stub: NvmlStub, **env) -> subprocess.CompletedProcess:
    return py(stub, "import dataclasses, json; from cgpud.gpus import discover; "
                    "print(json.dumps([dataclasses.asdict(g) for g in discover('nvml')]))", **env)


# ---- discovery and queries through the real binding ----------------------------------------


def test_discovery_gives_index_uuid_name_memory_and_minor(stub):
    r = discover_json(stub)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [
        {"index": 0, "uuid": UUID0, "name": "Tesla T4", "memory": T4_TOTAL, "major": 195, "minor": 0},
        {"index": 1, "uuid": UUID1, "name": "NVIDIA A10", "memory": A10_TOTAL, "major": 195, "minor": 3},
    ]


def test_processes_memory_and_utilisation(stub):
    stub.procs = {(0, 4242): 3 * GIB, (0, 4243): 512 * MIB, (1, 77): 1}
    stub.write()
    r = py(stub, "import json; from cgpud.gpus.nvml import Nvml\n"
                 "with Nvml() as nv:\n"
                 "    print(json.dumps([[s.index, s.procs, s.memory_used, s.memory_total, s.utilization,"
                 " s.memory_utilization] for s in nv.sample()]))\n"
                 "    print(nv.driver_version())")
    assert r.returncode == 0, r.stderr
    samples, driver = r.stdout.splitlines()
    assert json.loads(samples) == [
        [0, {"4242": 3 * GIB, "4243": 512 * MIB}, 3 * GIB + 512 * MIB, T4_TOTAL, 37, 12],
        [1, {"77": 1}, 1, A10_TOTAL, 0, 0],
    ]
    assert driver == "550.54.15"


def test_a_driver_without_the_v3_process_call_is_asked_with_v2(stub, tmp_path):
    old = NvmlStub.build(tmp_path / "old", old_driver=True)
    stub.procs = {(0, 4242): 3 * GIB}
    stub.write()
    r = py(NvmlStub(old.libdir, stub.config), "from cgpud.gpus.nvml import Nvml\n"
                                              "with Nvml() as nv:\n    print(nv.processes(0), nv.processes(0))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{{4242: {3 * GIB}}} {{4242: {3 * GIB}}}"


# ---- errors: one line each ----------------------------------------------------------------


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0
    err = r.stderr.strip()
    assert "Traceback" not in err, err
    assert err.count("\n") == 0, f"not one line:\n{err}"
    return err


def serve_fails(stub: NvmlStub, tmp_path: Path, *extra: str) -> str:
    """`cgpud serve --gpus nvml` must refuse to start: its one line."""
    r = subprocess.run([cgpud_script(), "serve", "--gpus", "nvml", "--mount", str(tmp_path / "mnt"),
                        "--state-dir", str(tmp_path / "state"), "--socket", str(tmp_path / "s.sock"), *extra],
                       env=stub.env(), capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    err = one_line_error(r)
    assert not (tmp_path / "state" / "state.json").exists(), "a refused start wrote state"
    return err


def test_no_library_is_one_clear_line(stub, tmp_path):
    """A libnvidia-ml.so.1 that cannot be loaded (here: not an ELF file, first
    in LD_LIBRARY_PATH, so this holds on a machine with a driver too)."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "libnvidia-ml.so.1").write_bytes(b"not a library")
    err = serve_fails(NvmlStub(broken, stub.config), tmp_path)
    assert err == ("Error: NVML not available: nvmlInit: NVML_ERROR_LIBRARY_NOT_FOUND (NVML Shared Library Not "
                   "Found), libnvidia-ml.so.1 is not on this machine; install the NVIDIA driver or use --gpus sim:T4")


def test_driver_not_loaded_is_one_clear_line(stub, tmp_path):
    stub.init_rc = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    stub.write()
    err = serve_fails(stub, tmp_path)
    assert err.startswith("Error: NVML not available: nvmlInit: NVML_ERROR_DRIVER_NOT_LOADED (Driver Not Loaded)")
    assert "use --gpus sim:T4" in err


@pytest.mark.parametrize("fn,rc,says", [
    ("nvmlDeviceGetUUID", 15, "GPU 1: nvmlDeviceGetUUID: NVML_ERROR_GPU_IS_LOST (GPU is lost); the GPU fell off"),
    ("nvmlDeviceGetMemoryInfo", 4, "GPU 1: nvmlDeviceGetMemoryInfo: NVML_ERROR_NO_PERMISSION (Insufficient "
                                   "Permissions); run cgpud as root"),
    ("nvmlDeviceGetHandleByIndex_v2", 999, "GPU 1: nvmlDeviceGetHandleByIndex: NVML_ERROR_UNKNOWN (Unknown Error)"),
])
def test_a_failing_device_query_is_one_clear_line(stub, tmp_path, fn, rc, says):
    stub.gpus[1].fail = {fn: rc}
    stub.write()
    assert serve_fails(stub, tmp_path).startswith(f"Error: {says}")


def test_no_gpu_and_missing_device_files_are_one_line(stub, tmp_path):
    stub.gpus = []
    stub.write()
    assert serve_fails(stub, tmp_path) == "Error: NVML sees no GPU on this machine (driver 550.54.15); use --gpus sim:T4"
    stub.gpus = [StubGpu(UUID0, minor=5)]
    stub.write()
    (tmp_path / "dev").mkdir()
    err = serve_fails(stub, tmp_path, "--dev-dir", str(tmp_path / "dev"))
    assert err.startswith(f"Error: GPU 0 ({UUID0}) has minor number 5, but {tmp_path}/dev/nvidia5 does not exist")


# ---- the daemon on NVML GPUs ------------------------------------------------------------------


@pytest.fixture
def nvml_daemon(make_daemon, stub, monkeypatch):
    """A daemon on the stub's two GPUs; device files nvidia0 and nvidia3 in its --dev-dir."""
    def start(*extra: str):
        for k, v in stub.env().items():
            monkeypatch.setenv(k, v)
        d = make_daemon(gpus="nvml", start=False, extra_args=extra)
        d.dev_dir.mkdir()
        for minor in (0, 3):
            (d.dev_dir / f"nvidia{minor}").write_text("")
        return d.start()
    return start


def query(daemon) -> dict:
    with Client(str(daemon.socket)) as c:
        return {"query": c.call("query"), "hello": c.call("hello")}


def test_daemon_serves_the_nvml_gpus(nvml_daemon):
    d = nvml_daemon()
    assert d.gpu_count() == 2
    assert d.value("0/major") == "195"
    d.create(1, "nvmlinst0001")
    assert d.value("1/nvmlinst0001/memsize") == str(A10_TOTAL)  # default_memsize 0: the whole device
    q = query(d)
    assert [(g["index"], g["uuid"], g["name"], g["memory"]) for g in q["query"]["gpus"]] == [
        (0, UUID0, "Tesla T4", T4_TOTAL), (1, UUID1, "NVIDIA A10", A10_TOTAL)]
    assert q["hello"]["devices"] == [str(d.dev_dir / "nvidia0"), str(d.dev_dir / "nvidia3")]
    state = json.loads((d.state_dir / "state.json").read_text())["state"]
    assert [g["uuid"] for g in state["gpus"]] == [UUID0, UUID1]
    assert "cgpud" in d.log_text() and "Tesla T4" in d.log_text()


class Run:
    """`cgpu run --mem MEM -- sleep 60` as instance `name`; `pid` is the sleep's."""

    def __init__(self, daemon, name: str, mem: str, cmd: tuple[str, ...] = ("sleep", "60")) -> None:
        self.name = name
        env = dict(os.environ, CGPUD_SOCKET=str(daemon.socket))
        bindir = Path(sys.executable).parent
        self.proc = subprocess.Popen([str(bindir / "cgpu"), "run", "--name", name, "--mem", mem, "--", *cmd],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.group = Path(v2_root()) / "cgpud" / name
        procs = self.group / "cgroup.procs"
        wait_for(lambda: procs.exists() and procs.read_text().split(), timeout=10, what=f"{name}'s command to start")
        self.pid = int(procs.read_text().split()[0])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            (self.group / "cgroup.freeze").write_text("0")  # (the daemon thaws too; do not wait for it)
            os.kill(self.pid, signal.SIGTERM)
            self.proc.wait(10)


@pytest.fixture
def runs():
    made: list[Run] = []
    yield made
    for r in made:
        r.stop()


def test_the_scheduler_sees_a_process_open_its_nvidia_device(nvml_daemon, runs):
    """Activity on NVML GPUs is /dev/nvidia<minor> (here under --dev-dir) held
    open: `cgpu workload` opens CGPU_DEVICE, which cgpu run sets from the
    daemon's device list; alone under policy 0 it gets 1 slot of max_inst, so
    the scheduler freezes its cgroup for the other slots."""
    d = nvml_daemon()
    d.write("0/max_inst", "4")
    job = Run(d, f"busy{os.getpid() % 100000:05d}abc", "1G",
              (str(Path(sys.executable).parent / "cgpu"), "workload", "--seconds", "30"))
    runs.append(job)
    wait_for(lambda: "frozen 1" in (job.group / "cgroup.events").read_text(), timeout=10,
             what="the scheduler to freeze the instance outside its slot")
    with Client(str(d.socket)) as c:
        assert c.call("hello")["devices"][0] == str(d.dev_dir / "nvidia0")


def test_watchdog_kills_the_process_past_memsize_and_spares_the_one_below(nvml_daemon, stub, runs):
    d = nvml_daemon()
    tag = f"{os.getpid() % 100000:05d}"
    over, under = Run(d, f"over{tag}abc", "1G"), Run(d, f"undr{tag}abc", "1G")
    runs += [over, under]
    stub.procs = {(0, over.pid): GIB - MIB, (0, under.pid): 512 * MIB}
    stub.write()
    wait_for(lambda: f"PID: {under.pid} Mem: {512 * MIB}" in d.read(f"0/{under.name}/meminfo"), timeout=10,
             what="the watchdog's first look")
    assert d.read(f"0/{over.name}/meminfo") == f"Free: {MIB}\nPID: {over.pid} Mem: {GIB - MIB}\n"
    assert over.alive() and under.alive(), "killed below memsize"
    stub.procs[(0, over.pid)] = GIB + MIB  # one MiB past memsize
    stub.write()
    assert over.proc.wait(10) == 128 + signal.SIGKILL  # cgpu run passes the command's death on
    log = d.log_text()
    assert (f"memory watchdog: {over.name} on GPU 0 uses {GIB + MIB} bytes, past its memsize {GIB}: pid {over.pid} "
            f"(sleep) holds {GIB + MIB} bytes; SIGKILL sent (--mem-action kill)") in log
    assert under.alive()
    assert not [line for line in log.splitlines() if "memory watchdog:" in line and under.name in line]
    assert d.read(f"0/{under.name}/meminfo") == f"Free: {512 * MIB}\nPID: {under.pid} Mem: {512 * MIB}\n"


def test_mem_action_log_leaves_the_process_running_and_says_so_once(nvml_daemon, stub, runs):
    d = nvml_daemon("--mem-action", "log")
    over = Run(d, f"logs{os.getpid() % 100000:05d}abc", "1G")
    runs.append(over)
    # 3 GiB on GPU 1, where it has no instance: not counted against its memsize on GPU 0
    stub.procs = {(1, over.pid): 3 * GIB, (0, over.pid): 512 * MIB}
    stub.write()
    wait_for(lambda: f"Mem: {512 * MIB}" in d.read(f"0/{over.name}/meminfo"), timeout=10, what="a look")
    line = f"memory watchdog: {over.name} on GPU 0 uses"
    assert line not in d.log_text()
    stub.procs = {(0, over.pid): 2 * GIB}
    stub.write()
    line = f"memory watchdog: {over.name} on GPU 0 uses {2 * GIB} bytes, past its memsize {GIB}"
    wait_for(lambda: line in d.log_text(), timeout=10, what="the watchdog's log line")
    time.sleep(1.2)  # two more looks: still over, not logged again, not killed
    assert over.alive()
    assert d.log_text().count(line) == 1
    assert "left running (--mem-action log)" in d.log_text()


def test_meminfo_shows_the_larger_of_nvml_and_the_in_container_librarys_views(nvml_daemon, stub, runs, tmp_path):
    """An instance whose processes carry libcgpu (cgpu run preloads it when the daemon has it) says
    in its usage page what it holds; NVML says what the driver sees. Each look compares them:
    meminfo's Free is memsize less the larger; only NVML's view fails a process."""
    from cgpud.gpus import pages
    lib = tmp_path / "lib"
    subprocess.run(["make", "-s", "-C", str(Path(__file__).resolve().parent.parent / "native"), "libcgpu",
                    f"LIB={lib}"], check=True)
    d = nvml_daemon("--libcgpu", str(lib / "libcgpu.so"))
    job = Run(d, f"both{os.getpid() % 100000:05d}abc", "1G")
    runs.append(job)
    page = d.socket.parent / "pages" / job.name / "usage"
    assert pages.used(str(page.parent))[0] == 0, "cgpu run made the instance's pages"
    environ = (Path("/proc") / str(job.pid) / "environ").read_bytes().split(b"\0")
    assert f"LD_PRELOAD={lib / 'libcgpu.so'}".encode() in environ
    with open(page, "r+b") as f:  # what the library would write: 700 MiB held on its first GPU
        f.seek(8)
        f.write((700 * MIB).to_bytes(8, "little"))
    stub.procs = {(0, job.pid): 200 * MIB}  # the driver sees less (memory it has not touched yet)
    stub.write()
    wait_for(lambda: d.read(f"0/{job.name}/meminfo") == f"Free: {GIB - 700 * MIB}\nPID: {job.pid} Mem: {200 * MIB}\n",
             timeout=10, what="the library's view in meminfo")
    stub.procs = {(0, job.pid): 900 * MIB}  # the driver sees more (its contexts, or a way around the library)
    stub.write()
    wait_for(lambda: d.read(f"0/{job.name}/meminfo") == f"Free: {GIB - 900 * MIB}\nPID: {job.pid} Mem: {900 * MIB}\n",
             timeout=10, what="NVML's view in meminfo")
    with open(page, "r+b") as f:  # the container claims to hold more than its memsize: nobody is failed for it
        f.seek(8)
        f.write((2 * GIB).to_bytes(8, "little"))
    wait_for(lambda: d.read(f"0/{job.name}/meminfo").startswith("Free: 0\n"), timeout=10, what="a look")
    time.sleep(1.2)
    assert job.alive() and f"memory watchdog: {job.name}" not in d.log_text()


# ---- the watchdog's rule, on the model with real processes (no daemon) ------------------------


def _watchdog(action: str = "kill"):
    from cgpud.gpus.memwatch import MemWatchdog
    from cgpud.core.model import GpuInfo, Node

    node = Node([GpuInfo(0, UUID0, "Tesla T4", T4_TOTAL)])
    a = node.create_instance(0, "instanceaaaa", memsize=GIB)
    b = node.create_instance(0, "instancebbbb", memsize=GIB)
    where: dict[int, object] = {}
    wd = MemWatchdog(node, lambda pid, gpu: where.get(pid), action)
    return wd, a, b, where


def test_a_library_figure_past_the_card_is_no_figure(sleepers):
    """A usage page the container filled with garbage says its processes hold 2**64 - 1 bytes: not
    taken (the GPU's `used`, the sum of its instances', would be garbage for everyone who reads it)."""
    from cgpud.gpus.memwatch import MemWatchdog

    wd, a, b, where = _watchdog()
    wd = MemWatchdog(wd.node, lambda pid, gpu: where.get(pid), "kill",
                     library=lambda inst: (1 << 64) - 1 if inst is a else 300 * MIB)
    p = sleepers()
    where[p.pid] = b
    assert wd.check(_sample({p.pid: 100 * MIB})) == []
    assert (a.library_used, b.library_used) == (0, 300 * MIB)
    assert wd.node.gpu(0).used == 300 * MIB


def _sample(procs: dict[int, int]):
    from cgpud.gpus.nvml import GpuSample

    return [GpuSample(0, procs, sum(procs.values()), T4_TOTAL, 0, 0)]


@pytest.fixture
def sleepers():
    made: list[subprocess.Popen] = []

    def make() -> subprocess.Popen:
        made.append(subprocess.Popen(["sleep", "60"]))
        return made[-1]
    yield make
    for p in made:
        p.kill()
        p.wait()


def test_watchdog_fails_the_process_that_grew_past_the_limit_and_counts_it(sleepers):
    wd, a, b, where = _watchdog()
    old, new, other = sleepers(), sleepers(), sleepers()
    where.update({old.pid: a, new.pid: a, other.pid: b})
    assert wd.check(_sample({old.pid: 700 * MIB, new.pid: 100 * MIB, other.pid: 900 * MIB})) == []
    assert a.procs == {old.pid: 700 * MIB, new.pid: 100 * MIB} and b.procs == {other.pid: 900 * MIB}
    # `new` grows past a's memsize; `old`, bigger but unchanged, is spared
    assert wd.check(_sample({old.pid: 700 * MIB, new.pid: 400 * MIB, other.pid: 900 * MIB})) == [
        (0, "instanceaaaa", new.pid)]
    assert new.wait(5) == -signal.SIGKILL
    assert old.poll() is None and other.poll() is None
    assert wd.kills == {(0, "instanceaaaa"): 1} and wd.over == {(0, "instanceaaaa"): 1}
    # still listed by the driver for a moment: not failed (or counted) twice
    assert wd.check(_sample({old.pid: 700 * MIB, new.pid: 400 * MIB})) == []
    assert wd.kills == {(0, "instanceaaaa"): 1}


def test_watchdog_never_signals_a_process_that_left_the_instance(sleepers):
    wd, a, b, where = _watchdog()
    p = sleepers()
    where[p.pid] = a
    wd.owner = lambda pid, gpu, calls=[]: (calls.append(pid), a if len(calls) == 1 else None)[1]
    assert wd.check(_sample({p.pid: 2 * GIB})) == [(0, "instanceaaaa", p.pid)]
    time.sleep(0.1)
    assert p.poll() is None, "signalled though its cgroup no longer belonged to the instance"
    assert wd.over == {(0, "instanceaaaa"): 1} and wd.kills == {}


def test_watchdog_log_and_term_actions(sleepers):
    wd, a, _, where = _watchdog("log")
    p = sleepers()
    where[p.pid] = a
    assert wd.check(_sample({p.pid: 2 * GIB})) == [(0, "instanceaaaa", p.pid)]
    assert wd.check(_sample({p.pid: 2 * GIB})) == []  # the same excess: once
    assert wd.check(_sample({p.pid: GIB})) == []      # back at memsize (allowed, to the byte)
    assert wd.check(_sample({p.pid: 2 * GIB})) == [(0, "instanceaaaa", p.pid)]  # a new excess: again
    assert p.poll() is None and wd.over == {(0, "instanceaaaa"): 2} and wd.kills == {}
    wd.action = "term"
    wd.check(_sample({p.pid: GIB}))
    assert wd.check(_sample({p.pid: GIB + 1})) == [(0, "instanceaaaa", p.pid)]
    assert p.wait(5) == -signal.SIGTERM and wd.kills == {(0, "instanceaaaa"): 1}


def test_a_gpu_that_stops_answering_is_logged_once_and_the_others_stay_watched(nvml_daemon, stub, runs):
    d = nvml_daemon()
    job = Run(d, f"lost{os.getpid() % 100000:05d}abc", "1G")
    runs.append(job)
    stub.gpus[1].fail = {"nvmlDeviceGetComputeRunningProcesses_v3": 15}  # GPU 1 falls off the bus
    stub.write()
    line = ("memory watchdog: GPU 1: nvmlDeviceGetComputeRunningProcesses: NVML_ERROR_GPU_IS_LOST (GPU is lost)")
    wait_for(lambda: line in d.log_text(), timeout=10, what="the NVML failure logged")
    stub.procs = {(0, job.pid): 2 * GIB}
    stub.write()
    assert job.proc.wait(10) == 128 + signal.SIGKILL, "GPU 0 was not watched while GPU 1 failed"
    stub.gpus[1].fail = {}
    stub.write()
    wait_for(lambda: "memory watchdog: NVML answers again (GPU 1:" in d.log_text(), timeout=10, what="recovery")
    assert d.log_text().count(line) == 1
    assert d.alive()
