"""The OCI runtime hook's Python forwarder (docs/containers.md).

    cgpu hook createRuntime|prestart|poststop|auto     the OCI state JSON on stdin
    python3 -S -m cgpud.containers.hook STAGE                     the same without the CLI's start-up

It does what the compiled hook (native/hook/cgpu-hook.c, installed as
`cgpu-hook`) does, byte for byte in what it sends and prints: the state goes
to the daemon as `{"op": "hook", "stage": STAGE, "state": {…}}` and the
daemon does the work (cgpud/containers/hookd.py). Exit 0, or 1 with one line on stderr,
`cgpu hook: …`; the runtime fails the start with it.

The only look at the container here: when `<bundle>/config.json` can be read
and does not contain `ALIYUN_COM_GPU_MEM_CONTAINER=`, the container cannot
ask for anything and the daemon is not contacted.

Settings, from the hook's own environment (not the container's):
  CGPUD_SOCKET            the daemon's control socket (or `cgpu --socket`)
  CGPU_HOOK_PASSTHROUGH=1 daemon unreachable at createRuntime: let the
                          container start unmanaged (one line) instead of failing it
  CGPU_HOOK_TIMEOUT       seconds to wait for the daemon (default 5)
A poststop that cannot reach the daemon exits 0 with one line: the daemon
deregisters a container whose cgroup is gone by itself once it runs.
"""
from __future__ import annotations

# Only the standard library's json/os/sys here, and the socket client when
# the daemon is asked: this runs for every container hooks.d starts.
import json
import os
import sys

STAGES = ("createRuntime", "prestart", "poststop", "auto")  # as cgpud/containers/hookd.py
AUTO_STATUSES = ("creating", "created", "stopped")  # the status tells `auto` (or no stage) what to do

PASSTHROUGH = "CGPU_HOOK_PASSTHROUGH"
TIMEOUT = "CGPU_HOOK_TIMEOUT"
DEFAULT_TIMEOUT = 5.0
MAX_STATE = 60 * 1024  # the daemon takes request lines of up to 64 KiB
MAX_CONFIG = 4 << 20  # as cgpud/containers/hookd.py
MARK = b"ALIYUN_COM_GPU_MEM_CONTAINER="
# (as native/common/cgpu.c: a Kubernetes container naming any of these is the daemon's to read)
KUBE, K8S_MARKS = b"io.kubernetes.cri.container-type", (b"ALIYUN_COM_GPU_", b"CGPU_DISABLE=",
                                                        b"cgpu.aliyun.com/allocation-")
NVD = b"NVIDIA_VISIBLE_DEVICES="  # (... unless privileged: its value believed, cgpud's own DaemonSet pod's)


def may_ask(bundle) -> bool:
    """False only when `<bundle>/config.json` was read whole and does not name
    the memory variable: then the container cannot ask for anything."""
    if not isinstance(bundle, str) or not bundle.startswith("/"):
        return True
    try:
        fd = os.open(os.path.join(bundle, "config.json"), os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except (OSError, ValueError):
        return True
    try:
        import stat

        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CONFIG:
            return True
        data = b""
        while len(data) <= MAX_CONFIG:
            chunk = os.read(fd, MAX_CONFIG + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:
        return True
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG or MARK in data:
        return True
    if KUBE not in data:
        return False
    if any(m in data for m in K8S_MARKS):
        return True
    if NVD not in data:
        return False
    from cgpud.containers.allotted import privileged
    try:
        return not privileged(json.loads(data))
    except ValueError:
        return True


def _passthrough() -> bool:
    return (os.environ.get(PASSTHROUGH) or "").strip().lower() in ("1", "true", "yes")


def _unreachable(why: str, removing: bool) -> int:
    if removing:
        print(f"cgpu hook: {why}; nothing removed now (cgpud deregisters a container whose cgroup is gone once it runs)",
              file=sys.stderr)
        return 0
    if _passthrough():
        print(f"cgpu hook: {why}; {PASSTHROUGH}=1: container left unmanaged", file=sys.stderr)
        return 0
    print(f"cgpu hook: {why} (set {PASSTHROUGH}=1 in the hook's env to start containers unmanaged then)",
          file=sys.stderr)
    return 1


def _say(message: str) -> int:
    print("cgpu hook: " + "".join(" " if ord(ch) < 0x20 else ch for ch in message), file=sys.stderr)
    return 1


def main(stage: str, stdin=None, socket: str | None = None) -> int:
    """Forward one stage (none given: `auto`, the stage read from the state's
    status); returns the exit status, having printed at most one line."""
    stage = stage or "auto"
    if stage not in STAGES:
        print(f"cgpu hook: unknown stage {stage}; one of {', '.join(STAGES)}", file=sys.stderr)
        return 2
    stream = stdin if stdin is not None else sys.stdin
    raw = getattr(stream, "buffer", stream).read(MAX_STATE + 1)
    if len(raw) > MAX_STATE:
        return _say(f"the OCI state on stdin is larger than {MAX_STATE} bytes")
    try:
        state = json.loads(raw)
    except ValueError:
        state = None
    if not isinstance(state, dict):
        return _say("the OCI state on stdin is not a JSON object")
    if not isinstance(state.get("id"), str) or not state["id"]:
        return _say('the OCI state on stdin has no "id"')
    if stage == "auto" and state.get("status") not in AUTO_STATUSES:
        status = state.get("status") if isinstance(state.get("status"), str) else "(none)"
        return _say(f"the OCI state's status is '{status}': with no stage (auto) the hook runs at "
                    "createRuntime or prestart (creating, created: join) or poststop (stopped: leave)")
    removing = stage == "poststop" or (stage == "auto" and state.get("status") == "stopped")
    if not may_ask(state.get("bundle")):
        return 0  # no ALIYUN_COM_GPU_MEM_CONTAINER in its config.json: left alone

    from cgpud.client import Client, ControlError, DaemonUnavailable

    try:
        timeout = float(os.environ.get(TIMEOUT) or DEFAULT_TIMEOUT)
    except ValueError:
        timeout = DEFAULT_TIMEOUT
    try:
        with Client(socket, timeout=timeout) as c:
            c.call("hook", stage=stage, state=state)
    except ControlError as exc:
        return _say(str(exc))
    except DaemonUnavailable as exc:
        return _unreachable(str(exc), removing)
    except OSError as exc:
        return _unreachable(f"cannot reach cgpud: {exc.strerror or exc}", removing)
    except ValueError:
        return _say("cgpud answered something that is not a reply")
    return 0


if __name__ == "__main__":  # python3 -S -m cgpud.containers.hook STAGE: the fast start (docs/containers.md)
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "auto", sys.stdin, os.environ.get("CGPUD_SOCKET")))
