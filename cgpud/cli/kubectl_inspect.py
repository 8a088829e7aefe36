"""`kubectl inspect cgpu [-d]`: the cluster's GPU memory, per node and per GPU
(and with -d per pod), from the API server (docs/kubernetes.md). kubectl
runs it as a plugin: `kubectl-inspect-cgpu` on PATH."""
from __future__ import annotations

import click

from cgpud.k8s import cluster
from cgpud.k8s.api import refusal
from cgpud.observe.inspect import detail, summary


def _dra(raw) -> tuple[list[dict], list[dict]]:
    """The cluster's ResourceSlices and ResourceClaims as JSON; none where resource.k8s.io/v1 is not
    served (before Kubernetes 1.34)."""
    import json

    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    resource = client.ResourceV1Api(raw)
    try:
        slices = json.loads(resource.list_resource_slice(_preload_content=False).data)["items"]
        claims = json.loads(resource.list_resource_claim_for_all_namespaces(_preload_content=False).data)["items"]
    except ApiException as exc:
        if exc.status == 404:
            return [], []
        raise
    return slices, claims


def _client():
    from cgpud.k8s.api import NoCluster, connect

    try:
        return connect()
    except NoCluster as exc:
        raise click.ClickException(str(exc)) from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-d", "--details", is_flag=True, help="Each node's pods and what they hold on each GPU.")
def main(details: bool) -> None:
    """The GPU memory allocated on each node and GPU of the cluster (aliyun.com/gpu-mem)."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    api, raw = _client()
    try:
        nodes = raw.sanitize_for_serialization(api.list_node().items)
        pods = raw.sanitize_for_serialization(api.list_pod_for_all_namespaces().items)
        slices, claims = _dra(raw)
    except ApiException as exc:
        raise click.ClickException(refusal(exc)) from None
    except (HTTPError, OSError) as exc:
        raise click.ClickException(f"cannot reach the API server: {exc}") from None
    views = [cluster.node_view(n, pods) for n in nodes if cluster.gpu_units(n)]
    shown = {v["name"] for v in views}
    from cgpud.k8s import dra

    ips = {n["metadata"]["name"]: cluster.node_address(n) for n in nodes}
    views += [{**v, "ipaddress": ips.get(v["name"], "unknown")} for v in dra.node_views(slices, claims)
              if v["name"] not in shown]  # (DRA mode: its slices and claims)
    if not views:
        raise click.ClickException("no node of this cluster has aliyun.com/gpu-mem or cgpud's DRA devices: is the "
                                   "cgpu device plugin (or dra-plugin) running?")
    click.echo(detail(views) if details else summary(views))
