"""The README's podman example works as written on this kind of host
(issue 15): its lines are read from README.md (after the
`readme-podman-example` marker), so the test fails if the README drifts.

What is changed to run it inside a test, and only that: `make install-hooks`
gets a DESTDIR (the hook is staged, not put on
the host) and the hooks.d file the example names gets that staged path and
the test daemon's socket, /run/cgpu_km is the test daemon's mount, /tmp/rootfs
a temporary directory, and podman keeps its containers in storage of its own
(CONTAINERS_STORAGE_CONF). The flags — `--runtime runc`, the `--ulimit`s,
`--hooks-dir` — are the README's."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from test_runc import _tool

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- readme-podman-example"


def example() -> str:
    text = (ROOT / "README.md").read_text()
    assert MARKER in text, "README.md lost its podman example"
    block = re.search(r"```sh\n(.*?)```", text[text.index(MARKER):], re.S)
    assert block, "no sh block after the marker"
    return block.group(1)


def test_the_readme_podman_example_works_as_written(daemon, tmp_path):
    _tool("podman"), _tool("runc"), _tool("busybox")
    script = example()
    assert "make install-hooks" in script and "--hooks-dir deploy/hooks.d" in script and "sudo" not in script
    stage = tmp_path / "stage"
    hooks = tmp_path / "hooks.d"
    hooks.mkdir()
    spec = json.loads((ROOT / "deploy" / "hooks.d" / "cgpu-hook.json").read_text())
    named = spec["hook"]["path"]
    spec["hook"]["path"] = f"{stage}{named}"  # where `make install-hooks DESTDIR=…` staged what the file names
    spec["hook"]["env"] = [f"CGPUD_SOCKET={daemon.socket}"]
    (hooks / "cgpu-hook.json").write_text(json.dumps(spec))
    rootfs = tmp_path / "rootfs"
    script = (script.replace("make install-hooks", f"make -s install-hooks DESTDIR={stage}")
              .replace("--hooks-dir deploy/hooks.d", f"--hooks-dir {hooks}")
              .replace("/run/cgpu_km", os.fspath(daemon.mount))
              .replace("/tmp/rootfs", os.fspath(rootfs)))
    storage = tmp_path / "storage.conf"
    storage.write_text(f'[storage]\ndriver = "vfs"\nrunroot = "{tmp_path}/runroot"\ngraphroot = "{tmp_path}/root"\n')
    parents = {p for p in Path("/sys/fs/cgroup").glob("*/libpod_parent")} | \
        ({Path("/sys/fs/cgroup/libpod_parent")} if Path("/sys/fs/cgroup/libpod_parent").exists() else set())
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, CONTAINERS_STORAGE_CONF=os.fspath(storage)))
    try:
        assert r.returncode == 0, r.stderr
        assert os.access(stage / named.lstrip("/"), os.X_OK), "install-hooks did not put the hook where hooks.d names it"
        assert "6337173913" in r.stdout.split(), r.stdout  # cat's line (podman rm prints the ID after it)
        assert daemon.instances(0) == [], "the container's instance stayed after podman rm"
    finally:
        subprocess.run(["podman", "rm", "-a", "-f", "-t", "0"], capture_output=True,
                       env=dict(os.environ, CONTAINERS_STORAGE_CONF=os.fspath(storage)))
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            where = line.split()[4]
            if where.startswith(f"{tmp_path}/"):
                subprocess.run(["umount", "-l", where], capture_output=True)
        for g in {p for p in Path("/sys/fs/cgroup").glob("*/libpod_parent")} - parents:
            for sub in [*sorted((d for d in g.rglob("*") if d.is_dir()), reverse=True), g]:
                try:
                    sub.rmdir()
                except OSError:
                    pass  # (a process on its way out: left as podman left it)
        shutil.rmtree(tmp_path / "root", ignore_errors=True)


def test_the_readme_docker_paragraph_installs_the_wrapper_first():
    """Issue 21: the Docker paragraph went straight to `cgpu runtime-config docker`, which named a
    wrapper nothing had installed; every `docker run --runtime=cgpu` then failed."""
    text = (ROOT / "README.md").read_text()
    para = text[text.index("Docker and containerd do not read hooks.d"):]
    para = para[:para.index("```")]
    assert "make install-hooks" in para and para.index("make install-hooks") < para.index("cgpu runtime-config docker")
