"""bench/hook: what the OCI hook adds to a container start (issue 4).

One busybox bundle under runc, three ways, interleaved round by round:
  - no hooks;
  - hooks (`cgpu hook createRuntime` / `poststop`) and ALIYUN_COM_GPU_MEM_CONTAINER=1:
    the container is registered, attached, and removed again;
  - hooks, no GPU variables: the hook runs and leaves the container alone
    (what every other container pays when hooks.d says `always`);
  - the same two with the hook started as `python3 -S -m cgpud.hook` (no
    site, no click).
Each sample is `runc run -d` + `runc delete -f` of a `sleep` container, wall
time. Printed: p50/p99 of each, and the hook's added time (p50 and p99 of
with-hook minus the same round's without-hook). Goal: <= 50 ms added.

Also: the time from starting `runc run -d` to the instance's directory being
visible in the tree (polled every ~0.2 ms).

    .venv/bin/python bench/hook.py [--rounds 30]
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import daemon, pct, tool  # noqa: E402


def ms(x: float) -> str:
    return f"{x * 1e3:7.1f} ms"


def make_rootfs(base: str) -> str:
    busybox = shutil.which("busybox")
    if busybox is None or shutil.which("runc") is None:
        raise SystemExit("bench/hook needs runc and busybox-static: run scripts/setup.sh")
    rootfs = os.path.join(base, "rootfs")
    os.makedirs(os.path.join(rootfs, "bin"))
    shutil.copy(busybox, os.path.join(rootfs, "bin", "busybox"))
    for applet in ("sh", "sleep"):
        os.symlink("busybox", os.path.join(rootfs, "bin", applet))
    return rootfs


def hook_entry(form: str, stage: str, socket: str) -> dict:
    """One hook as config.json lists it: the `cgpu hook` CLI, or the bare
    module under `python3 -S` (no site, no click: the fastest start)."""
    if form == "cli":
        return {"path": tool("cgpu"), "args": ["cgpu", "hook", stage], "env": [f"CGPUD_SOCKET={socket}"], "timeout": 20}
    import cgpud
    where = os.path.dirname(os.path.dirname(os.path.abspath(cgpud.__file__)))
    return {"path": sys.executable, "args": ["python3", "-S", "-m", "cgpud.hook", stage],
            "env": [f"CGPUD_SOCKET={socket}", f"PYTHONPATH={where}"], "timeout": 20}


def make_bundle(base: str, template: dict, rootfs: str, env: dict, socket: str | None, form: str = "cli") -> str:
    b = tempfile.mkdtemp(prefix="bundle-", dir=base)
    c = json.loads(json.dumps(template))
    c["root"] = {"path": rootfs, "readonly": True}
    c["process"].update(terminal=False, args=["sleep", "60"], env=["PATH=/bin"] + [f"{k}={v}" for k, v in env.items()])
    if socket:
        c["hooks"] = {stage: [hook_entry(form, stage, socket)] for stage in ("createRuntime", "poststop")}
    with open(os.path.join(b, "config.json"), "w") as f:
        json.dump(c, f)
    return b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="cgpud-bench-hook-")
    root = os.path.join(base, "runc-root")
    runc = lambda *a: ["runc", "--root", root, *a]  # noqa: E731
    subprocess.run(["runc", "spec"], cwd=base, check=True)
    with open(os.path.join(base, "config.json")) as f:
        template = json.load(f)
    rootfs = make_rootfs(base)
    try:
        with daemon(handle=True) as d:
            bundles = {
                "no hook": make_bundle(base, template, rootfs, {}, None),
                "hook, managed": make_bundle(base, template, rootfs, {"ALIYUN_COM_GPU_MEM_CONTAINER": "1"}, d.socket),
                "hook, unmanaged": make_bundle(base, template, rootfs, {}, d.socket),
                "-S hook, managed": make_bundle(base, template, rootfs, {"ALIYUN_COM_GPU_MEM_CONTAINER": "1"},
                                                d.socket, "module"),
                "-S hook, unmanaged": make_bundle(base, template, rootfs, {}, d.socket, "module"),
            }

            errlog = os.path.join(base, "runc.err")

            def start_stop(bundle: str) -> float:
                cid = secrets.token_hex(32)
                t0 = time.perf_counter()
                # runc -d hands its stdio to the container: a file, never a pipe we would wait on
                with open(errlog, "w+") as err:
                    p = subprocess.run(runc("run", "-d", "--bundle", bundle, cid), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=err)
                    if p.returncode:
                        err.seek(0)
                        raise SystemExit(f"runc run failed: {err.read()}")
                subprocess.run(runc("delete", "-f", cid), check=True, capture_output=True)
                return time.perf_counter() - t0

            for b in bundles.values():  # warm up the page cache
                start_stop(b)
            samples: dict[str, list[float]] = {k: [] for k in bundles}
            for _ in range(args.rounds):
                for k, b in bundles.items():
                    samples[k].append(start_stop(b))
            print(f"runc run -d + runc delete -f, {args.rounds} rounds interleaved:")
            for k, s in samples.items():
                print(f"  {k:16s} p50 {ms(pct(s, 50))}  p99 {ms(pct(s, 99))}")
            for k in bundles:
                if k == "no hook":
                    continue
                added = [w - n for w, n in zip(samples[k], samples["no hook"])]
                print(f"  added by {k:18s}: p50 {ms(pct(added, 50))}  p99 {ms(pct(added, 99))}  (goal <= 50 ms)")
            for form in ("cli", "module"):  # one hook process alone, for a container without GPU variables
                entry = hook_entry(form, "createRuntime", d.socket)
                state = json.dumps({"id": "0" * 64, "pid": 1, "bundle": bundles["no hook"]}).encode()
                env = dict(e.split("=", 1) for e in entry["env"])
                one = []
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    subprocess.run([entry["path"], *entry["args"][1:]], input=state, env=env, check=True)
                    one.append(time.perf_counter() - t0)
                print(f"one hook process ({' '.join(entry['args'][:3])}…), no GPU variables: "
                      f"p50 {ms(pct(one, 50))}  p99 {ms(pct(one, 99))}")

            def visible(bundle: str) -> list[float]:
                """Seconds from starting `runc run -d` to the instance's directory existing."""
                seen = []
                for _ in range(args.rounds):
                    cid = secrets.token_hex(32)
                    where = os.path.join(d.mount, "0", cid[:12])
                    t0 = time.perf_counter()
                    p = subprocess.Popen(runc("run", "-d", "--bundle", bundle, cid), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    while not os.path.exists(where):
                        if time.perf_counter() - t0 > 10:
                            raise SystemExit(f"{where} did not appear in 10 s")
                        time.sleep(0.0002)
                    seen.append(time.perf_counter() - t0)
                    p.wait()
                    subprocess.run(runc("delete", "-f", cid), check=True, capture_output=True)
                return seen

            # runc run -> the instance's directory in the tree
            for k in ("hook, managed", "-S hook, managed"):
                seen = visible(bundles[k])
                print(f"runc run -d -> instance directory visible ({k.split(',')[0]}): "
                      f"p50 {ms(pct(seen, 50))}  p99 {ms(pct(seen, 99))}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
