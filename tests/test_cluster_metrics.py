"""The cluster tier (issue 44): the metrics door of the DaemonSet's node daemon as shipped
(deploy/kubernetes: `--metrics-auth kubernetes`, ClusterRoles cgpu-metrics-auth and
cgpu-metrics-reader) on the real kube-apiserver's TokenReview and SubjectAccessReview (RBAC): a
pod's ServiceAccount token without the reader's role gets 403 and no series, a forged token 401, no
token 401; a ServiceAccount bound to cgpu-metrics-reader gets every tenant's series, over TLS.
The node as tests/test_cluster_daemonset.py makes it (its overlay gives the daemon the API server's
address: no kube-proxy here)."""
from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import pytest

from cluster import wait_for
from test_cluster import container_name, running
from test_cluster_daemonset import Node, instance_memsize
from test_image import image  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow


def scrape(port: int, token: str | None) -> tuple[int, str]:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # (the daemon's self-signed certificate)
    req = urllib.request.Request(f"https://127.0.0.1:{port}/metrics",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=15) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.timeout(600)
def test_only_a_scraper_allowed_get_metrics_reads_the_tenants_series(image, tmp_path):  # noqa: F811
    with Node(image, tmp_path) as node:
        cluster = node.cluster
        node.apply()
        pod = node.ready()
        cmd = next(c for c in pod["spec"]["containers"] if c["name"] == "cgpud")["command"]
        assert cmd[cmd.index("--metrics-auth") + 1] == "kubernetes"
        port = int(cmd[cmd.index("--metrics-addr") + 1].rsplit(":", 1)[1])
        cluster.create(cluster.pod("metrics-tenant", 2, runtime_class=None))
        app = cluster.wait_pod("metrics-tenant", running, 90, "Running")
        instance_memsize(node, app)
        for sa in ("prom", "tenant"):
            cluster.kubectl("create", "serviceaccount", sa, "-n", "default")
        cluster.kubectl("create", "clusterrolebinding", "prom-reads-cgpud", "--clusterrole", "cgpu-metrics-reader",
                        "--serviceaccount", "default:prom")
        prom = cluster.kubectl("create", "token", "prom", "-n", "default").stdout.strip()
        tenant = cluster.kubectl("create", "token", "tenant", "-n", "default").stdout.strip()

        code, body = scrape(port, None)
        assert code == 401 and "cgpu_" not in body, body
        code, body = scrape(port, prom[:-4] + "AAAA")
        assert code == 401 and "cgpu_" not in body, body
        code, body = scrape(port, tenant)
        assert code == 403 and "cgpu_" not in body and "system:serviceaccount:default:tenant" in body, body
        name = container_name(app)
        wait_for(lambda: f'container="{name}"' in scrape(port, prom)[1], 30, "the tenant's series for prom",
                 lambda: json.dumps(scrape(port, prom))[:2000] + node.logs(pod, "cgpud")[-3000:])
        code, body = scrape(port, prom)
        assert code == 200 and "cgpu_instance_memsize_bytes{" in body
        cluster.delete_pod("metrics-tenant")
