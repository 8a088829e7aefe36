"""bench/deploy: the deployment's figures (issue 21), one run.

1. `cgpu node install` on a prepared host tree (containerd 1.6's own default
   config.toml, the programs built by native/Makefile as the image holds
   them): files written by the second run, against the first run's count
   as the reference; then the same after `cgpu node uninstall` (the tree
   byte for byte as before: yes/no). Goal: 0 written by the second run.
2. `kubectl kustomize deploy/kubernetes` (kustomize built into the real
   kubectl, offline): objects rendered and fields walked against the official
   `kubernetes` client's models, unknown fields found; reference: the same
   walk over a copy with one field misspelt (must find exactly 1).
   Goal: 0 unknown.

    .venv/bin/python bench/deploy.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.fspath(ROOT / "tests"))

from test_manifests import KINDS, kustomize, unknown  # noqa: E402  (the tests' walk, one definition)

from cgpud.containers.nodeinstall import install, uninstall  # noqa: E402


def tree(root: Path) -> dict:
    return {os.fspath(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(root.rglob("*"))}


def fields(data) -> int:
    if isinstance(data, dict):
        return len(data) + sum(fields(v) for v in data.values())
    if isinstance(data, list):
        return sum(fields(v) for v in data)
    return 0


def node_install() -> None:
    with tempfile.TemporaryDirectory(prefix="cgpu-bench-deploy-") as tmp:
        tmp = Path(tmp)
        src = tmp / "image"
        for args in ([f"BIN={src}/usr/local/libexec"], ["libcgpu", f"LIB={src}/usr/local/lib/cgpu"]):
            subprocess.run(["make", "-s", "-C", os.fspath(ROOT / "native"), *args], check=True, capture_output=True)
        host = tmp / "host"
        (host / "etc/containerd").mkdir(parents=True)
        conf = subprocess.run(["containerd", "config", "default"], capture_output=True, text=True, check=True).stdout
        (host / "etc/containerd/config.toml").write_text(conf)
        before = tree(host)
        runs = []
        for _ in range(2):
            t0 = time.perf_counter()
            r = install(os.fspath(host), os.fspath(src), restart="none")
            runs.append((len(r.written), len(r.kept), time.perf_counter() - t0))
        uninstall(os.fspath(host), restart="none")
        same = tree(host) == before
    (w1, k1, t1), (w2, k2, t2) = runs
    print("node install on a prepared host tree (containerd 1.6's default config.toml):")
    print(f"  first run:  {w1} files written, {k1} already in place ({t1 * 1000:.1f} ms)   <- reference")
    print(f"  second run: {w2} files written, {k2} already in place ({t2 * 1000:.1f} ms)   goal: 0 written")
    print(f"  after uninstall the host tree is as before: {'yes' if same else 'NO'}")


def manifests() -> None:
    t0 = time.perf_counter()
    docs = kustomize()
    took = time.perf_counter() - t0
    found = [u for d in docs for u in unknown(d, KINDS[d["kind"]], d["kind"])]
    with tempfile.TemporaryDirectory(prefix="cgpu-bench-kust-") as tmp:
        for f in (ROOT / "deploy/kubernetes").glob("*.yaml"):
            text = f.read_text()
            if f.name == "daemonset.yaml":
                text = text.replace("hostPID: true", "hostPid: true")
            (Path(tmp) / f.name).write_text(text)
        misspelt = [u for d in kustomize(Path(tmp)) for u in unknown(d, KINDS[d["kind"]], d["kind"])]
    print("kubectl kustomize deploy/kubernetes (offline):")
    print(f"  rendered {len(docs)} objects, {sum(fields(d) for d in docs)} fields walked in {took * 1000:.0f} ms")
    print(f"  unknown to the kubernetes client's models: {len(found)} {found or ''}  goal: 0")
    print(f"  reference, the same with hostPID misspelt: {len(misspelt)} {misspelt}")


if __name__ == "__main__":
    node_install()
    manifests()
