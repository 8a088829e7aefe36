"""The in-container library put into a container that joins through the OCI
hook alone (podman or runc with hooks.d, no cgpu-runtime to prepare its spec):
the same four mounts `containers.spec.add_library` adds to a prepared spec,
made by the daemon in the container's own mount namespace at createRuntime —
after the runtime has mounted the container's root filesystem and before it
pivots into it, the way NVIDIA's container hook mounts the driver's libraries.

    /run/cgpu-lib/libcgpu.so   the library (read-only)
    /run/cgpu                  the container's pages
    /run/cgpu/limits           again, read-only (only `usage` is writable)
    /etc/ld.so.preload         a file naming the library (read-only)

No environment can be set from a hook: the dynamic loader preloads the
library from /etc/ld.so.preload, and the library finds its pages at
/run/cgpu without CGPU_PAGE_DIR (docs/isolation.md).

Before the pivot the container's namespace still resolves absolute symbolic
links against the host's root: a path of the image that is a symbolic link
where a mount goes is refused (the container does not start), never followed.
Blocking (a subprocess): the daemon calls it from a worker thread.
"""
from __future__ import annotations

import errno
import os
import subprocess

from cgpud.containers.hookd import HookError
from cgpud.containers.spec import LIB_IN_CONTAINER, PAGES_IN_CONTAINER, PRELOAD
from cgpud.gpus import pages

# $1 root filesystem, $2 the library, $3 the pages' directory (host paths: visible before the pivot)
_SCRIPT = f"""
set -e
R=$1
for p in /run {os.path.dirname(LIB_IN_CONTAINER)} {LIB_IN_CONTAINER} {PAGES_IN_CONTAINER} /etc {PRELOAD}; do
    if [ -L "$R$p" ]; then echo "$p is a symbolic link in the image; no mount is made over it" >&2; exit 3; fi
done
mkdir -p "$R{os.path.dirname(LIB_IN_CONTAINER)}" "$R{PAGES_IN_CONTAINER}" "$R/etc"
[ -e "$R{LIB_IN_CONTAINER}" ] || : > "$R{LIB_IN_CONTAINER}"
[ -e "$R{PRELOAD}" ] || : > "$R{PRELOAD}"
mount --bind "$2" "$R{LIB_IN_CONTAINER}"
mount -o remount,bind,ro "$R{LIB_IN_CONTAINER}"
mount --bind "$3" "$R{PAGES_IN_CONTAINER}"
mount --bind "$3/limits" "$R{PAGES_IN_CONTAINER}/limits"
mount -o remount,bind,ro "$R{PAGES_IN_CONTAINER}/limits"
mount --bind "$3/ld.so.preload" "$R{PRELOAD}"
mount -o remount,bind,ro "$R{PRELOAD}"
"""


def rootfs_of(cid: str, config: dict, bundle: str) -> str:
    root = config.get("root")
    path = root.get("path") if isinstance(root, dict) else None
    if not isinstance(path, str) or not path or "\0" in path:
        raise HookError(f"container {cid}: its config.json names no root filesystem")
    return os.path.normpath(os.path.join(bundle, path))


def into_container(cid: str, pid: int, rootfs: str, library: str, where: str) -> None:
    """The container's pages made in `where`, and the library and them mounted into the mount
    namespace of its process `pid`; HookError (nothing left behind) if that cannot be done."""
    try:
        pages.prepare(where, preload=LIB_IN_CONTAINER)
    except OSError as exc:
        pages.remove(where)
        raise HookError(f"container {cid}: cannot make its GPU isolation pages in {where}: {exc.strerror}",
                        exc.errno or errno.EIO) from None
    try:
        r = subprocess.run(["nsenter", "-t", str(pid), "-m", "--", "/bin/sh", "-c", _SCRIPT, "sh", rootfs, library,
                            where], capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
        why = r.stderr.strip().splitlines()[-1] if r.returncode else ""
        if r.returncode and not why:
            why = f"exit status {r.returncode}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = str(exc)
    if why:
        pages.remove(where)
        raise HookError(f"container {cid}: cannot put the GPU isolation library into it: {why}")
