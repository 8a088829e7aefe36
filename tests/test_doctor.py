"""`cgpu doctor` (issue 15): each check passes on a good set-up and fails, with
one line saying what to do, on a broken one of its own; exit 0 only when
nothing failed; --json for scripts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_nvml import libdir, nvml_daemon, stub  # noqa: F401  (fixtures)
from test_runc import compiled_hook

CGPU = str(Path(sys.executable).parent / "cgpu")


def doctor(socket, mount, etc, hooks, *extra, prefix=()) -> tuple[int, dict[str, dict]]:
    r = subprocess.run([*prefix, CGPU, "--socket", os.fspath(socket), "doctor", "--mount", os.fspath(mount),
                        "--etc", os.fspath(etc), "--hooks-dir", os.fspath(hooks), "--json", *extra],
                       capture_output=True, text=True, timeout=60)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, {c["check"]: c for c in json.loads(r.stdout)}


@pytest.fixture
def good(make_daemon, tmp_path):
    """A host set up as the docs say: hooks.d, Docker and containerd all name this venv's programs,
    and the daemon has the in-container library."""
    lib = tmp_path / "lib"
    subprocess.run(["make", "-s", "-C", str(Path(__file__).resolve().parent.parent / "native"), "libcgpu",
                    f"LIB={lib}"], check=True)
    daemon = make_daemon(extra_args=["--libcgpu", os.fspath(lib / "libcgpu.so"), "--hook-path", compiled_hook()])
    daemon.libcgpu = os.fspath(lib / "libcgpu.so")  # (for the tests' other daemons)
    etc, hooks = tmp_path / "etc", tmp_path / "hooks.d"
    hooks.mkdir()
    spec = json.loads((Path(__file__).parent.parent / "deploy/hooks.d/cgpu-hook.json").read_text())
    spec["hook"]["path"] = compiled_hook()
    (hooks / "cgpu-hook.json").write_text(json.dumps(spec))
    wrapper = str(Path(sys.executable).parent / "cgpu-runtime")
    for engine in ("docker", "containerd"):
        r = subprocess.run([CGPU, "runtime-config", engine, "--etc", os.fspath(etc), "--wrapper", wrapper],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    return daemon, etc, hooks


def test_all_good_exits_0_and_says_each_check(good):
    d, etc, hooks = good
    rc, out = doctor(d.socket, d.mount, etc, hooks)
    assert rc == 0, out
    assert {k: v["status"] for k, v in out.items()} == {
        "daemon": "ok", "tree": "ok", "fuse": "ok", "cgroups": "ok", "hooks.d": "ok", "hook": "ok", "libcgpu": "ok",
        "docker": "ok", "containerd": "ok", "nvml": "skip", "gpu health": "ok"}
    text = subprocess.run([CGPU, "--socket", os.fspath(d.socket), "doctor", "--mount", os.fspath(d.mount), "--etc",
                           os.fspath(etc), "--hooks-dir", os.fspath(hooks)], capture_output=True, text=True)
    assert text.returncode == 0 and len(text.stdout.splitlines()) == 11


def failing(out: dict, name: str, words: str) -> None:
    assert out[name]["status"] == "fail" and words in out[name]["message"], out[name]


def test_no_daemon_and_no_tree(good, tmp_path):
    _, etc, hooks = good
    rc, out = doctor(tmp_path / "none.sock", tmp_path / "nothing", etc, hooks)
    assert rc == 1
    failing(out, "daemon", "start it")
    failing(out, "tree", "nothing is mounted")


def test_a_dead_mount_says_clear_mount(good):
    d, etc, hooks = good
    d.kill9()
    rc, out = doctor(d.socket, d.mount, etc, hooks)
    assert rc == 1
    failing(out, "tree", "cgpud clear-mount")


def test_a_hooks_d_file_whose_hook_is_missing(good):
    d, etc, hooks = good
    spec = json.loads((hooks / "cgpu-hook.json").read_text())
    spec["hook"]["path"] = "/usr/local/libexec/no-such-cgpu-hook"
    (hooks / "cgpu-hook.json").write_text(json.dumps(spec))
    rc, out = doctor(d.socket, d.mount, etc, hooks)
    assert rc == 1
    failing(out, "hooks.d", "install-hooks")


@pytest.mark.parametrize("libcgpu, words", [("/nowhere/libcgpu.so", "No such file or directory"),
                                              ("/etc/hostname", "is not a shared library"),
                                              ("", "no in-container library")])
def test_a_daemon_whose_library_is_not_there(make_daemon, good, libcgpu, words):
    _, etc, hooks = good
    d = make_daemon(extra_args=["--libcgpu", libcgpu])
    rc, out = doctor(d.socket, d.mount, etc, hooks)
    assert rc == 1
    failing(out, "libcgpu", "install-hooks")
    failing(out, "libcgpu", words)


def test_a_daemon_whose_hook_is_not_there(make_daemon, good):
    """Issue 21: with the hook the daemon names missing, every GPU container failed with
    `fork/exec /usr/local/libexec/cgpu-hook: no such file` and doctor said all was well."""
    _, etc, hooks = good
    d = make_daemon(extra_args=["--libcgpu", good[0].libcgpu, "--hook-path", "/nowhere/libexec/cgpu-hook"])
    rc, out = doctor(d.socket, d.mount, etc, hooks)
    assert rc == 1
    failing(out, "hook", "/nowhere/libexec/cgpu-hook: No such file or directory")
    failing(out, "hook", "install-hooks")
    assert [k for k, v in out.items() if v["status"] == "fail"] == ["hook"]


def test_containerd_without_cgpu_as_the_default_says_what_a_pod_must_name(good):
    d, etc, hooks = good
    rc, out = doctor(d.socket, d.mount, etc, hooks)
    assert rc == 0 and "runtimeClassName: cgpu" in out["containerd"]["message"]
    (etc / "containerd/config.toml").write_text((etc / "containerd/config.toml").read_text()
                                               + '[plugins."io.containerd.grpc.v1.cri".containerd]\n'
                                                 'default_runtime_name = "cgpu"\n')
    rc, out = doctor(d.socket, d.mount, etc, hooks)
    assert rc == 0 and out["containerd"]["message"].endswith("(the default runtime)")


@pytest.mark.parametrize("engine, path, broken", [
    ("docker", "docker/daemon.json", [('{"log-level": "warn"}', "cgpu runtime-config docker"),
                                      ('{"runtimes": {"cgpu": {"path": "/nowhere/cgpu-runtime"}}}', "install-hooks")]),
    ("containerd", "containerd/config.toml", [("version = 2\n", "cgpu runtime-config containerd"),
                                              ("version = [\n", "fix it")]),
])
def test_an_engine_whose_settings_do_not_name_the_wrapper(engine, path, broken, good):
    d, etc, hooks = good
    for text, words in broken:
        (etc / path).write_text(text)
        rc, out = doctor(d.socket, d.mount, etc, hooks)
        assert rc == 1
        failing(out, engine, words)


def doctor_in_a_namespace(good, setup: str) -> tuple[int, dict[str, dict]]:
    """cgpu doctor after `setup` in a mount namespace of its own (the host's mounts untouched)."""
    d, etc, hooks = good
    script = (f"{setup} && exec {CGPU} --socket {d.socket} doctor --mount {d.mount} "
              f"--etc {etc} --hooks-dir {hooks} --json")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", script], capture_output=True,
                       text=True, timeout=60)
    return r.returncode, {c["check"]: c for c in json.loads(r.stdout)}


def test_no_fuse_device(good):
    rc, out = doctor_in_a_namespace(good, "mount -t tmpfs tmpfs /dev")  # /dev without fuse
    assert rc == 1
    failing(out, "fuse", "modprobe fuse")


def test_no_cgroup_hierarchy(good):
    rc, out = doctor_in_a_namespace(good, "umount -l /sys/fs/cgroup")  # no cgroup2, no freezer
    assert rc == 1
    failing(out, "cgroups", "cannot be paused")


def test_nvml_answers_and_a_missing_device_file(nvml_daemon, stub, good, monkeypatch):  # noqa: F811
    first, etc, hooks = good
    d = nvml_daemon("--libcgpu", first.libcgpu, "--hook-path", compiled_hook())
    rc, out = doctor(d.socket, d.mount, etc, hooks)
    assert out["nvml"]["status"] == "ok" and "2 GPUs" in out["nvml"]["message"], out["nvml"]
    assert rc == 0
    (d.dev_dir / "nvidia3").unlink()
    rc, out = doctor(d.socket, d.mount, etc, hooks)
    assert rc == 1
    failing(out, "nvml", "nvidia3 missing")
