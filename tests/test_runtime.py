"""cgpu-runtime (native/runtime/cgpu-runtime.c), the OCI runtime wrapper for
Docker and containerd, and the daemon's `prepare` op behind it
(cgpud/control/runtime.py, cgpud/containers/spec.py).

- spec: the modifiers, pure: hooks added once, others kept.
- the wrapper with a recording stand-in for the real runtime: every argument
  reaches it unchanged; a container that does not ask is not looked at by the
  daemon; one that asks gets cgpud's hooks in config.json before the real
  runtime runs; a bad value or a daemon that is down fails the create with one
  line and the real runtime never runs.
- the wrapper in front of real runc (what containerd's shim does): the
  container joins through the hooks it added, and leaves at delete.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from cgpud.containers import spec
from conftest import SIM_T4_BYTES
from test_runc import Runc, _tool, compiled_hook, template  # noqa: F401  (template is a fixture)

WRAPPER = Path(sys.executable).parent / "cgpu-runtime"
SIX = {"ALIYUN_COM_GPU_MEM_CONTAINER": "6", "ALIYUN_COM_GPU_MEM_DEV": "15"}


def wrapper() -> str:
    if not os.access(WRAPPER, os.X_OK):
        pytest.fail(f"{WRAPPER} is missing: run scripts/setup.sh (make -C native builds it)")
    return os.fspath(WRAPPER)


# ---- the modifiers ---------------------------------------------------------------


def test_add_hooks_once_keeping_the_others():
    theirs = {"path": "/usr/bin/nvidia-container-runtime-hook", "args": ["x", "prestart"]}
    s = {"ociVersion": "1.0.2", "hooks": {"createRuntime": [theirs]}, "process": {"env": ["A=1"]}}
    out = spec.prepare(s, spec.Hooks("/opt/cgpu-hook", "/run/x.sock"))
    assert s["hooks"] == {"createRuntime": [theirs]}, "the input is not changed"
    assert out["hooks"]["createRuntime"][0] == theirs
    assert out["hooks"]["createRuntime"][1] == {"path": "/opt/cgpu-hook", "args": ["cgpu-hook", "createRuntime"],
                                                 "timeout": 10, "env": ["CGPUD_SOCKET=/run/x.sock"]}
    assert out["hooks"]["poststop"] == [{"path": "/opt/cgpu-hook", "args": ["cgpu-hook", "poststop"],
                                         "timeout": 10, "env": ["CGPUD_SOCKET=/run/x.sock"]}]
    assert spec.prepare(out, spec.Hooks("/opt/cgpu-hook", "/run/x.sock")) == out, "idempotent"
    assert out["process"] == s["process"]


@pytest.mark.parametrize("bad", [{"hooks": []}, {"hooks": {"poststop": {}}}, []])
def test_a_spec_that_cannot_take_hooks_is_refused(bad):
    with pytest.raises(spec.SpecError):
        spec.prepare(bad, spec.Hooks())


# ---- the wrapper, with a recording stand-in runtime ---------------------------------


@pytest.fixture
def fake_runtime(tmp_path) -> Path:
    """A 'real runtime' that records its arguments and the config.json it was given."""
    rec = tmp_path / "calls"
    script = tmp_path / "fake-runc"
    script.write_text(f"""#!/bin/sh
printf '%s\\0' "$@" >> {rec}
printf '\\n' >> {rec}
b=.
while [ $# -gt 0 ]; do case "$1" in --bundle|-b) b="$2"; shift;; esac; shift; done
[ -f "$b/config.json" ] && cp "$b/config.json" {tmp_path}/seen.json
exit 0
""")
    script.chmod(0o755)
    return script


def calls(tmp_path) -> list[list[str]]:
    rec = tmp_path / "calls"
    if not rec.exists():
        return []
    return [line.split("\0")[:-1] for line in rec.read_text().split("\n") if line]


def make_bundle(tmp_path, env: dict[str, str], name: str = "b") -> Path:
    b = tmp_path / name
    b.mkdir()
    (b / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "process": {
        "args": ["sh"], "env": ["PATH=/bin"] + [f"{k}={v}" for k, v in env.items()]}}))
    return b


def run_wrapper(args, tmp_path, fake_runtime, socket, **env) -> subprocess.CompletedProcess:
    return subprocess.run([wrapper(), *args], capture_output=True, text=True, timeout=30,
                          env={"PATH": os.environ["PATH"], "CGPU_RUNTIME_REAL": os.fspath(fake_runtime),
                               "CGPUD_SOCKET": os.fspath(socket), **env})


# containerd's shim and dockerd call runc like this
SHIM_ARGS = ["--root", "/run/containerd/runc/k8s.io", "--log", "/run/x/log.json", "--log-format", "json",
             "--systemd-cgroup"]


@pytest.mark.parametrize("cmd", ["create", "start", "delete", "state", "kill", "features"])
def test_arguments_reach_the_real_runtime_unchanged(cmd, tmp_path, fake_runtime):
    b = make_bundle(tmp_path, {"FOO": "1"})
    args = [*SHIM_ARGS, cmd, "--bundle", os.fspath(b), "--pid-file", "/run/x/init.pid", "0123abc"]
    r = run_wrapper(args, tmp_path, fake_runtime, tmp_path / "no-daemon.sock")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert calls(tmp_path) == [args]


def test_a_container_that_asks_gets_the_hooks_before_the_real_runtime(daemon, tmp_path, fake_runtime):
    b = make_bundle(tmp_path, SIX)
    before = json.loads((b / "config.json").read_text())
    mode = (b / "config.json").stat().st_mode
    args = [*SHIM_ARGS, "create", "--bundle", os.fspath(b), "c" * 64]
    r = run_wrapper(args, tmp_path, fake_runtime, daemon.socket)
    assert r.returncode == 0, r.stderr
    assert calls(tmp_path) == [args]
    seen = json.loads((tmp_path / "seen.json").read_text())  # what the real runtime was given
    assert seen == json.loads((b / "config.json").read_text())
    assert seen["process"] == before["process"]
    hook = [e for e in seen["hooks"]["createRuntime"] if e["args"] == ["cgpu-hook", "createRuntime"]]
    assert hook and hook[0]["env"] == [f"CGPUD_SOCKET={daemon.socket}"]
    assert [e["args"] for e in seen["hooks"]["poststop"]] == [["cgpu-hook", "poststop"]]
    assert (b / "config.json").stat().st_mode == mode
    assert sorted(p.name for p in b.iterdir()) == ["config.json"], "no temporary file left"
    # prepared twice (a retried create): the same spec, no second entry
    r = run_wrapper(args, tmp_path, fake_runtime, daemon.socket)
    assert r.returncode == 0 and json.loads((b / "config.json").read_text()) == seen
    assert daemon.instances(0) == [], "nothing registers before the container exists (the hook does that)"


@pytest.mark.parametrize("env, line", [
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "six"}, "cgpu-runtime: ALIYUN_COM_GPU_MEM_CONTAINER=six: "),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "16", "ALIYUN_COM_GPU_MEM_DEV": "15"}, "cgpu-runtime: ALIYUN_COM_GPU_MEM_"),
    ({"ALIYUN_COM_GPU_MEM_CONTAINER": "99"}, "cgpu-runtime: ALIYUN_COM_GPU_MEM_CONTAINER=99: "),
])
def test_a_bad_request_fails_the_create_and_changes_nothing(env, line, daemon, tmp_path, fake_runtime):
    b = make_bundle(tmp_path, env)
    before = (b / "config.json").read_bytes()
    r = run_wrapper(["create", "--bundle", os.fspath(b), "d" * 64], tmp_path, fake_runtime, daemon.socket)
    assert r.returncode == 1 and r.stderr.startswith(line) and r.stderr.count("\n") == 1, r.stderr
    assert calls(tmp_path) == [], "the real runtime never ran"
    assert (b / "config.json").read_bytes() == before


def test_disabled_containers_are_passed_through_untouched(daemon, tmp_path, fake_runtime):
    b = make_bundle(tmp_path, {**SIX, "CGPU_DISABLE": "true"})
    before = (b / "config.json").read_bytes()
    r = run_wrapper(["create", "-b", os.fspath(b), "e" * 64], tmp_path, fake_runtime, daemon.socket)
    assert r.returncode == 0, r.stderr
    assert (b / "config.json").read_bytes() == before and len(calls(tmp_path)) == 1


def test_daemon_down_refuses_a_container_that_asks_unless_passthrough(tmp_path, fake_runtime):
    b = make_bundle(tmp_path, SIX)
    args = ["create", "--bundle", os.fspath(b), "f" * 64]
    r = run_wrapper(args, tmp_path, fake_runtime, tmp_path / "none.sock")
    assert r.returncode == 1 and r.stderr.startswith("cgpu-runtime: cgpud is not running") \
        and r.stderr.count("\n") == 1, r.stderr
    assert calls(tmp_path) == []
    r = run_wrapper(args, tmp_path, fake_runtime, tmp_path / "none.sock", CGPU_HOOK_PASSTHROUGH="1")
    assert r.returncode == 0 and "starts unmanaged" in r.stderr
    assert calls(tmp_path) == [args]


def test_a_relative_bundle_and_the_real_runtime_from_a_config_file(daemon, tmp_path, fake_runtime):
    make_bundle(tmp_path, SIX, "rel")
    conf = tmp_path / "runtime.conf"
    conf.write_text(f'# cgpu-runtime\nruntime = "{fake_runtime}"\n')
    r = subprocess.run([wrapper(), "create", "--bundle", "rel", "g" * 64], cwd=tmp_path, capture_output=True,
                       text=True, timeout=30, env={"PATH": os.environ["PATH"], "CGPU_RUNTIME_CONFIG": os.fspath(conf),
                                                   "CGPUD_SOCKET": os.fspath(daemon.socket)})
    assert r.returncode == 0, r.stderr
    assert calls(tmp_path) == [["create", "--bundle", "rel", "g" * 64]]
    assert "poststop" in json.loads((tmp_path / "rel" / "config.json").read_text())["hooks"]


def test_no_real_runtime_is_one_line(tmp_path):
    r = subprocess.run([wrapper(), "state", "x"], capture_output=True, text=True, timeout=30,
                       env={"PATH": os.fspath(tmp_path), "CGPU_RUNTIME_CONFIG": os.fspath(tmp_path / "none")})
    assert r.returncode == 1 and r.stderr.startswith("cgpu-runtime: no real OCI runtime") and r.stderr.count("\n") == 1


# ---- in front of real runc --------------------------------------------------------------


def test_runc_through_the_wrapper_joins_and_leaves(make_daemon, template, tmp_path):  # noqa: F811
    d = make_daemon(extra_args=["--hook-path", compiled_hook()])
    _tool("runc")
    r = Runc(tmp_path, template, d.socket)
    b = r.bundle(SIX, ["sleep", "60"], hooks={})  # no hooks of its own: the wrapper adds them
    cid = secrets.token_hex(32)
    env = {"PATH": os.environ["PATH"], "CGPUD_SOCKET": os.fspath(d.socket)}
    root = ["--root", os.fspath(r.root)]
    out = tmp_path / "run.log"  # (not a pipe: the detached container keeps its stdio open)
    with open(out, "w") as f:
        p = subprocess.run([wrapper(), *root, "run", "-d", "--bundle", os.fspath(b), cid], stdout=f,
                           stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL, timeout=30)
    try:
        assert p.returncode == 0, out.read_text()
        assert d.value(f"0/{cid[:12]}/memsize") == str(SIM_T4_BYTES * 6 // 15) == "6337173913"
    finally:
        q = subprocess.run([wrapper(), *root, "delete", "-f", cid], capture_output=True, text=True, env=env, timeout=30)
    assert q.returncode == 0, q.stderr
    assert cid[:12] not in d.instances(0)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_refusal_is_in_the_runtime_log_where_the_shim_reads_it(fmt, daemon, tmp_path, fake_runtime):
    """containerd's shim shows the last error of runc's --log: so `docker run` and
    `kubectl describe pod` show the reason, not just 'exit status 1'."""
    b = make_bundle(tmp_path, {"ALIYUN_COM_GPU_MEM_CONTAINER": "six"})
    log = tmp_path / "log.json"
    r = run_wrapper(["--log", os.fspath(log), f"--log-format={fmt}", "create", "--bundle", os.fspath(b), "h" * 64],
                    tmp_path, fake_runtime, daemon.socket)
    assert r.returncode == 1
    line = log.read_text().splitlines()[-1]
    if fmt == "json":
        rec = json.loads(line)
        assert rec["level"] == "error" and rec["msg"].startswith("cgpu-runtime: ALIYUN_COM_GPU_MEM_CONTAINER=six: ")
    else:
        assert "level=error" in line and 'msg="cgpu-runtime: ALIYUN_COM_GPU_MEM_CONTAINER=six: ' in line


# ---- Docker's and containerd's settings (cgpu runtime-config) ---------------------------


def test_runtime_config_merges_and_refuses_what_it_cannot_write_safely(tmp_path):
    import tomllib

    from cgpud.containers import hostconfig

    cgpu = [str(Path(sys.executable).parent / "cgpu"), "runtime-config"]
    w = wrapper()
    toml = tmp_path / "containerd" / "config.toml"
    toml.parent.mkdir()
    toml.write_text('# the node\'s own\nversion = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n'
                    '  default_runtime_name = "runc"\n  snapshotter = "overlayfs"\n'
                    '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
                    '  runtime_type = "io.containerd.runc.v2"\n'
                    '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n  SystemdCgroup = true\n')
    r = subprocess.run([*cgpu, "containerd", "--etc", os.fspath(tmp_path), "--default", "--wrapper", w],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = toml.read_text()
    assert text.startswith("# the node's own\n")
    cri = tomllib.loads(text)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    # the table written out already gets default_runtime_name changed in place; the rest stays
    assert cri["default_runtime_name"] == "cgpu" and cri["snapshotter"] == "overlayfs"
    assert cri["runtimes"]["runc"] == {"runtime_type": "io.containerd.runc.v2", "options": {"SystemdCgroup": True}}
    # the runtime's options are the default runtime's (a systemd-cgroup node runs cgpu's containers the same way)
    assert cri["runtimes"]["cgpu"]["options"] == {"SystemdCgroup": True, "BinaryName": w}
    again = subprocess.run([*cgpu, "containerd", "--etc", os.fspath(tmp_path), "--default", "--wrapper", w],
                           capture_output=True, text=True)
    assert again.returncode == 0 and "set already" in again.stdout and toml.read_text() == text
    for bad in ("[1]", "{nope"):
        with pytest.raises(hostconfig.ConfigError):
            hostconfig.docker(bad)
    with pytest.raises(hostconfig.ConfigError, match="BinaryName"):
        hostconfig.containerd('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.cgpu]\n'
                              '  runtime_type = "io.containerd.runc.v1"\n')
    # a runtime cgpu that differs is one line saying what to set, and the file stays
    toml.write_text(before := text.replace(f'BinaryName = "{w}"', 'BinaryName = "/elsewhere"'))
    r = subprocess.run([*cgpu, "containerd", "--etc", os.fspath(tmp_path), "--wrapper", w], capture_output=True,
                       text=True)
    assert r.returncode == 1 and "set those two" in r.stderr and r.stderr.count("\n") == 1
    assert toml.read_text() == before


def test_runtime_config_writes_containerd_2s_version_3(tmp_path):
    """Issue 21: containerd 2.x (config version 3) was refused ("run `containerd config migrate`",
    which gives version 3 again); its CRI runtimes live under io.containerd.cri.v1.runtime."""
    import tomllib

    cgpu = [str(Path(sys.executable).parent / "cgpu"), "runtime-config"]
    toml = tmp_path / "containerd" / "config.toml"
    toml.parent.mkdir()
    toml.write_text("version = 3\n[plugins.'io.containerd.cri.v1.runtime'.containerd]\n"
                    "  default_runtime_name = 'runc'\n"
                    "[plugins.'io.containerd.cri.v1.images']\n  snapshotter = 'overlayfs'\n")
    r = subprocess.run([*cgpu, "containerd", "--etc", os.fspath(tmp_path), "--default", "--wrapper", wrapper()],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = tomllib.loads(toml.read_text())
    assert doc["version"] == 3 and "io.containerd.grpc.v1.cri" not in doc["plugins"]
    cri = doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]
    assert cri["default_runtime_name"] == "cgpu"
    assert cri["runtimes"]["cgpu"] == {"runtime_type": "io.containerd.runc.v2", "options": {"BinaryName": wrapper()},
                                       "container_annotations": ["cgpu.aliyun.com/allocation-*"]}
    assert doc["plugins"]["io.containerd.cri.v1.images"] == {"snapshotter": "overlayfs"}


@pytest.mark.parametrize("engine", ["docker", "containerd"])
def test_runtime_config_refuses_a_wrapper_that_is_not_there(tmp_path, engine):
    """Issue 21: the wrapper's path was written without a look, and every GPU container then failed."""
    r = subprocess.run([str(Path(sys.executable).parent / "cgpu"), "runtime-config", engine, "--etc",
                        os.fspath(tmp_path), "--wrapper", os.fspath(tmp_path / "no-cgpu-runtime")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "is not there" in r.stderr and "make install-hooks" in r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("bounding, args, starts", [
    (["CAP_CHOWN", "CAP_SYS_ADMIN"], ["cgpud", "serve"], True),  # privileged: cgpud's own DaemonSet pod
    (["CAP_CHOWN"], ["sh", "-c", "echo", "CAP_SYS_ADMIN"], False),  # the string in its args is no privilege
])
def test_a_privileged_kubernetes_container_naming_all_gpus_starts_before_the_daemon_answers(
        tmp_path, fake_runtime, bounding, args, starts):
    """Issue 44's narrowing asks the daemon of every Kubernetes container naming NVIDIA_VISIBLE_DEVICES, and
    one that cannot be reached fails the start closed; but a privileged container's value is believed (as
    nvidia-container-toolkit does), and cgpud's own DaemonSet pod names `all` and is restarted before the
    daemon (itself) answers: a helm upgrade's restart failed "cgpud is not running" for ever. Privilege is
    read from process.capabilities.bounding alone, never from a string anywhere in the spec."""
    b = tmp_path / "b"
    b.mkdir()
    (b / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "process": {
        "args": args, "env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"],
        "capabilities": {"bounding": bounding, "effective": bounding}},
        "annotations": {"io.kubernetes.cri.container-type": "container"}}))
    cmd = [*SHIM_ARGS, "create", "--bundle", os.fspath(b), "d" * 64]
    r = run_wrapper(cmd, tmp_path, fake_runtime, tmp_path / "no-daemon.sock")
    if starts:
        assert r.returncode == 0 and calls(tmp_path) == [cmd], r.stderr
    else:
        assert r.returncode != 0 and "cgpud is not running" in r.stderr and calls(tmp_path) == [], r.stderr
    from cgpud.containers.hook import may_ask
    assert may_ask(os.fspath(b)) is (not starts)
