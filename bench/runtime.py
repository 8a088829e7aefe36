"""bench/runtime: what cgpu-runtime (native/runtime) adds (issue 13).

1. `docker run --rm` of a busybox container, against Debian's dockerd of this
   run's own (as tests/test_docker.py starts it), interleaved round by round:
     runc         --runtime=runc, no variables (the reference);
     cgpu, asks   --runtime=cgpu with the seed's ALIYUN_COM_GPU_* variables:
                  prepare, hooks, registration, removal;
   Goal: added p50 <= 50 ms.
2. The wrapper alone, for a container that does not ask (what every other
   container on the host pays): runc `create` + `delete` of a bundle, straight
   and through cgpu-runtime, interleaved. Goal: added p50 <= 2 ms.
3. Never a half-written config.json: `--kills` creates of containers that
   ask, each with the wrapper or the daemon killed -9 at a random moment
   (the daemon is started again after it is killed); afterwards each
   config.json must parse, and be either the original or the complete new
   spec. Goal: 0 bad.

    .venv/bin/python bench/runtime.py [--rounds 20] [--kills 200]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from common import cgpud_cmd, daemon, pct, tool  # noqa: E402

SEED = ["-e", "ALIYUN_COM_GPU_MEM_CONTAINER=1", "-e", "ALIYUN_COM_GPU_MEM_DEV=15", "-e", "NVIDIA_VISIBLE_DEVICES=0"]


def ms(x: float) -> str:
    return f"{x * 1e3:7.2f} ms"


def docker_rounds(run, rounds: int) -> None:
    from test_docker import Dockerd

    dk = Dockerd(run)
    try:
        base = ["run", "--rm", "--network", "none"]
        for _ in range(2):  # warm up both paths
            dk(*base, "--runtime=runc", "cgpud-busybox:test", "true")
            dk(*base, "--runtime=cgpu", *SEED, "cgpud-busybox:test", "true")
        plain, asks = [], []
        for _ in range(rounds):
            for kind, args, out in (("runc", ["--runtime=runc"], plain), ("cgpu", ["--runtime=cgpu", *SEED], asks)):
                t = time.perf_counter()
                p = dk(*base, *args, "cgpud-busybox:test", "true")
                out.append(time.perf_counter() - t)
                if p.returncode:
                    raise SystemExit(f"docker run ({kind}) failed: {p.stderr}")
        added = [a - b for a, b in zip(asks, plain)]
        print(f"docker run --rm, runc:                 p50 {ms(pct(plain, 50))}  p99 {ms(pct(plain, 99))}")
        print(f"docker run --rm, cgpu, asks (seed env): p50 {ms(pct(asks, 50))}  p99 {ms(pct(asks, 99))}")
        print(f"added by cgpu-runtime + hooks: p50 {ms(pct(added, 50))} p99 {ms(pct(added, 99))} "
              f"({pct(asks, 50) / pct(plain, 50):.2f}x runc's p50; goal: added p50 <= 50 ms)")
    finally:
        dk.cleanup()


def bundle(base: str, env: list[str]) -> str:
    from test_docker import busybox_tar
    import io
    import tarfile

    b = os.path.join(base, f"b-{secrets.token_hex(4)}")
    rootfs = os.path.join(b, "rootfs")
    os.makedirs(rootfs)
    with tarfile.open(fileobj=io.BytesIO(busybox_tar())) as tar:
        tar.extractall(rootfs, filter="fully_trusted")
    subprocess.run(["runc", "spec", "--bundle", b], check=True)
    with open(os.path.join(b, "config.json")) as f:
        spec = json.load(f)
    spec["process"].update(terminal=False, args=["true"], env=["PATH=/bin", *env])
    spec["root"] = {"path": rootfs, "readonly": True}
    with open(os.path.join(b, "config.json"), "w") as f:
        json.dump(spec, f)
    return b


def wrapper_rounds(base: str, rounds: int) -> None:
    wrapper = tool("cgpu-runtime")
    b = bundle(base, ["FOO=1"])
    root = os.path.join(base, "runc-root")
    env = dict(os.environ, CGPUD_SOCKET=os.path.join(base, "none.sock"))

    def once(front: list[str]) -> float:
        cid = secrets.token_hex(8)
        t = time.perf_counter()
        for args in (["create", "--bundle", b, cid], ["delete", "-f", cid]):
            with open(os.path.join(base, "runc.log"), "w+") as log:  # (not a pipe: the created init keeps it open)
                p = subprocess.run([*front, "--root", root, *args], stdout=log, stderr=log, env=env,
                                   stdin=subprocess.DEVNULL)
                if p.returncode:
                    log.seek(0)
                    raise SystemExit(f"{front} {args}: {log.read()}")
        return time.perf_counter() - t

    for _ in range(3):
        once(["runc"]), once([wrapper])
    straight, wrapped = [], []
    for _ in range(rounds):
        straight.append(once(["runc"]))
        wrapped.append(once([wrapper]))
    added = [w - s for w, s in zip(wrapped, straight)]
    print(f"runc create+delete, straight:           p50 {ms(pct(straight, 50))}  p99 {ms(pct(straight, 99))}")
    print(f"runc create+delete, through the wrapper: p50 {ms(pct(wrapped, 50))}  p99 {ms(pct(wrapped, 99))}")
    print(f"added by cgpu-runtime for a container that does not ask: p50 {ms(pct(added, 50))} "
          f"(two wrapper runs per sample; {pct(wrapped, 50) / pct(straight, 50):.3f}x; goal: p50 <= 2 ms)")


def kill_rounds(base: str, kills: int, seed: int) -> None:
    """Creates through the wrapper, each cut by kill -9 of the wrapper or the daemon."""
    rng = random.Random(seed)
    wrapper = tool("cgpu-runtime")
    fake = os.path.join(base, "fake-runc")
    with open(fake, "w") as f:
        f.write("#!/bin/sh\nexit 0\n")
    os.chmod(fake, 0o755)
    tmp = tempfile.mkdtemp(prefix="cgpud-bench-kill-")
    sock = os.path.join(tmp, "cgpud.sock")
    mnt = os.path.join(tmp, "mnt")

    def start():
        p = subprocess.Popen(cgpud_cmd() + ["serve", "--gpus", "sim:T4", "--mount", mnt, "--state-dir",
                                            os.path.join(tmp, "state"), "--socket", sock, "--dev-dir",
                                            os.path.join(tmp, "dev"), "--metrics-addr", "off",
                                            "--log-level", "warning"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.01)
        return p

    proc = start()
    bad = originals = complete = daemon_kills = 0
    try:
        for i in range(kills):
            b = os.path.join(base, f"k{i}")
            os.makedirs(b)
            original = {"ociVersion": "1.0.2", "process": {"args": ["true"], "env": [
                "ALIYUN_COM_GPU_MEM_CONTAINER=1", f"PAD={'x' * rng.randrange(1, 200_000)}"]}}
            with open(os.path.join(b, "config.json"), "w") as f:
                json.dump(original, f)
            w = subprocess.Popen([wrapper, "create", "--bundle", b, secrets.token_hex(8)],
                                 env=dict(os.environ, CGPUD_SOCKET=sock, CGPU_RUNTIME_REAL=fake),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(0, 0.01))
            if rng.random() < 0.25:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                daemon_kills += 1
                w.wait()
                subprocess.run(["fusermount3", "-uz", mnt], capture_output=True)
                proc = start()
            else:
                w.send_signal(signal.SIGKILL)
                w.wait()
            time.sleep(0.02)  # a write the daemon had begun finishes
            try:
                with open(os.path.join(b, "config.json")) as f:
                    now = json.load(f)
            except ValueError:
                bad += 1
                continue
            if now == original:
                originals += 1
            elif {k: v for k, v in now.items() if k != "hooks"} == original and "poststop" in now.get("hooks", {}):
                complete += 1
            else:
                bad += 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        subprocess.run(["fusermount3", "-uz", mnt], capture_output=True)
    print(f"kill -9 during {kills} creates ({daemon_kills} of the daemon, the rest of the wrapper): "
          f"{originals} original, {complete} complete new, {bad} half-written or broken (goal 0)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip-docker", action="store_true")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="cgpud-bench-rt-")
    with daemon(handle=True, extra=["--hook-path", tool("cgpu-hook")]) as run:
        if not args.skip_docker:
            docker_rounds(run, args.rounds)
    wrapper_rounds(base, args.rounds * 5)
    kill_rounds(base, args.kills, args.seed)


if __name__ == "__main__":
    main()
