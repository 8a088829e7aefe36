"""The control socket's `hook` op (cgpud/containers/hookd.py) and the two forwarders
that call it — the compiled `cgpu-hook` and `cgpu hook` — without a runtime:
the state is given on stdin as a runtime would (tests/test_runc.py runs them
under runc, tests/test_podman.py under podman).
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess

import pytest

from cgpud.client import Client, ControlError
from cgpud.sched import cgroupfs, enforce

from conftest import as_nobody, nobody_python
from test_runc import FORMS, hook_argv

MANAGED = ["PATH=/bin", "ALIYUN_COM_GPU_MEM_CONTAINER=2"]


def bundle(tmp_path, env: list[str], name: str = "bundle") -> str:
    b = tmp_path / name
    b.mkdir()
    (b / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "process": {"env": env, "args": ["true"]}}))
    return os.fspath(b)


def call_hook(daemon, stage: str, state) -> ControlError:
    with Client(os.fspath(daemon.socket)) as c:
        with pytest.raises(ControlError) as e:
            c.call("hook", stage=stage, state=state)
    return e.value


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_bad_requests_are_refused_with_the_reason_and_register_nothing(daemon, tmp_path):
    good = bundle(tmp_path, MANAGED)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")  # must not block the daemon
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "config.json", "wb") as f:
        f.truncate((4 << 20) + 1)
    notjson = tmp_path / "notjson"
    notjson.mkdir()
    (notjson / "config.json").write_text("{")
    cid = "c" * 64
    cases = [
        ("createRuntime", [], "EINVAL", "the OCI state must be a JSON object"),
        ("createRuntime", {"pid": 5}, "EINVAL", 'the OCI state has no "id"'),
        ("sometime", {"id": cid}, "EINVAL", "unknown stage 'sometime'"),
        ("auto", {"id": cid, "status": "running"}, "EINVAL", "status 'running'; the `auto` stage runs at"),
        ("createRuntime", {"id": cid, "pid": os.getpid()}, "EINVAL", 'the OCI state has no "bundle"'),
        ("createRuntime", {"id": cid, "pid": os.getpid(), "bundle": "rel/dir"}, "EINVAL", "is not an absolute path"),
        ("createRuntime", {"id": cid, "pid": os.getpid(), "bundle": good + "/../bundle"}, "EINVAL", "is not an absolute path"),
        ("createRuntime", {"id": cid, "pid": os.getpid(), "bundle": os.fspath(tmp_path / "none")}, "ENOENT",
         "cannot read"),
        ("createRuntime", {"id": cid, "pid": os.getpid(), "bundle": os.fspath(fifo)}, "EINVAL", "is not a regular file"),
        ("createRuntime", {"id": cid, "pid": os.getpid(), "bundle": os.fspath(big)}, "EFBIG",
         f"is larger than {4 << 20} bytes"),
        ("createRuntime", {"id": cid, "pid": os.getpid(), "bundle": os.fspath(notjson)}, "EINVAL", "is not JSON"),
        ("createRuntime", {"id": cid, "bundle": good}, "EINVAL", "has no init pid"),
        ("createRuntime", {"id": cid, "pid": True, "bundle": good}, "EINVAL", "has no init pid"),
        ("createRuntime", {"id": cid, "pid": 1, "bundle": good}, "EINVAL", "pid 1 is not a container's init (it is init)"),
        ("createRuntime", {"id": cid, "pid": os.getpid(), "bundle": good}, "EINVAL", "(it is the hook itself)"),
        ("createRuntime", {"id": cid, "pid": dead_pid(), "bundle": good}, "ESRCH", "no process"),
        ("createRuntime", {"id": cid, "pid": daemon.proc.pid, "bundle": good}, "EINVAL", "(it is cgpud)"),
    ]
    before = daemon.snapshot()
    for stage, state, code, words in cases:
        err = call_hook(daemon, stage, state)
        assert err.error == code and words in str(err), (state, err.error, str(err))
        assert "\n" not in str(err)
    assert daemon.snapshot() == before


def test_a_process_in_the_daemons_own_group_is_no_container(daemon, tmp_path):
    """A pid whose cgroup also holds the hook (this test, calling) is refused:
    the scheduler would freeze the runtime with it."""
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        err = call_hook(daemon, "createRuntime", {"id": "d" * 64, "pid": sleeper.pid,
                                                   "bundle": bundle(tmp_path, MANAGED)})
        assert err.error == "EPERM" and "has no cgroup of its own" in str(err), str(err)
        assert daemon.instances(0) == []
    finally:
        sleeper.kill()
        sleeper.wait()


def test_unprivileged_callers_are_refused_before_anything_is_read(daemon, tmp_path):
    script = (
        "import json, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        "s.sendall(json.dumps({'op': 'hook', 'stage': 'createRuntime', 'state': "
        "{'id': 'e' * 64, 'pid': 2, 'bundle': sys.argv[2]}}).encode() + b'\\n')\n"
        "print(s.makefile().readline())\n"
    )
    r = as_nobody([nobody_python(), "-c", script, os.fspath(daemon.socket), bundle(tmp_path, MANAGED)])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"ok": False, "error": "EACCES", "message": "hook needs root or the admin group"}


def test_poststop_of_an_unknown_container_is_fine(daemon, tmp_path):
    with Client(os.fspath(daemon.socket)) as c:
        assert c.call("hook", stage="poststop", state={"id": "f" * 64}) == {"action": "nothing", "name": "f" * 12}
        assert c.call("hook", stage="auto", state={"id": "f" * 64, "status": "stopped"})["action"] == "nothing"


def run_form(form: str, stage: str, stdin: str | bytes, socket, **env) -> subprocess.CompletedProcess:
    return subprocess.run(hook_argv(form, stage), input=stdin if isinstance(stdin, bytes) else stdin.encode(),
                          capture_output=True, env={"CGPUD_SOCKET": os.fspath(socket), **env}, timeout=30)


@pytest.mark.parametrize("hook_form", FORMS)
def test_forwarder_input_errors_are_one_line(hook_form, daemon, tmp_path):
    for stdin, line in (("", "the OCI state on stdin is not a JSON object"),
                        ("[1, 2]", "the OCI state on stdin is not a JSON object"),
                        ('{"id": "x"} trailing', "the OCI state on stdin is not a JSON object"),
                        ('{"pid": 3}', 'the OCI state on stdin has no "id"'),
                        ('{"id": ""}', 'the OCI state on stdin has no "id"'),
                        ('{"id": "x", "a": "' + "y" * 70000 + '"}', "the OCI state on stdin is larger than 61440 bytes")):
        p = run_form(hook_form, "createRuntime", stdin, daemon.socket)
        assert (p.returncode, p.stderr.decode()) == (1, f"cgpu hook: {line}\n"), stdin[:40]
    p = run_form(hook_form, "teardown", "{}", daemon.socket)
    assert p.returncode == 2 and p.stderr.decode().startswith("cgpu hook: unknown stage teardown; one of")


@pytest.mark.parametrize("hook_form", FORMS)
def test_forwarder_reads_escaped_bundle_paths_and_skips_the_daemon_when_nothing_is_asked(hook_form, tmp_path):
    """The shortcut: a config.json without ALIYUN_COM_GPU_MEM_CONTAINER= is
    never sent to the daemon (none runs here: exit 0 only if not asked). The
    bundle path arrives JSON-escaped (\\/, \\u00fc, a surrogate pair)."""
    gone = tmp_path / "no.sock"
    plain = bundle(tmp_path, ["PATH=/bin"], "b-ü-😀")
    asks = bundle(tmp_path, MANAGED, "a-ü-😀")
    for b, rc in ((plain, 0), (asks, 1)):
        escaped = json.dumps(b, ensure_ascii=True).replace("/", "\\/")
        assert "\\ud83d\\ude00" in escaped and "\\u00fc" in escaped
        state = '{"ociVersion":"1.0.2",\n "id": "%s", "status": "creating", "pid": 7, "bundle": %s,\n' \
                ' "annotations": {"bundle": "/elsewhere", "n": [1, {"x": null}]}}' % ("a" * 64, escaped)
        p = run_form(hook_form, "auto", state, gone)
        assert p.returncode == rc, (b, p.stderr)
        if rc:
            assert p.stderr.decode() == (f"cgpu hook: cgpud is not running (nothing answers on {gone}): start it with "
                                         "`cgpud serve` (set CGPU_HOOK_PASSTHROUGH=1 in the hook's env to start "
                                         "containers unmanaged then)\n")
        else:
            assert p.stderr == b""


def test_both_forwarders_say_exactly_the_same(daemon, tmp_path):
    """The same state through either forwarder: the same exit status and the
    same bytes on stderr (the daemon makes the message; non-ASCII included)."""
    envs = [["ALIYUN_COM_GPU_MEM_CONTAINER=sechs-ü"], ["ALIYUN_COM_GPU_MEM_CONTAINER=2", "ALIYUN_COM_GPU_SCHD_WEIGHT=99"],
            ["ALIYUN_COM_GPU_MEM_CONTAINER=16", "ALIYUN_COM_GPU_MEM_DEV=15"], ["CGPU_DISABLE=1", "ALIYUN_COM_GPU_MEM_CONTAINER=2"]]
    for i, env in enumerate(envs):
        b = bundle(tmp_path, env, f"b{i}")
        state = json.dumps({"id": "9" * 64, "pid": os.getpid(), "bundle": b, "status": "creating"})
        out = {form: run_form(form, "createRuntime", state, daemon.socket) for form in FORMS}
        assert out["c"].returncode == out["cli"].returncode, env
        assert out["c"].stderr == out["cli"].stderr, env
        assert out["c"].stderr.count(b"\n") == (1 if out["c"].returncode else 0), env
    assert daemon.instances(0) == []


@pytest.mark.parametrize("hook_form", [*FORMS, "module"])
def test_a_hook_without_a_stage_reads_it_from_the_state(hook_form, daemon, tmp_path):
    """`args: ["cgpu", "hook"]` (no stage): creating/created join, stopped
    leaves, any other status is one line and exit 1, nothing registered."""
    b = bundle(tmp_path, ["ALIYUN_COM_GPU_MEM_CONTAINER=2"])
    argv = [a for a in hook_argv(hook_form, "STAGE") if a != "STAGE"]
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    group = cgroupfs.create_cgroup(os.path.join(cgroupfs.hierarchies()[cgroupfs.KIND_CGROUP2].mount,
                                                f"cgpud-test-{secrets.token_hex(4)}"))
    try:
        cgroupfs.join_cgroup(group, sleeper.pid)  # the "container": a process in a group of its own
        cid = "a" * 64
        for status, line in (("running", "the OCI state's status is 'running'"),
                             (None, "the OCI state's status is '(none)'")):
            state = {"id": cid, "pid": sleeper.pid, "bundle": b, **({"status": status} if status else {})}
            r = subprocess.run(argv, input=json.dumps(state).encode(), capture_output=True, timeout=30,
                               env={"CGPUD_SOCKET": os.fspath(daemon.socket)})
            assert r.returncode == 1 and r.stderr.decode().startswith(f"cgpu hook: {line}"), r.stderr
            assert r.stderr.count(b"\n") == 1 and daemon.instances(0) == []
        for status, present in (("creating", True), ("stopped", False)):
            state = {"id": cid, "pid": sleeper.pid, "bundle": b, "status": status}
            r = subprocess.run(argv, input=json.dumps(state).encode(), capture_output=True, timeout=30,
                               env={"CGPUD_SOCKET": os.fspath(daemon.socket)})
            assert r.returncode == 0, r.stderr
            assert (cid[:12] in daemon.instances(0)) == present
    finally:
        sleeper.kill()
        sleeper.wait()
        enforce.remove_cgroup(group)


def test_a_refused_join_takes_its_prepared_pages_with_it_but_not_another_containers(daemon, tmp_path):
    """Pages made before the hook (by cgpu-runtime's prepare) are removed when the
    container is refused; a container refused for a clash of short IDs leaves the
    pages of the registered one that owns them."""
    from cgpud.gpus import pages

    root = daemon.socket.parent / "pages"
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    group = cgroupfs.create_cgroup(os.path.join(cgroupfs.hierarchies()[cgroupfs.KIND_CGROUP2].mount,
                                                f"cgpud-test-{secrets.token_hex(4)}"))
    try:
        cgroupfs.join_cgroup(group, sleeper.pid)
        # refused by what it asks (more than the GPU): its prepared pages go
        bad = "e" * 64
        pages.prepare(os.fspath(root / bad[:12]), preload="/usr/lib/cgpu/libcgpu.so")
        err = call_hook(daemon, "createRuntime", {"id": bad, "pid": sleeper.pid,
                                                   "bundle": bundle(tmp_path, ["ALIYUN_COM_GPU_MEM_CONTAINER=99"])})
        assert "ALIYUN_COM_GPU_MEM_CONTAINER" in str(err), str(err)
        assert not (root / bad[:12]).exists()
        # joined with its pages; then another ID of the same first 12 characters is refused
        owner = "f" * 64
        pages.prepare(os.fspath(root / owner[:12]))
        b = bundle(tmp_path, MANAGED, "owner")
        with Client(os.fspath(daemon.socket)) as c:
            c.call("hook", stage="createRuntime", state={"id": owner, "pid": sleeper.pid, "bundle": b})
        assert owner[:12] in daemon.instances(0)
        err = call_hook(daemon, "createRuntime", {"id": owner[:12] + "0" * 52, "pid": sleeper.pid, "bundle": b})
        assert err.error == "EEXIST", str(err)
        assert (root / owner[:12] / "limits").exists()  # the owner's, kept
        assert pages.used(os.fspath(root / owner[:12])) == [0] * pages.MAX_GPUS
    finally:
        sleeper.kill()
        sleeper.wait()
        enforce.remove_cgroup(group)


def test_a_bundle_is_read_through_the_root_of_the_process_that_names_it(tmp_path):
    """A daemon in another mount namespace than the runtime's (the DaemonSet's container) reaches
    the bundle the runtime or the hook names through /proc/<their pid>/root; where the path is in
    its own view, that is used (issue 24's DaemonSet test found the DaemonSet's daemon unable to
    read containerd's bundles)."""
    import subprocess
    import time

    from cgpud.containers import hookd

    where = tmp_path / "bundle"
    where.mkdir()
    ready = tmp_path / "ready"
    # a process in a mount namespace of its own, with a tmpfs at `where` holding config.json
    p = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f"mount -t tmpfs none {where} && echo '{{}}' > {where}/config.json && : > {ready} "
                          "&& exec sleep 60"])
    try:
        deadline = time.monotonic() + 10
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        path = str(where / "config.json")
        assert not (where / "config.json").exists()  # (not in this view)
        assert hookd.as_seen_by(path, p.pid) == f"/proc/{p.pid}/root{path}"
        assert hookd.read_config("c1", hookd.as_seen_by(path, p.pid)) == {}
        (where / "config.json").write_text("{}")
        assert hookd.as_seen_by(path, p.pid) == path  # in the daemon's own view: used as it is
    finally:
        p.kill()
        p.wait()
