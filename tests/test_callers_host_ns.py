"""CGPUD_HOST_NS_PID (control.callers): a node whose container runtime runs in a mount namespace of
its own names a process of it, and callers from that namespace count as the host; nothing else does."""
import os
import subprocess
import time

from cgpud.control import callers


def _own_mount_namespace() -> subprocess.Popen:
    p = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "60"])
    for _ in range(200):  # (until unshare has exec'd sleep in the new namespace)
        if os.readlink(f"/proc/{p.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"):
            return p
        time.sleep(0.01)
    p.kill()
    raise AssertionError("unshare made no mount namespace")


def test_a_named_process_namespaces_count_as_the_host_and_others_do_not(monkeypatch):
    other = _own_mount_namespace()
    try:
        theirs = (callers._ns(other.pid, "pid"), callers._ns(other.pid, "mnt"))
        monkeypatch.delenv(callers.HOST_NS_PID, raising=False)
        assert theirs not in callers.host_namespaces()  # a container's mount namespace, as far as we know
        monkeypatch.setenv(callers.HOST_NS_PID, str(other.pid))
        assert theirs in callers.host_namespaces()
        monkeypatch.setenv(callers.HOST_NS_PID, "1; rm -rf /")  # not a pid: ignored, with a warning
        assert theirs not in callers.host_namespaces()
    finally:
        other.kill()
        other.wait()
