"""Every answer cgpud's Kubernetes parts ask for without reading it into a model (_preload_content=False)
is read and its connection given back to the client's pool (cgpud.k8s.api.done): an answer left unread
holds its connection until it is collected, so the next request opens another (a TLS handshake on both
sides of a real API server). Against the API server stand-in, counting the connections opened."""
from __future__ import annotations

import pytest

from apiserver_standin import ApiServer
from cgpud.k8s import dra

GIB = 1 << 30


@pytest.fixture
def api(tmp_path, monkeypatch):
    server = ApiServer(tmp_path)
    monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig))
    yield server
    server.close()


@pytest.fixture
def opened(monkeypatch) -> list:
    """The connections the client opens from now on."""
    import urllib3

    got: list = []
    connect = urllib3.connection.HTTPConnection.connect
    monkeypatch.setattr(urllib3.connection.HTTPConnection, "connect", lambda self: got.append(self) or connect(self))
    return got


def test_node_events_reuse_one_connection(api, opened):
    from cgpud.k8s.api import connect
    from cgpud.k8s.nodeapi import node_event

    core, _ = connect("test")
    for k in range(5):
        node_event(core, "n1", "GpuModeChangeWaiting", f"waiting {k}", "cgpu-device-plugin")
    assert [e["message"] for e in api.events] == [f"waiting {k}" for k in range(5)]
    assert len(opened) == 1, f"{len(opened)} connections for 5 events"


def test_obsolete_slices_are_deleted_over_one_connection(api, opened):
    from cgpud.k8s.draapi import Api

    client = Api("n1")
    gpus = [dra.Gpu(i, f"GPU-{i}", "T4", 16 * GIB) for i in range(4 * 128)]
    assert client.publish(dra.resource_slices("n1", gpus, GIB))  # (128 devices a slice: 4 slices)
    assert len(api.slices) == 4
    before = len(opened)
    assert client.publish(dra.resource_slices("n1", gpus[:100], GIB))  # (1 slice: 3 obsolete, deleted)
    assert len(api.slices) == 1 and api.count("delete", "resourceslices") == 3
    assert len(opened) - before <= 1, f"{len(opened) - before} connections for one update and 3 deletes"
