"""A hot upgrade from the previous release (the flat `cgpud/` layout) to this
one (the layout by role, docs/architecture.md), as an in-place package
upgrade does it: the daemon runs the old code from a directory on its
PYTHONPATH, the directory is switched to this checkout's code, then
`echo 1 > upgrade`. Everything must be kept (settings, instances, a `cgpu
run` workload with its connection and simulated memory), the new daemon must
run the new code (its guard is `python -m cgpud.sched.guard`, a module the
old release does not have) and schedule again."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from cgpud.client import Client
from test_upgrade import CGPU, frozen, subreaper, upgrade, wait_for  # noqa: F401  (subreaper is a fixture)

ROOT = Path(__file__).resolve().parent.parent
PREVIOUS_RELEASE = "2e8007d"  # main before the layout by role: cgpud/ flat, hooks/ at the top
LAUNCH = "import sys; from cgpud.cli.daemon import main; sys.argv[0] = 'cgpud'; sys.exit(main())"


def previous_release(into: Path) -> Path:
    """cgpud/ and fusefs/ of the previous release, from git."""
    r = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", PREVIOUS_RELEASE, "cgpud", "fusefs"],
                       capture_output=True)
    if r.returncode:
        pytest.fail(f"this test needs the repository's history (a full clone) for release {PREVIOUS_RELEASE}: "
                    f"{r.stderr.decode().strip()}")
    into.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as tar:
        tar.extractall(into, filter="data")
    assert (into / "cgpud" / "control.py").is_file() and not (into / "cgpud" / "control").exists()
    return into


def point(site: Path, code: Path) -> None:
    """Make site/cgpud and site/fusefs the code in `code`, each switched in one rename."""
    for pkg in ("cgpud", "fusefs"):
        tmp = site / f".{pkg}.new"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(code / pkg)
        os.replace(tmp, site / pkg)


def guards(state_dir: Path) -> dict[int, str]:
    """pid -> command line of each guard process watching `state_dir`'s registry."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "guard" in cmd and str(state_dir) in cmd and "-m" in cmd:
            out[int(pid)] = cmd
    return out


def test_hot_upgrade_from_the_flat_layout(make_daemon, subreaper, tmp_path, monkeypatch):
    old_code = previous_release(tmp_path / "old")
    site = tmp_path / "site"
    site.mkdir()
    point(site, old_code)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("PYTHONSAFEPATH", "1")  # not the working directory (this checkout) first on sys.path
    d = make_daemon(start=False, extra_args=["--slice-ms", "50"])
    d.command = lambda **kw: [sys.executable, "-c", LAUNCH, *type(d).command(d, **kw)[1:]]
    d.start()
    old_pid = d.proc.pid

    name, run_name = "layoutstatic", f"layr{os.getpid() % 100000000:08d}"
    d.write("default_memsize", str(1 << 30))
    d.write("0/max_inst", "4")
    d.create(0, name)
    d.write(f"0/{name}/weight", "2")
    d.write("0/policy", "3")  # fixed shares: the workload (weight 1) runs 1/4 of the time, frozen the rest
    env = dict(os.environ, CGPUD_SOCKET=str(d.socket))
    env.pop("PYTHONPATH"), env.pop("PYTHONSAFEPATH")  # the client is this checkout's: the protocol did not change
    run = subprocess.Popen([CGPU, "run", "--name", run_name, "--mem", "256M", "--",
                            CGPU, "workload", "--seconds", "8", "--mem", "64M", "--json", "--interval", "0.01"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: os.path.isdir(d.path(f"0/{run_name}")), 15, "the cgpu run instance")
        wait_for(lambda: "PID:" in open(d.path(f"0/{run_name}/meminfo")).read(), 15, "the workload's memory")
        state = json.loads((d.state_dir / "state.json").read_text())["state"]
        group = next(i["target"]["path"] for g in state["gpus"] for i in g["instances"] if i["name"] == run_name)
        wait_for(lambda: frozen(group), 10, "the workload frozen by the old daemon")
        assert any("-m cgpud.guard " in c for c in guards(d.state_dir).values()), \
            f"the old release's guard (python -m cgpud.guard) is not running: {guards(d.state_dir)}"
        before = d.snapshot()

        point(site, ROOT)  # the package is upgraded in place
        text = upgrade(d)
        assert text.startswith("done "), f"{text}\n{d.log_text()}"
        assert d.proc.pid != old_pid

        wait_for(lambda: any("-m cgpud.sched.guard " in c for c in guards(d.state_dir).values()), 10,
                 "the new code's guard (python -m cgpud.sched.guard)")

        def scheduled() -> bool:
            with Client(str(d.socket)) as c:
                st = c.call("stats")
            return bool(st) and st[0]["freezes"] >= 2 and st[0]["thaws"] >= 2

        wait_for(scheduled, 10, "freezes and thaws by the new daemon")
        wait_for(lambda: frozen(group), 10, "the workload frozen again, by the new code")
        # (the new daemon's memory watch reads the workload's page at its first look after the takeover: a
        # snapshot before it showed meminfo without the process, once in a loaded full run)
        wait_for(lambda: "PID:" in open(d.path(f"0/{run_name}/meminfo")).read(), 15,
                 "the workload's memory, seen by the new daemon")
        after = d.snapshot()
    finally:
        out, err = run.communicate(timeout=60)
    assert {k: v for k, v in after.items() if k != "upgrade"} == {k: v for k, v in before.items() if k != "upgrade"}
    assert run.returncode == 0, err
    assert "could not deregister" not in err, err
    assert json.loads(out.splitlines()[-1])["iterations"] > 0
    assert run_name not in d.instances(0)
    assert "hot upgrade: taking over from pid" in d.log_text()
