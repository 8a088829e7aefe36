"""Two runs' cluster tiers on one host (tests/cluster.py, Cluster._take_the_node): the kubelet's
device plugin directory and the extender's address are fixed, so a second run's cluster waits for
the first's to end instead of colliding with it (it failed at once before, "another kubelet runs").
The lock file is the test's own, not the host's."""
from __future__ import annotations

import fcntl
import os
import threading
import time
import types

import pytest

import cluster


def test_a_second_cluster_waits_for_the_first_to_end_then_takes_the_node(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cluster, "TIER_LOCK", os.fspath(tmp_path / "tier.lock"))
    first, second = types.SimpleNamespace(), types.SimpleNamespace()
    cluster.Cluster._take_the_node(first)
    took = threading.Event()
    t = threading.Thread(target=lambda: (cluster.Cluster._take_the_node(second), took.set()), daemon=True)
    t.start()
    assert not took.wait(1.0), "the second took the node while the first held it"
    assert "waiting for it to end" in capsys.readouterr().err
    os.close(first.tier_lock)  # (the first's cleanup)
    assert took.wait(10), "the second never took the node once the first had ended"
    t.join(5)
    with open(tmp_path / "tier.lock") as f:  # held by the second: nobody else takes it
        with pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(second.tier_lock)


def test_a_cluster_held_past_the_wait_fails_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "TIER_LOCK", os.fspath(tmp_path / "tier.lock"))
    monkeypatch.setattr(cluster, "TIER_WAIT_S", 1)
    holder = types.SimpleNamespace()
    cluster.Cluster._take_the_node(holder)
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="another run's cluster held .*tier.lock"):
        cluster.Cluster._take_the_node(types.SimpleNamespace())
    assert time.monotonic() - t0 >= 1
    os.close(holder.tier_lock)


def test_a_cluster_that_never_took_the_node_leaves_the_other_runs_host_alone(tmp_path, monkeypatch):
    """A run whose cluster gave up waiting cleans up: what appeared on the host meanwhile (a pod's
    network namespace, the CNI bridge's name, /k8s.io cgroups) is the running cluster's, not its own
    (before, it unmounted the other run's pods' network namespaces: 1.35.4 run, 2026-12-02)."""
    c = cluster.Cluster.__new__(cluster.Cluster)
    c.base, c.procs, c.base_shared, c.made_dirs, c.sysctls = tmp_path / "run", {}, False, [], {}
    c.base.mkdir()
    c.netns_before, c.bridge, c.cgroup_parents = set(), "cgpu000000", []
    calls: list = []
    monkeypatch.setattr(cluster, "_netns", lambda: ["cni-the-other-runs-pod"])
    monkeypatch.setattr(cluster.subprocess, "run", lambda argv, **kw: calls.append(argv))
    monkeypatch.setattr(cluster.Cluster, "_remove_cgroups", lambda self: calls.append("cgroups"))
    c.cleanup()
    assert calls == [] and not c.base.exists(), calls


def test_a_kubelet_socket_nobody_serves_is_removed_one_served_or_not_a_socket_is_kept(tmp_path):
    """A tier run ended by a signal leaves the kubelet's socket with no kubelet behind it; every later
    cluster then failed at start ("another kubelet runs"). A socket nobody listens on is removed; one
    that answers (a live kubelet) or a file that is no socket is left as it is and stops the tier."""
    import socket

    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.fspath(stale))
    s.close()  # (bound, never listening, not removed: as a killed kubelet leaves it)
    assert cluster.clear_stale_socket(stale) is True and not stale.exists()
    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(os.fspath(live))
        srv.listen(1)
        assert cluster.clear_stale_socket(live) is False and live.exists()
    plain = tmp_path / "plain"
    plain.write_text("")
    assert cluster.clear_stale_socket(plain) is False and plain.exists()
    assert cluster.clear_stale_socket(tmp_path / "none") is True


def test_a_gone_kubelets_checkpoint_and_dead_sockets_are_cleared_a_served_socket_is_kept(tmp_path):
    """The device plugin directory outlives a tier run whose clean-up never ran (it existed before that
    run, so no later clean-up removes it): the next cluster's kubelet read the old checkpoint back and a
    DRA-mode node showed aliyun.com/gpu-mem 0 (test_cluster_dra failed so). Cleared at start."""
    import socket

    (tmp_path / "kubelet_internal_checkpoint").write_text("{}")
    dead = tmp_path / "cgpu.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.fspath(dead))
    s.close()
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(os.fspath(tmp_path / "live.sock"))
        srv.listen(1)
        cluster.clear_dead_kubelet_state(tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["live.sock"]
    cluster.clear_dead_kubelet_state(tmp_path / "missing")  # (no directory: nothing to do)
