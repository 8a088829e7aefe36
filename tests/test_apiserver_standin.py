"""The API server stand-in (tests/apiserver_standin.py) holds to the API
conventions the extender and the device plugin rely on, through the official
client: 409 for a stale resourceVersion, 415 for a patch type it does not
take, WATCH from a version (410 when it is gone), bookmarks, and a field
selector's ADDED/DELETED as objects start or stop matching."""
from __future__ import annotations

import json

import pytest
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from apiserver_standin import ApiServer
from cgpud.k8s.api import connect


@pytest.fixture
def api(tmp_path, monkeypatch):
    a = ApiServer(tmp_path, history=3, bookmark_every=0.1)
    monkeypatch.setenv("KUBECONFIG", str(a.kubeconfig))
    yield a, connect("test")[0]
    a.close()


def events(v1, **kw) -> list[tuple[str, dict]]:
    def raw(**k):  # (no model type: the objects stay JSON)
        return v1.list_pod_for_all_namespaces(**k)

    return [(e["type"], e["raw_object"]) for e in watch.Watch().stream(raw, timeout_seconds=1, allow_watch_bookmarks=True, **kw)]


def test_a_write_from_a_stale_version_is_409_and_a_noop_writes_nothing(api):
    a, v1 = api
    a.add_node("n1")
    seen = a.nodes["n1"]["metadata"]["resourceVersion"]
    v1.patch_node("n1", {"metadata": {"resourceVersion": seen, "labels": {"x": "1"}}})
    with pytest.raises(ApiException) as err:
        v1.patch_node("n1", {"metadata": {"resourceVersion": seen, "labels": {"x": "2"}}})
    assert err.value.status == 409 and "the object has been modified" in json.loads(err.value.body)["message"]
    assert a.nodes["n1"]["metadata"]["labels"] == {"x": "1"}
    now = a.nodes["n1"]["metadata"]["resourceVersion"]
    v1.patch_node("n1", {"metadata": {"labels": {"x": "1"}}})
    assert a.nodes["n1"]["metadata"]["resourceVersion"] == now, "a patch that changes nothing writes nothing"
    v1.patch_node("n1", {"status": {"capacity": {"a": "1"}}})
    assert "a" not in a.nodes["n1"]["status"]["capacity"], "the main endpoint does not change status"
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{a.url}/api/v1/nodes/n1", method="PATCH", data=b'[{"op": "remove"}]',
                                 headers={"Content-Type": "application/json-patch+json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 415


def test_watch_from_a_version_and_410_when_it_is_gone(api):
    a, v1 = api
    a.add_pod("p0", [1])
    since = a.pods[("default", "p0")]["metadata"]["resourceVersion"]
    a.add_pod("p1", [1], node="n1")
    a.delete_pod("default", "p0")
    got = events(v1, resource_version=since)
    assert [(t, o["metadata"]["name"]) for t, o in got if t != "BOOKMARK"] == [("ADDED", "p1"), ("DELETED", "p0")]
    assert got[-1][0] == "BOOKMARK" and int(got[-1][1]["metadata"]["resourceVersion"]) >= a.rv - 1
    for k in range(10):  # more than the 3 changes it keeps
        a.add_pod(f"q{k}", [1])
    with pytest.raises(ApiException) as err:
        events(v1, resource_version=since)
    assert err.value.status == 410


def test_a_field_selected_watch_sees_pods_come_to_and_leave_its_node(api):
    a, v1 = api
    a.add_pod("p", [1])
    since = str(a.rv)
    a.edit_pod("default", "p", lambda p: p["spec"].update(nodeName="n1"))  # (as a Binding does)
    a.add_pod("other", [1], node="n2")
    a.set_phase("default", "p", "Running")
    a.edit_pod("default", "p", lambda p: p["spec"].update(nodeName="n3"))
    got = [(t, o["metadata"]["name"]) for t, o in events(v1, resource_version=since,
                                                          field_selector="spec.nodeName=n1") if t != "BOOKMARK"]
    assert got == [("ADDED", "p"), ("MODIFIED", "p"), ("DELETED", "p")]
    with pytest.raises(ApiException) as err:
        v1.list_pod_for_all_namespaces(field_selector="spec.schedulerName=x")
    assert err.value.status == 400
