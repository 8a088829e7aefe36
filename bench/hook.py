"""bench/hook: what the OCI hook adds to a container start (issue 4).

One busybox bundle under runc, interleaved round by round:
  - no hooks (the reference: runc alone, measured in the same run);
  - for each hook form — the compiled forwarder `cgpu-hook` (native/hook/cgpu-hook.c),
    `cgpu hook`, `python3 -S -m cgpud.containers.hook` — at createRuntime and poststop:
      managed:   ALIYUN_COM_GPU_MEM_CONTAINER=1, registered, attached, removed;
      unmanaged: no GPU variables (what every other container pays when
                 hooks.d says `always`).
Each sample is `runc run -d` + `runc delete -f` of a `sleep` container, wall
time. Printed: p50/p99 of each, and the hook's added time (with-hook minus
the same round's no-hook sample), p50/p99 and as a ratio of runc alone's p50.
Goal: <= 50 ms added per container.

Also: one hook process alone per form (container without GPU variables); the
time from starting `runc run -d` to the instance's directory being visible in
the tree, per form, against `runc run -d` alone returning; and, with
--podman, `podman run --rm` of a container without GPU variables with and
without --hooks-dir (hooks.d `always`), and of a managed one.

    .venv/bin/python bench/hook.py [--rounds 30] [--podman]
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
from common import ROOT, daemon, pct, tool  # noqa: E402

FORMS = {"c": "cgpu-hook", "cli": "cgpu hook", "module": "python3 -S -m cgpud.containers.hook"}


def ms(x: float) -> str:
    return f"{x * 1e3:7.1f} ms"


def make_rootfs(base: str) -> str:
    busybox = shutil.which("busybox")
    if busybox is None or shutil.which("runc") is None:
        raise SystemExit("bench/hook needs runc and busybox-static: run scripts/setup.sh")
    rootfs = os.path.join(base, "rootfs")
    os.makedirs(os.path.join(rootfs, "bin"))
    shutil.copy(busybox, os.path.join(rootfs, "bin", "busybox"))
    for applet in ("sh", "sleep", "true"):
        os.symlink("busybox", os.path.join(rootfs, "bin", applet))
    for d in ("proc", "sys", "dev", "etc", "tmp"):
        os.makedirs(os.path.join(rootfs, d), exist_ok=True)
    return rootfs


def hook_entry(form: str, stage: str, socket: str) -> dict:
    """One hook as config.json lists it."""
    env = [f"CGPUD_SOCKET={socket}"]
    if form == "c":
        path = tool("cgpu-hook")
        if not os.access(path, os.X_OK):
            raise SystemExit(f"{path} is missing: run scripts/setup.sh (it builds native/hook/cgpu-hook.c)")
        return {"path": path, "args": ["cgpu-hook", stage], "env": env, "timeout": 20}
    if form == "cli":
        return {"path": tool("cgpu"), "args": ["cgpu", "hook", stage], "env": env, "timeout": 20}
    import cgpud
    where = os.path.dirname(os.path.dirname(os.path.abspath(cgpud.__file__)))
    return {"path": sys.executable, "args": ["python3", "-S", "-m", "cgpud.containers.hook", stage],
            "env": env + [f"PYTHONPATH={where}"], "timeout": 20}


def make_bundle(base: str, template: dict, rootfs: str, env: dict, socket: str | None, form: str = "c") -> str:
    b = tempfile.mkdtemp(prefix="bundle-", dir=base)
    c = json.loads(json.dumps(template))
    c["root"] = {"path": rootfs, "readonly": True}
    c["process"].update(terminal=False, args=["sleep", "60"], env=["PATH=/bin"] + [f"{k}={v}" for k, v in env.items()])
    if socket:
        c["hooks"] = {stage: [hook_entry(form, stage, socket)] for stage in ("createRuntime", "poststop")}
    with open(os.path.join(b, "config.json"), "w") as f:
        json.dump(c, f)
    return b


def bench_runc(d, base: str, rounds: int) -> None:
    root = os.path.join(base, "runc-root")
    runc = lambda *a: ["runc", "--root", root, *a]  # noqa: E731
    subprocess.run(["runc", "spec"], cwd=base, check=True)
    with open(os.path.join(base, "config.json")) as f:
        template = json.load(f)
    rootfs = make_rootfs(base)
    managed = {"ALIYUN_COM_GPU_MEM_CONTAINER": "1"}
    bundles = {"no hook": make_bundle(base, template, rootfs, {}, None)}
    for form in FORMS:
        bundles[f"{form}, managed"] = make_bundle(base, template, rootfs, managed, d.socket, form)
        bundles[f"{form}, unmanaged"] = make_bundle(base, template, rootfs, {}, d.socket, form)
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
    for _ in range(rounds):
        for k, b in bundles.items():
            samples[k].append(start_stop(b))
    ref = pct(samples["no hook"], 50)
    print(f"runc run -d + runc delete -f, {rounds} rounds interleaved:")
    for k, s in samples.items():
        print(f"  {k:16s} p50 {ms(pct(s, 50))}  p99 {ms(pct(s, 99))}")
    print("added to a container (createRuntime + poststop), against runc alone (p50 "
          f"{ref * 1e3:.1f} ms) in this run; goal <= 50 ms:")
    for k in bundles:
        if k == "no hook":
            continue
        form, kind = k.split(", ")
        added = [w - n for w, n in zip(samples[k], samples["no hook"])]
        p50, p99 = pct(added, 50), pct(added, 99)
        print(f"  {FORMS[form]:26s} {kind:9s}: p50 {ms(p50)}  p99 {ms(p99)}  = {p50 / ref:5.2f}x runc alone"
              f"  {'met' if p50 <= 0.050 else 'MISSED'}")

    empty = json.dumps({"id": "0" * 64, "pid": 1, "bundle": bundles["no hook"]}).encode()
    for form in FORMS:  # one hook process alone, for a container without GPU variables
        entry = hook_entry(form, "createRuntime", d.socket)
        env = dict(e.split("=", 1) for e in entry["env"])
        one = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            subprocess.run([entry["path"], *entry["args"][1:]], input=empty, env=env, check=True)
            one.append(time.perf_counter() - t0)
        print(f"one hook process ({FORMS[form]}), no GPU variables: p50 {ms(pct(one, 50))}  p99 {ms(pct(one, 99))}")

    # one managed container's two hook processes alone, against a container started without hooks
    cid = secrets.token_hex(32)
    subprocess.run(runc("run", "-d", "--bundle", bundles["no hook"], cid), stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    try:
        pid = json.loads(subprocess.run(runc("state", cid), capture_output=True, check=True).stdout)["pid"]
        env = {"CGPUD_SOCKET": d.socket}
        add, remove = [], []
        for _ in range(rounds):
            state = json.dumps({"id": secrets.token_hex(32), "pid": pid, "bundle": bundles["c, managed"]}).encode()
            for stage, into in (("createRuntime", add), ("poststop", remove)):
                t0 = time.perf_counter()
                subprocess.run([tool("cgpu-hook"), stage], input=state, env=env, check=True)
                into.append(time.perf_counter() - t0)
        print(f"one cgpu-hook process, managed: createRuntime (registered) p50 {ms(pct(add, 50))}  "
              f"p99 {ms(pct(add, 99))}; poststop (deregistered) p50 {ms(pct(remove, 50))}  p99 {ms(pct(remove, 99))}")
    finally:
        subprocess.run(runc("delete", "-f", cid), capture_output=True)

    def run_returns(bundle: str) -> float:
        cid = secrets.token_hex(32)
        t0 = time.perf_counter()
        subprocess.run(runc("run", "-d", "--bundle", bundle, cid), stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        took = time.perf_counter() - t0
        subprocess.run(runc("delete", "-f", cid), check=True, capture_output=True)
        return took

    def visible(bundle: str) -> float:
        """Seconds from starting `runc run -d` to the instance's directory existing."""
        cid = secrets.token_hex(32)
        where = os.path.join(d.mount, "0", cid[:12])
        t0 = time.perf_counter()
        p = subprocess.Popen(runc("run", "-d", "--bundle", bundle, cid), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not os.path.exists(where):
            if time.perf_counter() - t0 > 10:
                raise SystemExit(f"{where} did not appear in 10 s")
            time.sleep(0.0002)
        took = time.perf_counter() - t0
        p.wait()
        subprocess.run(runc("delete", "-f", cid), check=True, capture_output=True)
        return took

    alone, seen = [], {form: [] for form in FORMS}
    for _ in range(rounds):
        alone.append(run_returns(bundles["no hook"]))
        for form in FORMS:
            seen[form].append(visible(bundles[f"{form}, managed"]))
    print(f"`runc run -d` alone, until it returns: p50 {ms(pct(alone, 50))}  p99 {ms(pct(alone, 99))}")
    for form in FORMS:
        s = seen[form]
        print(f"runc run -d -> instance directory visible ({FORMS[form]}): p50 {ms(pct(s, 50))}  "
              f"p99 {ms(pct(s, 99))}  = {pct(s, 50) / pct(alone, 50):5.2f}x runc run alone")


def bench_podman(d, base: str, rounds: int) -> None:
    """podman run --rm, with and without our hooks.d entry (the shipped file
    with this venv's cgpu-hook), podman isolated by tests/test_podman.py's Podman."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_podman import Podman

    podman = Podman(d)
    try:
        kinds = {"no hooks.d": (False, {}), "hooks.d, no GPU variables": (True, {}),
                 "hooks.d, managed": (True, {"ALIYUN_COM_GPU_MEM_CONTAINER": "1"})}

        def once(hooks: bool, genv: dict) -> float:
            t0 = time.perf_counter()
            p = podman.run(genv, "true", hooks=hooks)
            if p.returncode:
                raise SystemExit(f"podman run failed: {p.stderr}")
            return time.perf_counter() - t0

        for hooks, genv in kinds.values():
            once(hooks, genv)
        samples = {k: [] for k in kinds}
        for _ in range(rounds):
            for k, (hooks, genv) in kinds.items():
                samples[k].append(once(hooks, genv))
        ref = pct(samples["no hooks.d"], 50)
        print(f"podman run --rm (runc, busybox `true`), {rounds} rounds interleaved:")
        for k, s in samples.items():
            line = f"  {k:26s} p50 {ms(pct(s, 50))}  p99 {ms(pct(s, 99))}"
            if k != "no hooks.d":
                added = [w - n for w, n in zip(s, samples["no hooks.d"])]
                line += f"  added p50 {ms(pct(added, 50))} p99 {ms(pct(added, 99))} = {pct(added, 50) / ref:5.2f}x"
            print(line)
    finally:
        podman.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--podman", action="store_true", help="also podman run with and without hooks.d")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="cgpud-bench-hook-")
    try:
        with daemon(handle=True) as d:
            bench_runc(d, base, args.rounds)
            if args.podman:
                bench_podman(d, base, max(5, args.rounds // 2))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
