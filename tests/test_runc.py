"""The OCI hook under a real runtime: runc runs busybox containers whose
config.json calls the hook at createRuntime and poststop — the compiled
forwarder `cgpu-hook` (native/hook/cgpu-hook.c) by default, `cgpu hook` where a
test is parametrized over `hook_form` — against a real daemon (SPEC §2,
issue 4). Nothing skips: without runc, busybox or the built `cgpu-hook`
(scripts/setup.sh makes all three) every test fails with the reason.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cgpud.client import Client
from cgpud.containers.hookd import short_name

from conftest import SIM_T4_BYTES

GIB = 1 << 30
CGPU = str(Path(sys.executable).parent / "cgpu")
CGPU_HOOK = Path(sys.executable).parent / "cgpu-hook"
HOOK_SOURCE = Path(__file__).parent.parent / "native" / "hook" / "cgpu-hook.c"
FORMS = ["c", "cli"]  # the compiled forwarder, and `cgpu hook`
CGROUP2 = "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run scripts/setup.sh (it installs runc and busybox-static)")
    return path


def compiled_hook() -> str:
    if not os.access(CGPU_HOOK, os.X_OK):
        pytest.fail(f"{CGPU_HOOK} is missing: run scripts/setup.sh (it builds native/hook/cgpu-hook.c)")
    if CGPU_HOOK.stat().st_mtime < HOOK_SOURCE.stat().st_mtime:
        pytest.fail(f"{CGPU_HOOK} is older than {HOOK_SOURCE}: run scripts/setup.sh to rebuild it")
    return os.fspath(CGPU_HOOK)


def hook_argv(form: str, stage: str) -> list[str]:
    """The command line of one hook form: argv[0] is the executable's path."""
    if form == "c":
        return [compiled_hook(), stage]
    if form == "cli":
        return [CGPU, "hook", stage]
    return [sys.executable, "-S", "-m", "cgpud.containers.hook", stage]


def hook_entry(form: str, stage: str, env: list[str]) -> dict:
    """A config.json hook entry for `form` (c, cli, or module: python3 -S -m cgpud.containers.hook)."""
    argv = hook_argv(form, stage)
    name = {"c": "cgpu-hook", "cli": "cgpu", "module": "python3"}[form]
    if form == "module":
        import cgpud
        env = env + [f"PYTHONPATH={os.path.dirname(os.path.dirname(os.path.abspath(cgpud.__file__)))}"]
    return {"path": argv[0], "args": [name, *argv[1:]], "env": env, "timeout": 20}


@pytest.fixture
def hook_form() -> str:
    """Which hook the bundles call; tests parametrize it over FORMS where cheap."""
    return "c"


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> dict:
    """`runc spec`'s config.json, made once."""
    _tool("runc")
    d = tmp_path_factory.mktemp("spec")
    subprocess.run(["runc", "spec"], cwd=d, check=True)
    return json.loads((d / "config.json").read_text())


class Runc:
    """Bundles and containers for one daemon, with a private runc --root."""

    def __init__(self, tmp: Path, template: dict, socket: str | os.PathLike, form: str = "c") -> None:
        self.form = form
        self.tmp = tmp
        self.template = template
        self.socket = os.fspath(socket)
        self.root = tmp / "runc-root"
        busybox = _tool("busybox")
        if "statically linked" not in subprocess.run(["file", "-L", busybox], capture_output=True, text=True).stdout \
                and "static" not in os.path.realpath(busybox):
            pytest.fail(f"{busybox} is not statically linked: install busybox-static (scripts/setup.sh)")
        self.rootfs = tmp / "rootfs"
        (self.rootfs / "bin").mkdir(parents=True)
        shutil.copy(busybox, self.rootfs / "bin" / "busybox")
        for applet in ("sh", "sleep", "cat", "ls", "test"):
            os.symlink("busybox", self.rootfs / "bin" / applet)
        self.started: list[str] = []

    def bundle(self, env: dict[str, str], args: list[str], *, mounts: list[dict] = (),
               hook_env: dict[str, str] | None = None, hooks: dict | None = None) -> Path:
        b = self.tmp / f"bundle-{secrets.token_hex(4)}"
        b.mkdir()
        c = json.loads(json.dumps(self.template))
        c["root"] = {"path": os.fspath(self.rootfs), "readonly": True}
        c["process"]["terminal"] = False
        c["process"]["args"] = args
        c["process"]["env"] = ["PATH=/bin"] + [f"{k}={v}" for k, v in env.items()]
        c["mounts"] = c["mounts"] + list(mounts)
        henv = [f"CGPUD_SOCKET={self.socket}"] + [f"{k}={v}" for k, v in (hook_env or {}).items()]
        c["hooks"] = {stage: [hook_entry(self.form, stage, henv)] for stage in ("createRuntime", "poststop")}
        if hooks is not None:
            c["hooks"] = hooks
        (b / "config.json").write_text(json.dumps(c))
        return b

    def cmd(self, *args: str) -> list[str]:
        return ["runc", "--root", os.fspath(self.root), *args]

    def run(self, bundle: Path, cid: str | None = None, timeout: float = 20) -> tuple[str, subprocess.CompletedProcess]:
        """`runc run` in the foreground until the container exits."""
        cid = cid or secrets.token_hex(32)
        p = subprocess.run(self.cmd("run", "--bundle", os.fspath(bundle), cid), stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=timeout)
        return cid, p

    def start(self, bundle: Path, cid: str | None = None) -> str:
        """`runc run -d`: the container keeps running; fails the test if it does not start."""
        cid = cid or secrets.token_hex(32)
        out = bundle / "out.log"
        with open(out, "w") as f:
            p = subprocess.run(self.cmd("run", "-d", "--bundle", os.fspath(bundle), cid), stdin=subprocess.DEVNULL,
                               stdout=f, stderr=subprocess.STDOUT, timeout=20)
        assert p.returncode == 0, f"runc run -d failed: {out.read_text()}"
        self.started.append(cid)
        return cid

    def delete(self, cid: str) -> subprocess.CompletedProcess:
        p = subprocess.run(self.cmd("delete", "-f", cid), capture_output=True, text=True, timeout=20)
        if cid in self.started:
            self.started.remove(cid)
        return p

    def pid(self, cid: str) -> int:
        out = subprocess.run(self.cmd("state", cid), capture_output=True, text=True, check=True).stdout
        return json.loads(out)["pid"]

    def cleanup(self) -> None:
        for cid in list(self.started):
            self.delete(cid)


@pytest.fixture
def runc(daemon, template, tmp_path, hook_form) -> Runc:
    r = Runc(tmp_path, template, daemon.socket, hook_form)
    yield r
    r.cleanup()


def query(daemon) -> dict:
    with Client(os.fspath(daemon.socket)) as c:
        return c.call("query")


def targets(daemon) -> dict[str, dict]:
    """name -> target, from the daemon's saved state."""
    state = json.loads((daemon.state_dir / "state.json").read_text())
    out = {}
    for g in state["state"]["gpus"]:
        for i in g.get("instances", []):
            out[i["name"]] = i.get("target")
    return out


SLEEP = ["sleep", "60"]


@pytest.mark.parametrize("hook_form", FORMS)
def test_two_containers_6_and_8_of_15_on_a_t4(daemon, runc):
    a = runc.start(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "6", "ALIYUN_COM_GPU_MEM_DEV": "15"}, SLEEP))
    b = runc.start(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "8", "ALIYUN_COM_GPU_MEM_DEV": "15"}, SLEEP))
    na, nb = a[:12], b[:12]
    assert daemon.value(f"0/{na}/memsize") == str(SIM_T4_BYTES * 6 // 15) == "6337173913"
    assert daemon.value(f"0/{nb}/memsize") == str(SIM_T4_BYTES * 8 // 15) == "8449565218"
    assert daemon.value(f"0/{na}/weight") == "1" and daemon.value("0/policy") == "0"
    # the target is the container's own cgroup: the one its init pid is in
    t = targets(daemon)[na]
    pid = runc.pid(a)
    own = [ln.split(":", 2)[2] for ln in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if ln.startswith("0::")]
    assert t == {"kind": "cgroup2", "path": CGROUP2 + own[0], "container": a}
    assert own[0] not in ("/", "") and str(pid) in (Path(t["path"]) / "cgroup.procs").read_text().split()
    # exit: directories gone, the other stays
    assert runc.delete(a).returncode == 0
    assert not os.path.exists(daemon.path(f"0/{na}"))
    assert daemon.instances(0) == [nb]
    assert runc.delete(b).returncode == 0
    assert daemon.instances(0) == []


@pytest.mark.parametrize("daemon", ["sim:4xT4"], indirect=True)
def test_four_gpus_per_gpu_lists_and_visible_devices(daemon, runc):
    a = runc.start(runc.bundle({"NVIDIA_VISIBLE_DEVICES": "0,1,2,3", "ALIYUN_COM_GPU_MEM_CONTAINER": "3,4,5,6"}, SLEEP))
    assert [daemon.value(f"{g}/{a[:12]}/memsize") for g in range(4)] == [str(n * GIB) for n in (3, 4, 5, 6)]
    runc.delete(a)
    b = runc.start(runc.bundle({"NVIDIA_VISIBLE_DEVICES": "all", "ALIYUN_COM_GPU_MEM_CONTAINER": "3,1"}, SLEEP))
    assert [daemon.value(f"{g}/{b[:12]}/memsize") for g in range(4)] == [str(n * GIB) for n in (3, 1, 1, 1)]
    runc.delete(b)
    assert all(daemon.instances(g) == [] for g in range(4))
    # by index, and by UUID
    c = runc.start(runc.bundle({"ALIYUN_COM_GPU_VISIBLE_DEVICES": "2", "ALIYUN_COM_GPU_MEM_CONTAINER": "5"}, SLEEP))
    assert [daemon.instances(g) for g in range(4)] == [[], [], [c[:12]], []]
    uuid3 = query(daemon)["gpus"][3]["uuid"]
    d = runc.start(runc.bundle({"ALIYUN_COM_GPU_VISIBLE_DEVICES": uuid3, "ALIYUN_COM_GPU_MEM_CONTAINER": "2"}, SLEEP))
    assert [daemon.instances(g) for g in range(4)] == [[], [], [c[:12]], [d[:12]]]
    assert daemon.value(f"3/{d[:12]}/memsize") == str(2 * GIB)
    # named nothing: placement picks (binpack: the fitting GPU with least free memory = GPU 2)
    e = runc.start(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "4"}, SLEEP))
    assert daemon.instances(2) == sorted([c[:12], e[:12]])
    for x in (c, d, e):
        runc.delete(x)
    assert all(daemon.instances(g) == [] for g in range(4))


def test_disabled_or_unset_is_left_alone(daemon, runc):
    before = daemon.snapshot()
    for env in ({"ALIYUN_COM_GPU_MEM_CONTAINER": "6", "CGPU_DISABLE": "true"}, {},
                {"ALIYUN_COM_GPU_MEM_CONTAINER": "0", "ALIYUN_COM_GPU_SCHD_WEIGHT": "lots"}):
        cid = runc.start(runc.bundle(env, SLEEP))
        assert daemon.snapshot() == before, env
        runc.delete(cid)
    _, p = runc.run(runc.bundle({"CGPU_DISABLE": "1", "ALIYUN_COM_GPU_MEM_CONTAINER": "6"}, ["sh", "-c", "echo ran"]))
    assert p.returncode == 0 and p.stdout == "ran\n", p.stderr
    assert daemon.snapshot() == before


def test_weight_sets_policy_2_and_high_priority(daemon, runc):
    a = runc.start(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "2", "ALIYUN_COM_GPU_SCHD_WEIGHT": "2"}, SLEEP))
    assert daemon.value("0/policy") == "2" and daemon.value(f"0/{a[:12]}/weight") == "2"
    assert daemon.value(f"0/{a[:12]}/highprio") == "0"
    b = runc.start(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "2", "ALIYUN_COM_GPU_HIGH_PRIO": "1"}, SLEEP))
    assert daemon.value(f"0/{b[:12]}/highprio") == "1" and daemon.value(f"0/{b[:12]}/weight") == "1"
    assert daemon.value("0/free_weight") == "13"


BAD = [
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "six"}, "ALIYUN_COM_GPU_MEM_CONTAINER=six: six is not a whole number"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "-1"}, "ALIYUN_COM_GPU_MEM_CONTAINER=-1: -1 is negative"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "2", "ALIYUN_COM_GPU_SCHD_WEIGHT": "17"}, "ALIYUN_COM_GPU_SCHD_WEIGHT=17: above"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "2", "ALIYUN_COM_GPU_SCHD_WEIGHT": "x"}, "ALIYUN_COM_GPU_SCHD_WEIGHT=x: x is not"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "2", "ALIYUN_COM_GPU_VISIBLE_DEVICES": "4"},
     "ALIYUN_COM_GPU_VISIBLE_DEVICES=4: no GPU 4 on this node"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "2", "ALIYUN_COM_GPU_VISIBLE_DEVICES": "GPU-00000000-dead-beef-0000-000000000000"},
     "ALIYUN_COM_GPU_VISIBLE_DEVICES=GPU-00000000-dead-beef-0000-000000000000: no GPU with UUID"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "15"}, "ALIYUN_COM_GPU_MEM_CONTAINER=15: 15 GiB is more than the 15109 MiB"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "16", "ALIYUN_COM_GPU_MEM_DEV": "15"}, "ALIYUN_COM_GPU_MEM_CONTAINER=16: 16 GiB is more than"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "2", "ALIYUN_COM_GPU_HIGH_PRIO": "yes"}, "ALIYUN_COM_GPU_HIGH_PRIO=yes: expected 1"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "2", "CGPU_DISABLE": "maybe"}, "CGPU_DISABLE=maybe: expected true"),
    # does not fit next to the 8 of 15 already there: placement's ENOSPC, named by the variable
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "8", "ALIYUN_COM_GPU_MEM_DEV": "15"}, "ALIYUN_COM_GPU_MEM_CONTAINER=8: no room for"),
]


def _hook_line(output: str) -> list[str]:
    """The distinct lines the hook printed, as runc quotes them in its own
    error lines (`… stderr: cgpu hook: …\\n"`)."""
    found = set()
    for ln in output.splitlines():
        if "cgpu hook: " in ln:
            m = re.search(r'stderr: (cgpu hook: .*?)(\\n)?"?$', ln)
            found.add(m.group(1) if m else ln)
    return sorted(found)


@pytest.mark.parametrize("hook_form", FORMS)
def test_bad_values_refuse_the_container_and_change_nothing(daemon, runc):
    holder = runc.start(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "8", "ALIYUN_COM_GPU_MEM_DEV": "15"}, SLEEP))
    before = daemon.snapshot()
    state_before = (daemon.state_dir / "state.json").read_text()
    for env, want in BAD:
        cid, p = runc.run(runc.bundle(env, ["sh", "-c", "echo ran"]))
        assert p.returncode != 0, (env, p.stdout, p.stderr)
        assert "ran" not in p.stdout, env
        lines = _hook_line(p.stderr)
        assert len(lines) == 1, (env, p.stderr)
        # runc quotes the hook's stderr inside its own error; the hook's line is one line
        assert want in lines[0], (env, lines[0])
        assert daemon.snapshot() == before, env
        assert (daemon.state_dir / "state.json").read_text() == state_before, env
        listed = subprocess.run(runc.cmd("list", "-q"), capture_output=True, text=True).stdout.split()
        assert cid not in listed, env
    assert daemon.instances(0) == [holder[:12]]


@pytest.mark.parametrize("hook_form", FORMS)
def test_hook_alone_prints_exactly_one_line(daemon, runc, tmp_path, hook_form):
    """The hook as the runtime calls it: exit 1 and one line on stderr."""
    b = runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "six"}, SLEEP)
    state = json.dumps({"ociVersion": "1.0.2", "id": "f" * 64, "pid": os.getpid(), "bundle": os.fspath(b)})
    p = subprocess.run(hook_argv(hook_form, "createRuntime"), input=state, capture_output=True, text=True,
                       env={"CGPUD_SOCKET": os.fspath(daemon.socket)}, timeout=20)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr == ("cgpu hook: ALIYUN_COM_GPU_MEM_CONTAINER=six: six is not a whole number; "
                        "give whole GiB per GPU, e.g. 6 or 3,4,5,6\n")
    # poststop of a container that registered nothing: fine, and nothing else removed
    good = runc.start(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "2"}, SLEEP))
    b2 = runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "2"}, SLEEP)
    other = json.dumps({"id": good[:12] + "-not-the-same", "bundle": os.fspath(b2)})
    p = subprocess.run(hook_argv(hook_form, "poststop"), input=other, capture_output=True, text=True,
                       env={"CGPUD_SOCKET": os.fspath(daemon.socket)}, timeout=20)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert daemon.instances(0) == [good[:12]]


def test_short_names():
    assert short_name("0123456789abcdef" * 4) == "0123456789ab"
    for cid in ("web", "my container with spaces", "ünïcode-container-id"):
        n = short_name(cid)
        assert len(n) == 12 and n.startswith("x") and n == short_name(cid)
    assert short_name("web") != short_name("web2")


@pytest.mark.parametrize("hook_form", FORMS)
def test_daemon_down_fails_clearly_or_passes_through(runc, daemon, tmp_path):
    gone = tmp_path / "no-daemon.sock"
    env = {"ALIYUN_COM_GPU_MEM_CONTAINER": "2"}
    r = Runc.__new__(Runc)
    r.__dict__.update(runc.__dict__, socket=os.fspath(gone))
    _, p = r.run(r.bundle(env, ["sh", "-c", "echo ran"]))
    assert p.returncode != 0 and "ran" not in p.stdout
    lines = _hook_line(p.stderr)
    assert len(lines) == 1 and f"cgpud is not running (nothing answers on {gone})" in lines[0], p.stderr
    assert "CGPU_HOOK_PASSTHROUGH=1" in lines[0]
    _, p = r.run(r.bundle(env, ["sh", "-c", "echo ran"], hook_env={"CGPU_HOOK_PASSTHROUGH": "1"}))
    assert p.returncode == 0 and p.stdout == "ran\n", p.stderr
    _, p = r.run(r.bundle({}, ["sh", "-c", "echo ran"]))  # unmanaged: the daemon is not needed
    assert p.returncode == 0 and p.stdout == "ran\n", p.stderr
    # poststop with the daemon down: one line, exit 0 (the daemon reaps a container whose cgroup is gone)
    state = json.dumps({"id": "a" * 64, "bundle": os.fspath(r.bundle(env, SLEEP)), "status": "stopped"})
    p = subprocess.run(hook_argv(r.form, "poststop"), input=state, capture_output=True, text=True,
                       env={"CGPUD_SOCKET": os.fspath(gone)}, timeout=20)
    assert p.returncode == 0 and p.stderr.count("\n") == 1 and "nothing removed now" in p.stderr, p.stderr
    # a daemon that accepts but never answers: the timeout, not a hang
    import socket as socketmod
    mute = tmp_path / "mute.sock"
    s = socketmod.socket(socketmod.AF_UNIX)
    s.bind(os.fspath(mute))
    s.listen(8)
    try:
        r.socket = os.fspath(mute)
        t0 = time.monotonic()
        _, p = r.run(r.bundle(env, ["sh", "-c", "echo ran"], hook_env={"CGPU_HOOK_TIMEOUT": "1"}))
        assert p.returncode != 0 and time.monotonic() - t0 < 10
        assert "did not answer" in "".join(_hook_line(p.stderr)), p.stderr
    finally:
        s.close()


def test_container_exit_removes_its_directories(daemon, runc):
    tree = {"destination": "/cgpu", "type": "bind", "source": os.fspath(daemon.mount), "options": ["rbind", "ro"]}
    cid = secrets.token_hex(32)
    # busybox cat prints nothing from the FUSE tree (it uses sendfile(2)): the shell's read(2) does
    script = f"read m < /cgpu/0/{cid[:12]}/memsize && echo $m"
    _, p = runc.run(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "3"}, ["sh", "-c", script], mounts=[tree]), cid)
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"{3 * GIB}\n"  # the container saw its own instance
    assert daemon.instances(0) == []  # gone once it exited
    assert targets(daemon) == {}


def test_scheduler_freezes_and_thaws_the_container_cgroup(daemon, runc):
    """Policy 3, weight 1 of max_inst 16: the container runs 1/16 of the time.
    A busybox busy loop holding the simulated GPU open (bind-mounted device
    file) is active; its own cgroup is seen frozen and thawed, and its CPU is about 1/16 of what
    the same loop gets unmanaged in the same window."""
    dev = {"destination": "/dev/simgpu0", "type": "bind", "source": os.fspath(daemon.dev_dir / "simgpu0"),
           "options": ["bind", "rw"]}
    daemon.write("0/policy", "3")
    cid = runc.start(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "2"},
                                 ["sh", "-c", "exec 3< /dev/simgpu0; while :; do :; done"], mounts=[dev]))
    path = Path(targets(daemon)[cid[:12]]["path"])
    events = path / "cgroup.events"
    seen = set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and seen != {"0", "1"}:
        for ln in events.read_text().splitlines():
            if ln.startswith("frozen "):
                seen.add(ln.split()[1])
        time.sleep(0.003)
    assert seen == {"0", "1"}, f"frozen states seen: {seen}"

    def usage() -> int:
        for ln in (path / "cpu.stat").read_text().splitlines():
            if ln.startswith("usage_usec "):
                return int(ln.split()[1])
        raise AssertionError("no usage_usec")

    # reference in the same window: the same busy loop, unmanaged (what a core gives now, on a loaded machine)
    ref = subprocess.Popen([_tool("busybox"), "sh", "-c", "while :; do :; done"])

    def ref_cpu() -> float:
        fields = Path(f"/proc/{ref.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    try:
        u0, r0, t0 = usage(), ref_cpu(), time.monotonic()
        time.sleep(3.0)
        u1, r1, t1 = usage(), ref_cpu(), time.monotonic()
    finally:
        ref.kill()
        ref.wait()
    share, ref_share = (u1 - u0) / 1e6 / (t1 - t0), (r1 - r0) / (t1 - t0)
    assert 0.02 < share / ref_share < 0.15, f"CPU share {share:.3f} vs {ref_share:.3f} unmanaged: expected about 1/16"
    daemon.write("0/policy", "0")  # alone under policy 0: still 1/16 (fair over max_inst)
    runc.delete(cid)
    assert daemon.instances(0) == []


def test_hooks_d_file_drives_both_stages(daemon, runc):
    """deploy/hooks.d/cgpu-hook.json (podman/CRI-O hooks.d): one entry for createRuntime
    and poststop, the compiled `cgpu-hook auto` telling them apart by the
    state's status. Its hook, with this venv's cgpu-hook and the test daemon's
    socket, under runc."""
    spec = json.loads((Path(__file__).parent.parent / "deploy" / "hooks.d" / "cgpu-hook.json").read_text())
    assert spec["version"] == "1.0.0" and spec["stages"] == ["createRuntime", "poststop"]
    assert spec["when"] == {"always": True}  # hooks.d cannot match on the environment; the hook decides
    assert spec["hook"]["path"] == "/usr/local/libexec/cgpu-hook" and spec["hook"]["args"] == ["cgpu-hook", "auto"]
    entry = dict(spec["hook"], path=compiled_hook(), env=[f"CGPUD_SOCKET={daemon.socket}"])
    hooks = {stage: [entry] for stage in spec["stages"]}
    cid = runc.start(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "6", "ALIYUN_COM_GPU_MEM_DEV": "15"}, SLEEP,
                                 hooks=hooks))
    assert daemon.value(f"0/{cid[:12]}/memsize") == "6337173913"
    assert runc.delete(cid).returncode == 0
    assert daemon.instances(0) == []
    _, p = runc.run(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "x"}, SLEEP, hooks=hooks))
    assert p.returncode != 0 and _hook_line(p.stderr) == [
        "cgpu hook: ALIYUN_COM_GPU_MEM_CONTAINER=x: x is not a whole number; give whole GiB per GPU, e.g. 6 or 3,4,5,6"]


def test_module_form_python_S(daemon, runc):
    """`python3 -S -m cgpud.containers.hook STAGE` (the Python forwarder without the
    CLI's start-up, docs/containers.md) does the same as the others."""
    henv = [f"CGPUD_SOCKET={daemon.socket}"]
    hooks = {stage: [hook_entry("module", stage, henv)] for stage in ("createRuntime", "poststop")}
    cid = runc.start(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "8", "ALIYUN_COM_GPU_MEM_DEV": "15",
                                  "ALIYUN_COM_GPU_SCHD_WEIGHT": "3"}, SLEEP, hooks=hooks))
    assert daemon.value(f"0/{cid[:12]}/memsize") == "8449565218" and daemon.value("0/policy") == "2"
    assert runc.delete(cid).returncode == 0 and daemon.instances(0) == []
    _, p = runc.run(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "2", "ALIYUN_COM_GPU_VISIBLE_DEVICES": "1"},
                                SLEEP, hooks=hooks))
    assert p.returncode != 0 and _hook_line(p.stderr) == [
        "cgpu hook: ALIYUN_COM_GPU_VISIBLE_DEVICES=1: no GPU 1 on this node (indices 0..0)"]
    _, p = runc.run(runc.bundle({}, ["sh", "-c", "echo ran"], hooks=hooks))
    assert p.returncode == 0 and p.stdout == "ran\n", p.stderr


def test_container_removed_without_poststop_is_reaped(daemon, runc):
    """A runtime that never calls poststop: once the container's cgroup is
    gone, the daemon deregisters its instances by itself (within a second)."""
    b = runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "2"}, SLEEP)
    c = json.loads((b / "config.json").read_text())
    del c["hooks"]["poststop"]
    (b / "config.json").write_text(json.dumps(c))
    cid = runc.start(b)
    path = targets(daemon)[cid[:12]]["path"]
    assert runc.delete(cid).returncode == 0
    assert not os.path.exists(path)
    deadline = time.monotonic() + 5
    while daemon.instances(0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.instances(0) == []


def test_register_refuses_targets_that_are_not_a_container_group(daemon):
    from cgpud.client import ControlError
    with Client(os.fspath(daemon.socket)) as c:
        for target, code in (({"kind": "cgroup2", "path": CGROUP2}, "EPERM"),           # a root
                             ({"kind": "cgroup2", "path": CGROUP2 + "/no-such-group"}, "EPERM"),
                             ({"kind": "pgid", "pgid": 5}, "EINVAL"),
                             ({"kind": "cgroup2", "path": "relative"}, "EINVAL")):
            with pytest.raises(ControlError) as e:
                c.call("register", name="abcdefabcdef", gpus=[0], memsize=GIB, target=target)
            assert e.value.error == code, (target, e.value)
        assert c.call("query")["gpus"][0]["instances"] == []
        with pytest.raises(ControlError) as e:
            c.call("register", name="abcdefabcdef", gpus=[0], memsize=GIB, policy=9)
        assert e.value.error == "EINVAL" and c.call("query")["gpus"][0]["instances"] == []


def test_same_short_id_is_refused_and_the_first_keeps_its_instance(daemon, runc):
    """Two IDs with the same first 12 characters: the second container fails
    with EEXIST, and its poststop (runc runs it when the start fails) does not
    remove the first container's instance."""
    first = runc.start(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "8", "ALIYUN_COM_GPU_MEM_DEV": "15"}, SLEEP))
    _, p = runc.run(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "1"}, SLEEP), first[:12] + "-second")
    assert p.returncode != 0
    assert _hook_line(p.stderr) == [f"cgpu hook: cannot register {first[:12]} on GPU 0: {first[:12]} is already on GPU 0 (EEXIST)"]
    assert daemon.instances(0) == [first[:12]] and daemon.value(f"0/{first[:12]}/memsize") == "8449565218"


@pytest.mark.parametrize("strategy, spread_out", [("binpack", False), ("spread", True)])
def test_node_placement_setting_decides_where_unnamed_containers_go(make_daemon, template, tmp_path,
                                                                     strategy, spread_out):
    daemon = make_daemon(gpus="sim:2xT4", extra_args=["--placement", strategy])
    assert query(daemon)["strategy"] == strategy and query(daemon)["mode"] == "cgpu"
    runc = Runc(tmp_path, template, daemon.socket, "c")
    try:
        a = runc.start(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "4"}, SLEEP))
        b = runc.start(runc.bundle({"ALIYUN_COM_GPU_MEM_CONTAINER": "4"}, SLEEP))
        where = {n: g for g in (0, 1) for n in daemon.instances(g)}
        assert where[a[:12]] == 0  # both GPUs empty: ties go to the lower index
        assert where[b[:12]] == (1 if spread_out else 0)
    finally:
        runc.cleanup()
