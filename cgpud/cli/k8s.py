"""`cgpu device-plugin`, `cgpu dra-plugin`, `cgpu dra-webhook` and `cgpu scheduler-extender`: the Kubernetes parts
(docs/kubernetes.md)."""
from __future__ import annotations

import os

import click

from cgpud.cli.common import Ctx, pass_ctx


@click.command("device-plugin")
@click.option("--plugin-dir", default="/var/lib/kubelet/device-plugins", show_default=True,
              envvar="CGPU_PLUGIN_DIR", help="Where the kubelet's device plugin sockets are.")
@click.option("--unit", type=click.Choice(["GiB", "MiB", "128MiB"]), default=None,
              help="The memory of one aliyun.com/gpu-mem device in every mode [default: the node's mode's: "
                   "128MiB on a share node, else GiB (SPEC §3)].")
@click.option("--placement", type=click.Choice(["binpack", "spread"]), default="binpack", show_default=True,
              envvar="CGPU_PLACEMENT", help="Which GPU a pod's units come from (GetPreferredAllocation).")
@click.option("--disable-isolation", is_flag=True, envvar="CGPU_DISABLE_ISOLATION",
              help="Containers get CGPU_DISABLE=true (a node labelled cgpu.disable.isolation=true).")
@click.option("--node-name", default=None, envvar="NODE_NAME",
              help="This node's name in the API server (a DaemonSet gives it from spec.nodeName).")
@click.option("--node-refresh", default=5.0, show_default=True, type=click.FloatRange(min=0.05),
              help="Seconds before a publish of the node's GPUs the API server refused is tried again "
                   "(the node's labels are watched, not read again).")
@click.option("--mode", type=click.Choice(["exclusive", "cgpu", "core_mem", "share", "mps", "disabled"]),
              default="cgpu", show_default=True, envvar="CGPU_MODE",
              help="The node's mode while it has no ack.node.gpu.schedule label (or no API server): "
                   "which resources it advertises (docs/kubernetes.md, A node's mode).")
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning"]))
@pass_ctx
def device_plugin(ctx: Ctx, plugin_dir: str, unit: str | None, placement: str, disable_isolation: bool,
                  node_name: str | None, node_refresh: float, mode: str, log_level: str) -> None:
    """The kubelet device plugin for aliyun.com/gpu-mem (docs/kubernetes.md):
    one device per memory unit of each GPU the node's cgpud has."""
    import logging

    from cgpud.k8s import deviceplugin

    logging.basicConfig(level=log_level.upper(), format="cgpu device-plugin: %(levelname)s: %(message)s")
    if not os.path.isdir(plugin_dir):
        raise click.ClickException(f"{plugin_dir} does not exist: is this a Kubernetes node (kubelet running)?")
    deviceplugin.main(ctx.socket, plugin_dir, unit, placement, disable_isolation, node_name, node_refresh, mode)


@click.command("dra-plugin")
@click.option("--node-name", required=True, envvar="NODE_NAME",
              help="This node's name in the API server (a DaemonSet gives it from spec.nodeName).")
@click.option("--registry-dir", default="/var/lib/kubelet/plugins_registry", show_default=True,
              envvar="CGPU_DRA_REGISTRY_DIR", help="The kubelet's plugin watcher directory.")
@click.option("--plugin-dir", default="/var/lib/kubelet/plugins/cgpu.aliyun.com", show_default=True,
              envvar="CGPU_DRA_PLUGIN_DIR", help="Where the plugin's own socket is made.")
@click.option("--cdi-dir", default="/var/run/cdi", show_default=True, envvar="CGPU_CDI_DIR",
              help="Where the claims' CDI specs are written (one the runtime reads).")
@click.option("--state-dir", default="/var/lib/cgpud/dra", show_default=True, envvar="CGPU_DRA_STATE_DIR",
              help="Where prepared claims are kept (they survive a restart of the plugin).")
@click.option("--refresh", default=1.0, show_default=True, type=click.FloatRange(min=0.05),
              help="Seconds between looks at the daemon's GPUs (and tries of a refused publish).")
@click.option("--mode", type=click.Choice(["exclusive", "cgpu", "core_mem", "share", "mps", "disabled"]),
              default=None, envvar="CGPU_MODE",
              help="The node's mode while it has no ack.node.gpu.schedule label (default: the daemon's own): "
                   "what its slices publish (docs/kubernetes.md, A node's mode).")
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning"]))
@pass_ctx
def dra_plugin(ctx: Ctx, node_name: str, registry_dir: str, plugin_dir: str, cdi_dir: str, state_dir: str,
               refresh: float, mode: str | None, log_level: str) -> None:
    """The DRA kubelet plugin, driver cgpu.aliyun.com (docs/kubernetes.md, DRA mode): each GPU
    a device whose memory claims share; a prepared claim reaches its containers through CDI."""
    import logging

    from cgpud.k8s import draplugin, draserved
    from cgpud.k8s.api import NoCluster

    logging.basicConfig(level=log_level.upper(), format="cgpu dra-plugin: %(levelname)s: %(message)s")
    for what, d in (("--registry-dir", registry_dir), ("--state-dir", os.path.dirname(state_dir.rstrip("/")) or "/")):
        if not os.path.isdir(d):
            raise click.ClickException(f"{what}: {d} does not exist: is this a Kubernetes node (kubelet running)?")
    try:
        draplugin.main(ctx.socket, node_name, registry_dir, plugin_dir, cdi_dir, state_dir, refresh, mode)
    except (NoCluster, draserved.NotServed) as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"{exc.filename or ''}: {exc.strerror or exc}") from None


@click.command("scheduler-extender")
@click.option("--addr", default="127.0.0.1:12345", show_default=True, envvar="CGPU_EXTENDER_ADDR",
              help="HOST:PORT kube-scheduler calls (its own node's loopback: deploy/kubernetes/extender.yaml).")
@click.option("--placement", default="binpack", show_default=True, type=click.Choice(["binpack", "spread"]),
              envvar="CGPU_EXTENDER_PLACEMENT",
              help="Across nodes, for pods without the annotation cgpu.aliyun.com/placement.")
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning"]))
def scheduler_extender(addr: str, placement: str, log_level: str) -> None:
    """kube-scheduler's extender for aliyun.com/gpu-mem, gpushare-compatible
    (docs/kubernetes.md): filter, prioritize, bind, inspect, /metrics."""
    import logging

    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    from cgpud.k8s import extender
    from cgpud.k8s.api import NoCluster, refusal

    logging.basicConfig(level=log_level.upper(), format="cgpu scheduler-extender: %(levelname)s: %(message)s")
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise click.ClickException(f"--addr {addr}: give HOST:PORT")
    try:
        extender.main(addr, placement)
    except NoCluster as exc:
        raise click.ClickException(str(exc)) from None
    except ApiException as exc:
        raise click.ClickException(f"cannot read the cluster: {refusal(exc)}") from None
    except HTTPError as exc:
        raise click.ClickException(f"cannot reach the API server: {exc}") from None
    except OSError as exc:
        raise click.ClickException(f"--addr {addr}: {exc.strerror or exc}") from None


@click.command("dra-webhook")
@click.option("--addr", default="0.0.0.0:8443", show_default=True, envvar="CGPU_WEBHOOK_ADDR",
              help="HOST:PORT to serve HTTPS on (the Service cgpu-dra-webhook's targetPort).")
@click.option("--tls-cert", default=None, envvar="CGPU_WEBHOOK_TLS_CERT", type=click.Path(dir_okay=False),
              help="A serving certificate (PEM) to use instead of one made at start (then the caBundle is yours "
                   "to set).")
@click.option("--tls-key", default=None, envvar="CGPU_WEBHOOK_TLS_KEY", type=click.Path(dir_okay=False),
              help="Its key (PEM).")
@click.option("--tls-san", default="cgpu-dra-webhook.kube-system.svc", show_default=True,
              help="Names (DNS or IP, comma-separated) of the certificate made at start: the name the API "
                   "server calls.")
@click.option("--webhook-config", default="cgpu-dra-webhook", show_default=True,
              help="The MutatingWebhookConfiguration whose caBundle gets the CA made at start ('' for none).")
@click.option("--tls-secret", default=None, metavar="NAMESPACE/NAME",
              help="The Secret (type kubernetes.io/tls, with ca.crt) every replica serves with; made by the first "
                   "replica that finds none (a CA and a certificate for --tls-san).")
@click.option("--client-ca", default=None, type=click.Path(dir_okay=False),
              help="The CA of the client certificate the API server presents to webhooks (its "
                   "AdmissionConfiguration); POST /mutate takes no other caller. Default: the cluster's CA, "
                   "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt.")
@click.option("--client-name", "client_names", multiple=True,
              help="A CN of that certificate to take (repeat for more). Default: kube-apiserver-kubelet-client "
                   "(kubeadm's apiserver-kubelet-client.crt).")
@click.option("--health-addr", default="", envvar="CGPU_WEBHOOK_HEALTH_ADDR",
              help="HOST:PORT of a plain-HTTP port answering GET /healthz, for the kubelet's probe (the HTTPS port "
                   "takes only the API server's certificate). Default: none.")
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning"]))
def dra_webhook(addr: str, tls_cert: str | None, tls_key: str | None, tls_san: str, webhook_config: str,
                tls_secret: str | None, client_ca: str | None, client_names: tuple[str, ...], health_addr: str,
                log_level: str) -> None:
    """The mutating admission webhook of DRA mode (docs/kubernetes.md): a pod labelled
    aliyun.com/gpu-count M asking aliyun.com/gpu-mem N gets a claim of N/M units on each of M GPUs."""
    import logging

    from cgpud.k8s import webhookserver
    from cgpud.k8s.api import NoCluster

    logging.basicConfig(level=log_level.upper(), format="cgpu dra-webhook: %(levelname)s: %(message)s")
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise click.ClickException(f"--addr {addr}: give HOST:PORT")
    if bool(tls_cert) != bool(tls_key):
        raise click.ClickException("--tls-cert and --tls-key go together")
    sans = [s.strip() for s in tls_san.split(",") if s.strip()]
    if not sans and not tls_cert:
        raise click.ClickException("--tls-san: give at least one name")
    h_sep, h_port = health_addr.rpartition(":")[1:]
    if health_addr and (not h_sep or not h_port.isdigit()):
        raise click.ClickException(f"--health-addr {health_addr}: give HOST:PORT")
    if tls_secret is not None and not tls_secret.rpartition("/")[2]:
        raise click.ClickException(f"--tls-secret {tls_secret}: give NAMESPACE/NAME")
    try:
        webhookserver.main(addr, tls_cert, tls_key, webhook_config or None, sans, client_ca, list(client_names),
                           tls_secret, health_addr or None)
    except (NoCluster, webhookserver.CertError) as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"--addr {addr}: {exc.strerror or exc}") from None
