"""podman end to end (issue 4): `podman run --hooks-dir DIR` with
deploy/hooks.d/cgpu-hook.json (the compiled `cgpu-hook auto`), a busybox `--rootfs`,
against a real daemon. The container appears as its 12-character short ID
(what `podman ps` shows, and its hostname) with the seed's memsize, is
scheduled through its own cgroup, and is gone after it exits; a bad value
fails `podman run` with the hook's line; a container without the variables
is left alone.

podman is isolated from the host's configuration and from other runs: a
temporary containers.conf (CONTAINERS_CONF) and storage.conf
(CONTAINERS_STORAGE_CONF), `--root`/`--runroot`/`--tmpdir` under tmp_path,
the vfs driver, file locks, cgroupfs, file events, no network, no systemd.
Two settings this host needs (docs/containers.md, "podman"):
- runc, not crun: this host mounts cgroups in hybrid mode (v1 controllers and
  cgroup2 at /sys/fs/cgroup/unified), which crun 1.8 refuses ("cgroups in
  hybrid mode not supported").
- `default_ulimits` with nofile at most the hard limit the test runs under:
  podman gives a root container nofile=1048576 by default and the runtime
  cannot raise its hard limit without CAP_SYS_RESOURCE, which this sandbox
  does not grant (nofile hard 20000 here).
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import SIM_T4_BYTES
from test_runc import _tool, compiled_hook, targets

ROOT = Path(__file__).parent.parent
# A real-time container's budget (Podman.run(realtime=True)): 20 % of a CPU in each 100 ms (its launching
# thread takes about 12 % at 1 ms kernels); the run's parent group holds three such containers' worth (the
# two launchers and their reference), 60 % of the 95 % the host gives real time: a second run at once waits
# (RT_WAIT_S) for the first's end.
RT_PERIOD_US, RT_RUNTIME_US = 100_000, 20_000
RT_PARENT_US, RT_WAIT_S = 600_000, 300


class Podman:
    """An isolated podman for one daemon (bench/hook.py --podman uses it too);
    `cleanup()` removes its containers, cgroups, mounts and files."""

    def __init__(self, daemon) -> None:
        # short: podman refuses a runroot longer than 50 characters
        self.tmp = tmp = Path(tempfile.mkdtemp(prefix="cgpm-", dir="/tmp"))
        self.exe = _tool("podman")
        _tool("runc")
        _tool("conmon")
        self.rootfs = tmp / "rootfs"
        (self.rootfs / "bin").mkdir(parents=True)
        shutil.copy(_tool("busybox"), self.rootfs / "bin" / "busybox")
        for applet in ("sh", "sleep", "echo", "hostname", "cat", "true"):
            os.symlink("busybox", self.rootfs / "bin" / applet)
        for d in ("proc", "sys", "dev", "etc", "tmp", "cgpu"):
            (self.rootfs / d).mkdir(exist_ok=True)
        # hooks.d: the shipped file, with this venv's cgpu-hook and the test daemon's socket
        spec = json.loads((ROOT / "deploy" / "hooks.d" / "cgpu-hook.json").read_text())
        spec["hook"].update(path=compiled_hook(), env=[f"CGPUD_SOCKET={daemon.socket}"])
        self.hooks = tmp / "hooks.d"
        self.hooks.mkdir()
        (self.hooks / "cgpu-hook.json").write_text(json.dumps(spec))
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nproc = min(32768, resource.getrlimit(resource.RLIMIT_NPROC)[1])  # podman runs conmon at 32768
        conf = tmp / "containers.conf"
        conf.write_text(
            "[containers]\n"
            f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
            "[engine]\n"
            'lock_type = "file"\n'
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n'
            'runtime = "runc"\n'
        )
        storage = tmp / "storage.conf"
        storage.write_text(f'[storage]\ndriver = "vfs"\nrunroot = "{tmp}/runroot"\ngraphroot = "{tmp}/root"\n')
        self.env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "HOME": os.fspath(tmp),
                    "CONTAINERS_CONF": os.fspath(conf), "CONTAINERS_STORAGE_CONF": os.fspath(storage),
                    "XDG_CONFIG_HOME": os.fspath(tmp / "config")}
        self.base = [self.exe, "--root", f"{tmp}/root", "--runroot", f"{tmp}/runroot", "--tmpdir", f"{tmp}/tmp",
                     "--storage-driver", "vfs", "--cgroup-manager", "cgroupfs", "--events-backend", "file",
                     "--runtime", "runc", "--hooks-dir", os.fspath(self.hooks)]
        self.ids: list[str] = []
        # our own cgroup parent, removed at cleanup (podman's default, /libpod_parent, would stay behind)
        self.cgroup_parent = f"/{tmp.name}"

    def __call__(self, *args: str, timeout: float = 60, hooks: bool = True) -> subprocess.CompletedProcess:
        base = self.base if hooks else [a for a in self.base if a not in ("--hooks-dir", os.fspath(self.hooks))]
        return subprocess.run(base + list(args), capture_output=True, text=True, env=self.env,
                              stdin=subprocess.DEVNULL, timeout=timeout)

    def run(self, env: dict[str, str], *cmd: str, detach: bool = False, volumes=(),
            hooks: bool = True, caps=(), realtime: bool = False) -> subprocess.CompletedProcess:
        """realtime: the container may run a thread at a real-time priority (a launcher's, so that the
        kernel time it gets measures the scheduler, not the machine's load): CAP_SYS_NICE, and where the
        kernel schedules real time by cgroup (CONFIG_RT_GROUP_SCHED, cgroup v1: a group without a budget
        refuses SCHED_RR with EPERM whatever its capabilities) a budget for its cgroup."""
        args = ["run", "--network", "none", "--cgroup-parent", self.cgroup_parent]
        if realtime:
            caps = (*caps, "SYS_NICE")
            args += self._rt_budget()
        for c in caps:  # (capabilities added: SYS_NICE for a launcher at a real-time priority)
            args += ["--cap-add", c]
        args += ["-d"] if detach else ["--rm"]
        for k, v in env.items():
            args += ["-e", f"{k}={v}"]
        for v in volumes:
            args += ["-v", v]
        p = self(*args, "--rootfs", os.fspath(self.rootfs), *cmd, hooks=hooks)  # --rootfs: the first argument is a directory
        if detach and p.returncode == 0:
            self.ids.append(p.stdout.strip())
        return p

    def _rt_budget(self) -> list[str]:
        """podman's options giving a container RT_RUNTIME_US of each RT_PERIOD_US for its real-time
        threads, once this run's parent group has RT_PARENT_US of the host's (none where the host has
        no real-time group scheduling: nothing to give)."""
        cpu = Path("/sys/fs/cgroup/cpu")
        if not (cpu / "cpu.rt_runtime_us").exists():
            return []
        parent = cpu / self.cgroup_parent.lstrip("/")
        parent.mkdir(exist_ok=True)  # (podman makes it otherwise; cleanup() removes it either way)
        deadline = time.monotonic() + RT_WAIT_S
        while True:
            try:
                (parent / "cpu.rt_runtime_us").write_text(str(RT_PARENT_US))
                break
            except OSError as exc:  # EINVAL: other runs' groups hold what the host's root group has
                if time.monotonic() > deadline:
                    pytest.fail(f"giving {parent} {RT_PARENT_US} µs of real time a second: {exc} (other groups "
                                f"held the host's real-time budget for {RT_WAIT_S} s: "
                                "/sys/fs/cgroup/cpu/*/cpu.rt_runtime_us)")
                time.sleep(0.5)
        return ["--cpu-rt-period", str(RT_PERIOD_US), "--cpu-rt-runtime", str(RT_RUNTIME_US)]

    def cleanup(self) -> None:
        self("rm", "-a", "-f", "-t", "0")  # every container of this private store, failed starts included
        name = self.cgroup_parent.lstrip("/")
        root = Path("/sys/fs/cgroup")  # cgroup2 itself, or each v1 hierarchy and unified/ under it
        left = [g for g in {root / name, *(h / name for h in root.iterdir() if h.is_dir())} if g.is_dir()]
        deadline = time.monotonic() + 5  # conmon (in <parent>/conmon) may still be on its way out
        while left and time.monotonic() < deadline:
            for g in list(left):
                for sub in sorted((d for d in g.rglob("*") if d.is_dir()), reverse=True):
                    _rmdir(sub)
                if _rmdir(g):
                    left.remove(g)
            if left:
                time.sleep(0.05)
        mounts = [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()
                  if ln.split()[4].startswith(f"{self.tmp}/")]
        for m in sorted(mounts, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _rmdir(path: Path) -> bool:
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False  # still populated: a process on its way out
    return True


@pytest.fixture
def podman(daemon) -> Podman:
    p = Podman(daemon)
    yield p
    p.cleanup()


def test_podman_run_registers_schedules_and_removes_the_container(daemon, podman):
    p = podman.run({"ALIYUN_COM_GPU_MEM_CONTAINER": "6", "ALIYUN_COM_GPU_MEM_DEV": "15"},
                   "sh", "-c", "exec 3< /dev/simgpu0; while :; do :; done", detach=True,
                   volumes=[f"{daemon.dev_dir / 'simgpu0'}:/dev/simgpu0"])
    assert p.returncode == 0, p.stderr
    cid = p.stdout.strip()
    assert len(cid) == 64
    short = podman("ps", "--no-trunc=false", "--format", "{{.ID}}").stdout.split()
    assert short == [cid[:12]]  # podman ps's ID is the instance's name
    assert daemon.instances(0) == [cid[:12]]
    assert daemon.value(f"0/{cid[:12]}/memsize") == str(SIM_T4_BYTES * 6 // 15) == "6337173913"
    t = targets(daemon)[cid[:12]]
    assert t["container"] == cid and t["path"].endswith(cid)  # its own cgroup, libpod-<ID>
    # scheduled: alone at weight 1 under policy 3 it runs 1/16 of the time, frozen the rest
    daemon.write("0/policy", "3")
    control = Path(t["path"]) / ("cgroup.events" if t["kind"] == "cgroup2" else "freezer.state")
    seen = set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(seen) < 2:
        text = control.read_text()
        if t["kind"] == "cgroup2":
            seen |= {ln.split()[1] for ln in text.splitlines() if ln.startswith("frozen ")}
        else:
            seen.add(text.strip())
        time.sleep(0.003)
    assert len(seen) == 2, f"states seen: {seen}"
    daemon.write("0/policy", "0")
    rm = podman("rm", "-f", "-t", "0", cid)
    assert rm.returncode == 0, rm.stderr
    podman.ids.remove(cid)
    assert daemon.instances(0) == []
    assert targets(daemon) == {}


def test_podman_container_sees_itself_and_is_gone_after_exit(daemon, podman):
    """A foreground `podman run --rm`: the container reads its own memsize
    from the tree by its hostname (podman's short ID); after it exits the
    instance is gone."""
    p = podman.run({"ALIYUN_COM_GPU_MEM_CONTAINER": "3"},
                   "sh", "-c", "read m < /cgpu/0/$(hostname)/memsize && echo $(hostname) $m",
                   volumes=[f"{daemon.mount}:/cgpu:ro"])
    assert p.returncode == 0, p.stderr
    name, memsize = p.stdout.split()
    assert len(name) == 12 and memsize == str(3 << 30)
    assert daemon.instances(0) == []


def test_podman_bad_value_fails_the_run_and_registers_nothing(daemon, podman):
    before = daemon.snapshot()
    p = podman.run({"ALIYUN_COM_GPU_MEM_CONTAINER": "six"}, "echo", "ran")
    assert p.returncode != 0 and "ran" not in p.stdout
    assert ("cgpu hook: ALIYUN_COM_GPU_MEM_CONTAINER=six: six is not a whole number; "
            "give whole GiB per GPU, e.g. 6 or 3,4,5,6") in p.stderr, p.stderr
    assert daemon.snapshot() == before
    p = podman.run({"ALIYUN_COM_GPU_MEM_CONTAINER": "16", "ALIYUN_COM_GPU_MEM_DEV": "15"}, "echo", "ran")
    assert p.returncode != 0 and "ALIYUN_COM_GPU_MEM_CONTAINER=16: 16 GiB is more than" in p.stderr, p.stderr
    assert daemon.snapshot() == before
    assert podman("ps", "-a", "-q").stdout.split() == []  # --rm: nothing left behind either


def test_podman_without_variables_is_left_alone(daemon, podman):
    before = daemon.snapshot()
    p = podman.run({}, "echo", "ran")
    assert p.returncode == 0 and p.stdout == "ran\n", p.stderr
    p = podman.run({"CGPU_DISABLE": "true", "ALIYUN_COM_GPU_MEM_CONTAINER": "6"}, "echo", "ran")
    assert p.returncode == 0 and p.stdout == "ran\n", p.stderr
    assert daemon.snapshot() == before


def glibc_podman(make_daemon, tmp_path: Path, *extra: str) -> tuple:
    """A daemon with libcgpu, a podman with hooks.d, and a root filesystem of the host's /usr (mounted
    read-only) with /share: the stand-in libcuda in /share/lib. (daemon, podman, share, libs)."""
    from test_libcgpu import build_libs

    libs = build_libs(tmp_path / "libs")
    d = make_daemon(extra_args=["--libcgpu", os.fspath(libs / "libcgpu.so"), *extra])
    podman = Podman(d)
    share = tmp_path / "share"
    (share / "lib").mkdir(parents=True)
    shutil.copy(libs / "libcuda.so.1", share / "lib" / "libcuda.so.1")
    rootfs = podman.tmp / "glibc-rootfs"
    for sub in ("usr", "proc", "dev", "sys", "etc", "tmp", "share"):
        (rootfs / sub).mkdir(parents=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        os.symlink(f"usr/{link}", rootfs / link)
    podman.rootfs = rootfs
    return d, podman, share, libs


# every way a container's process could shorten or replace its limits page, each said if it did
CHANGE_LIMITS = ("for t in 'truncate -s 0 /run/cgpu/limits' 'mv -f /run/cgpu/usage /run/cgpu/limits' "
                 "'rm -f /run/cgpu/limits' 'ln -f /run/cgpu/limits /run/cgpu/again'; "
                 "do sh -c \"$t\" 2>/dev/null && echo \"changed: $t\"; done")


def test_a_hooks_d_podman_container_gets_the_library_from_the_hook(make_daemon, tmp_path):
    """No cgpu-runtime: podman runs runc with hooks.d only. At createRuntime the daemon mounts the
    library, the container's pages and /etc/ld.so.preload into the container's mount namespace;
    no environment can be set from a hook, and none is needed: the container's own process (a C
    client, its libcuda the stand-in) sees 1 GiB as the card and is refused one byte past it. It
    cannot write, cut, replace, remove or link its limits page (the daemon maps it)."""
    from test_libcgpu import MOUNT_CLIENT

    d, podman, share, _ = glibc_podman(make_daemon, tmp_path)
    try:
        rootfs = podman.rootfs
        (tmp_path / "client.c").write_text(MOUNT_CLIENT)
        subprocess.run(["gcc", "-o", os.fspath(share / "client"), os.fspath(tmp_path / "client.c"), "-ldl"], check=True)
        p = podman.run({"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "LD_LIBRARY_PATH": "/share/lib",
                        "CGPU_STUB_CUDA_STATE": "/share/card"},
                       "sh", "-c", "/share/client && cat /etc/ld.so.preload && " + CHANGE_LIMITS
                       + "; echo x > /run/cgpu/limits", volumes=["/usr:/usr:ro", f"{share}:/share"])
        out = p.stdout.split()
        assert out[:5] == [str(1 << 30), "0", "2", "(null)", "/run/cgpu-lib/libcgpu.so"], p.stdout + p.stderr
        assert p.returncode != 0 and "Read-only file system" in p.stderr, "the container wrote its limits"
        assert "changed:" not in p.stdout, p.stdout  # (the daemon maps it: docs/isolation.md, "The pages")
        assert not (d.socket.parent / "pages").exists() or not list((d.socket.parent / "pages").iterdir()), \
            "its pages went with it"
        # an image whose /run is a symbolic link (absolute: before the pivot it would name the host's
        # /tmp): no mount is made through it, and the container does not start
        shutil.rmtree(rootfs / "run", ignore_errors=True)  # (podman made it for the first run)
        os.symlink("/tmp", rootfs / "run")
        bad = podman.run({"ALIYUN_COM_GPU_MEM_CONTAINER": "1"}, "/share/client", volumes=["/usr:/usr:ro"])
        assert bad.returncode != 0 and "/run is a symbolic link in the image" in bad.stderr, bad.stdout + bad.stderr
        assert not Path("/tmp/cgpu-lib").exists() and not Path("/tmp/cgpu").exists()
    finally:
        podman.cleanup()


def realtime_threads(podman: Podman, cid: str, timeout: float = 30) -> int:
    """How many threads of the container's first process run at SCHED_RR, once one does (the launcher
    sets its launching thread so after cuInit: it cannot say whether that was refused, the host can)."""
    pid = podman("inspect", "--format", "{{.State.Pid}}", cid).stdout.strip()
    deadline = time.monotonic() + timeout
    while True:
        policies = []
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            policies.append(int(stat[stat.rindex(")") + 2:].split()[38]))  # (field 41, policy)
        if policies.count(os.SCHED_RR) or time.monotonic() > deadline or not policies:
            return policies.count(os.SCHED_RR)
        time.sleep(0.05)


def test_two_hooks_d_containers_share_a_gpu_1_to_2_through_the_gate(make_daemon, tmp_path):
    """Two podman containers (hooks.d only) on one simulated GPU, weights 1 and 2 (the hook sets
    policy 2), each launching 1 ms kernels on the shared stand-in card while a CPU loop runs beside:
    their kernel time is 1:2 through their gates, and the weight-1 container's CPU loop is not
    stopped with its launches: it stands still no longer than the same loop in a container without a
    GPU beside them (what the machine's load alone does to it).
    The launching threads run at a real-time priority (the containers get the budget for it), so the
    kernel time measures the scheduler, not the machine's load (at load 17 it read 2.78 without)."""
    from test_gate import LAUNCHER, median_ratio, wait_together

    d, podman, share, _ = glibc_podman(make_daemon, tmp_path, "--compute", "gate")
    try:
        (tmp_path / "launcher.c").write_text(LAUNCHER)
        subprocess.run(["gcc", "-O2", "-o", os.fspath(share / "launcher"), os.fspath(tmp_path / "launcher.c"),
                        "-ldl", "-lpthread"], check=True)
        volumes = ["/usr:/usr:ro", f"{share}:/share"]
        # the same launcher and CPU loop in a container of no GPU (the hook leaves it alone), on a stand-in card
        # of its own (no gate), from before the first launcher to the end: what the machine's load does to the
        # loop beside a real-time launching thread of its own, over the same time as the weight-1 container's
        # (a loop alone, for a fixed 6 s, read 0.36-0.46 where the loops of both GPU containers read 0.56-0.76)
        p = podman.run({"LAUNCHER_UNTIL": "/share/stop", "LD_LIBRARY_PATH": "/share/lib",
                        "CGPU_STUB_CUDA_STATE": "/share/ref-card", "CGPU_STUB_CUDA_LOG": "/share/ref.kernels"},
                       "/share/launcher", "0", "1000", "1", detach=True, realtime=True, volumes=volumes)
        assert p.returncode == 0, p.stderr
        ref = p.stdout.strip()
        ids = {}
        for name, weight in (("one", 1), ("two", 2)):  # (launching until /share/stop: however long starts take)
            p = podman.run({"ALIYUN_COM_GPU_MEM_CONTAINER": "1", "ALIYUN_COM_GPU_SCHD_WEIGHT": str(weight),
                            "LD_LIBRARY_PATH": "/share/lib", "CGPU_STUB_CUDA_STATE": "/share/card",
                            "CGPU_STUB_CUDA_LOG": f"/share/{name}.kernels", "CGPU_STUB_CUDA_DEVICE": "/dev/simgpu0",
                            "LAUNCHER_UNTIL": "/share/stop"},
                           "/share/launcher", "0", "1000", "1", detach=True, realtime=True,
                           volumes=[*volumes, f"{d.dev_dir / 'simgpu0'}:/dev/simgpu0"])
            assert p.returncode == 0, p.stderr
            ids[name] = p.stdout.strip()
            assert realtime_threads(podman, ids[name]) >= 1, f"{name}'s launching thread is not at a real-time priority"
        assert d.value("0/policy") == "2"
        # both launch now: until they have run 6 s together, then all three stop
        logs = [share / "one.kernels", share / "two.kernels"]
        wait_together(logs, 6.0)
        (share / "stop").touch()
        outs = {"ref": podman("wait", ref, timeout=60)}
        assert outs["ref"].stdout.strip() == "0", outs["ref"].stdout + outs["ref"].stderr
        outs["ref"] = podman("logs", ref).stdout.split()
        for name, cid in ids.items():
            w = podman("wait", cid, timeout=60)
            assert w.stdout.strip() == "0", w.stdout + w.stderr
            outs[name] = podman("logs", cid).stdout.split()
        kernels = [[tuple(map(int, line.split())) for line in lg.read_text().splitlines()] for lg in logs]
        t0 = max(k[0][1] for k in kernels) + 300_000_000
        t1 = min(k[-1][2] for k in kernels) - 300_000_000
        assert t1 - t0 > 3e9
        ratio = median_ratio(logs, t0, t1)
        # (within a factor 1.3 of 2 either way: the per-second median of two containers' launchers read
        # 2.504 once on an otherwise idle CI machine; equal weights read ~1.0)
        assert 1.54 <= ratio <= 2.6, ratio
        # ("started", launches, beats/s, stood still): frozen with its launches it would stand still 2/3
        stood, loaded = float(outs["one"][3]), float(outs["ref"][3])
        assert stood < max(0.25, loaded + 0.15), outs
    finally:
        podman.cleanup()
