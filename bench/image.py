"""bench/image: the DaemonSet's image (issue 48), this tree's against the tree before it (REF, the
reference: its own scripts/build-image.sh and Containerfile, `git archive`d), built here in the same run
from the same debootstrap root filesystems:

- its size per architecture (podman's count of its layers unpacked) and what a node pulls and unpacks
  (`podman save` of it: seconds and MB; a node's pull goes through the same layers);
- the time of a build from nothing (podman's --no-cache: every step run again, its downloads
  included; the root filesystems, made once per machine by scripts/rootfs.sh, their import into
  podman and zig's cache mount are kept);
- with --rebuild, the time of a build after a change of one source file of cgpud (a copy of the tree,
  the layer cache warm): what a developer waits for.

    .venv/bin/python bench/image.py [--arches amd64,arm64] [--old-arches amd64] [--ref 555a060] [--rebuild]

The old arm64 build is left out unless --old-arches names it: its pip step compiles pyfuse3 under
qemu-user (46 minutes when last measured). Needs root and podman; the images it makes are removed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "scripts" / "build-image.sh"
BASE_REF = "555a060"  # the commit before issue 48's image (the 1.29 GB one)


def build(tag: str, arch: str, *options: str, cwd: Path = ROOT) -> float:
    start = time.monotonic()
    r = subprocess.run([cwd / "scripts" / "build-image.sh", "--arch", arch, *options, tag], cwd=cwd,
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=4 * 3600)
    if r.returncode != 0:
        raise SystemExit(f"{cwd}: build-image.sh --arch {arch} {' '.join(options)} failed:\n"
                         f"{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return time.monotonic() - start


def tree(into: Path, ref: str | None, cold: bool = True) -> Path:
    """The tree at REF (git archive), or this one's tracked files as they are now (ref None); with
    cold, REF's build-image.sh builds from nothing."""
    if ref is not None:
        archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
        # (the old script has no --no-cache: its podman build is given it here)
        script = into / "scripts" / "build-image.sh"
        text = script.read_text()
        if cold and "--no-cache)" not in text:
            script.write_text(text.replace("podman build --pull=never", "podman build --no-cache --pull=never"))
        return into
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src, dst = ROOT / name, into / name
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return into


def size(image: str) -> int:
    out = subprocess.run(["podman", "image", "inspect", image], capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]["Size"]


def saved(image: str) -> tuple[float, int]:
    """Seconds and bytes of `podman save` of IMAGE (a docker-archive: the layers a node pulls)."""
    with tempfile.TemporaryDirectory(prefix="cgpud-bench-image-") as tmp:
        archive = Path(tmp) / "image.tar"
        start = time.monotonic()
        subprocess.run(["podman", "save", "--format", "docker-archive", "-o", archive, image], check=True,
                       capture_output=True, timeout=1800)
        return time.monotonic() - start, archive.stat().st_size


def remove(tag: str, arches: list[str]) -> None:
    subprocess.run(["podman", "manifest", "rm", tag], capture_output=True)
    for arch in arches:
        subprocess.run(["podman", "rmi", "-f", f"{tag}-{arch}"], capture_output=True)


def rebuild_after_a_change(tag: str, arch: str) -> float:
    """A copy of this tree, built once (from podman's cache: seconds), a line added to one module of
    cgpud, built again: the seconds of the second build."""
    with tempfile.TemporaryDirectory(prefix="cgpud-bench-image-tree-") as tmp:
        here = tree(Path(tmp), None)
        build(tag, arch, cwd=here)
        with open(here / "cgpud" / "cli" / "cgpu.py", "a") as f:
            f.write("# a change (bench/image.py)\n")
        return build(tag, arch, cwd=here)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arches", default="amd64,arm64")
    ap.add_argument("--old-arches", default="amd64")
    ap.add_argument("--ref", default=BASE_REF, help="the commit whose Containerfile is the reference")
    ap.add_argument("--rebuild", action="store_true", help="also time a rebuild after a source change")
    args = ap.parse_args()
    arches, old_arches = args.arches.split(","), [a for a in args.old_arches.split(",") if a]
    tag = f"localhost/cgpud-bench-image-{os.getpid()}"
    old = Path(tempfile.mkdtemp(prefix="cgpud-bench-image-old-"))
    tree(old, args.ref)
    rows: list[tuple[str, str, float, int, float, int]] = []
    try:
        for which, cwd, which_arches in (("new", ROOT, arches), (f"old ({args.ref})", old, old_arches)):
            for arch in which_arches:
                name = f"{tag}-{'new' if cwd == ROOT else 'old'}"
                took = build(name, arch, *(["--no-cache"] if cwd == ROOT else []), cwd=cwd)
                image = f"{name}-{arch}"
                rows.append((which, arch, took, size(image), *saved(image)))
                print(f"  built {which} {arch}: {took / 60:.1f} min", file=sys.stderr, flush=True)
        rebuilds = {arch: rebuild_after_a_change(f"{tag}-tree", arch) for arch in arches} if args.rebuild else {}
    finally:
        for suffix in ("new", "old", "tree"):
            remove(f"{tag}-{suffix}", arches + old_arches)
        shutil.rmtree(old, ignore_errors=True)
    load = os.getloadavg()[0]
    print(f"the DaemonSet's image, built here from nothing (--no-cache), load average {load:.1f}, {os.cpu_count()} CPUs:")
    print(f"  {'Containerfile':18} {'arch':6} {'size':>9} {'podman save':>18} {'cold build':>11}")
    for which, arch, took, bytes_, save_s, save_b in rows:
        print(f"  {which:18} {arch:6} {bytes_ / 1e6:6.0f} MB {save_b / 1e6:6.0f} MB {save_s:5.1f} s "
              f"{took / 60:7.1f} min")
    for arch, took in rebuilds.items():
        print(f"  new, {arch}: rebuilt after a change of cgpud/cli/cgpu.py in {took:.0f} s")


if __name__ == "__main__":
    main()
