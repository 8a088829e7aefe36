"""`cgpu node keep` (cgpud.k8s.nodekeeper): the install is undone when the DaemonSet goes, and only
then (docs/kubernetes.md, Helm). The decision from what the DaemonSet's watch told; the waiting at
SIGTERM for a deletion the watch has not brought yet; and the command on a prepared host tree with
no API server (it keeps the install). The whole path, `helm uninstall` on the real cluster:
tests/test_cluster_helm.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from cgpud.k8s import nodekeeper

DS = {"metadata": {"name": "cgpud", "namespace": "kube-system", "uid": "u1"}}


def test_only_a_daemonset_seen_going_undoes_the_install():
    seen = nodekeeper.Seen()
    assert nodekeeper.decide(seen)[0] is False  # never read: no undo on a doubt
    seen.listed([DS])
    assert nodekeeper.decide(seen) == (False, "the DaemonSet is still there (a pod restart, an upgrade or a drain): "
                                              "the node stays installed")
    seen.event("MODIFIED", {"metadata": {**DS["metadata"], "generation": 2}})  # helm upgrade: a new template
    assert nodekeeper.decide(seen)[0] is False
    seen.event("MODIFIED", {"metadata": {**DS["metadata"], "deletionTimestamp": "2026-11-27T15:00:00Z"}})
    assert nodekeeper.decide(seen)[0] is True  # (foreground deletion: being deleted)
    seen = nodekeeper.Seen()
    seen.listed([DS])
    seen.event("DELETED", DS)
    assert nodekeeper.decide(seen) == (True, "the DaemonSet was deleted: undoing cgpu node install")
    seen = nodekeeper.Seen()
    seen.listed([])  # (listed again after the watch broke: gone)
    assert nodekeeper.decide(seen)[0] is True


def test_at_sigterm_a_deletion_the_watch_brings_late_still_counts_and_a_present_one_waits_only_settle():
    k = nodekeeper.Keeper("kube-system", "cgpud")
    k._replace([DS])
    threading.Timer(0.3, k._event, ("DELETED", DS)).start()
    assert k.at_end(settle=30)[0] is True
    k = nodekeeper.Keeper("kube-system", "cgpud")
    k._replace([DS])
    assert k.at_end(settle=0.2)[0] is False


def test_the_command_keeps_the_install_when_it_cannot_ask(tmp_path):
    """No API server (no kubeconfig, not in a pod): at SIGTERM the host tree is left as installed."""
    host = tmp_path / "host"
    (host / "etc/cgpu").mkdir(parents=True)
    (host / "etc/cgpu/marker").write_text("installed")
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["KUBECONFIG"] = os.fspath(tmp_path / "none")
    p = subprocess.Popen([Path(sys.executable).parent / "cgpu", "node", "keep", "--host-root", host,
                          "--restart", "none"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 30
    out = ""
    while "keeping the node's install" not in out:  # (its line once its signal handlers are set)
        assert time.monotonic() < deadline and p.poll() is None, out
        out += p.stdout.readline()
    p.send_signal(signal.SIGTERM)
    out += p.communicate(timeout=30)[0]
    assert p.returncode == 0, out
    assert "could never be read: the node stays installed" in out, out
    assert (host / "etc/cgpu/marker").read_text() == "installed"
