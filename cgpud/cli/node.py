"""`cgpu node install` / `cgpu node uninstall`: set a GPU node up from the image,
against the host's root mounted at --host-root (docs/kubernetes.md)."""
from __future__ import annotations

import json

import click


@click.group()
def node() -> None:
    """Put the node's programs and settings on the host (the DaemonSet's init
    container), or take them off again."""


def _show(report, as_json: bool, what: str) -> None:
    if as_json:
        click.echo(json.dumps(report.as_dict()))
        return
    for p in report.written:
        click.echo(f"wrote {p}")
    for p in report.removed:
        click.echo(f"removed {p}")
    for engine, done in report.engines.items():
        click.echo(f"{engine}: {done}" + (", restarted" if engine in report.restarted else ""))
    for step in report.todo:
        click.echo(f"to do: {step}")
    click.echo(f"cgpu node {what}: {len(report.written)} files written, {len(report.kept)} already in place"
               + (f", {len(report.removed)} removed" if what == "uninstall" else ""))


_restart = click.option("--restart", type=click.Choice(["systemd", "none"]), default="systemd", show_default=True,
                        help="How a changed containerd is made to load its settings: the host's `systemctl "
                             "restart containerd` (running containers survive it), or not at all (say so).")


@node.command()
@click.option("--host-root", required=True, help="Where the host's / is mounted (the DaemonSet: /host).")
@click.option("--from", "source", default="/", show_default=True,
              help="The root whose /usr/local/{libexec,lib/cgpu} hold the programs to copy (the image's).")
@click.option("--engine", "engines", multiple=True, default=("auto",), show_default=True,
              type=click.Choice(["auto", "containerd", "docker", "none"]),
              help="Whose settings get the runtime cgpu (auto: each one installed on the host).")
@click.option("--default-runtime/--no-default-runtime", default=True, show_default=True,
              help="Make cgpu containerd's default runtime, so a GPU pod without runtimeClassName is isolated "
                   "too (containers that ask for no GPU memory pass through unchanged).")
@_restart
@click.option("--json", "as_json", is_flag=True, help="Print what was done as one JSON object.")
def install(host_root: str, source: str, engines: tuple[str, ...], default_runtime: bool, restart: str,
            as_json: bool) -> None:
    """Copy cgpu-hook, cgpu-runtime and libcgpu.so to the host (atomically),
    write the hooks.d file, put the runtime cgpu into containerd's (version 2
    or 3) and Docker's settings, and restart containerd if they changed. A
    second run writes nothing."""
    from cgpud.containers.nodeinstall import InstallError, install as do_install

    try:
        report = do_install(host_root, source, engines, default_runtime, restart)
    except InstallError as exc:
        raise click.ClickException(str(exc)) from None
    _show(report, as_json, "install")


@node.command()
@click.option("--host-root", required=True, help="Where the host's / is mounted.")
@_restart
@click.option("--json", "as_json", is_flag=True, help="Print what was done as one JSON object.")
def uninstall(host_root: str, restart: str, as_json: bool) -> None:
    """Undo `cgpu node install`: the files it wrote removed (or what was there
    before put back), the engines' settings as they were."""
    from cgpud.containers.nodeinstall import InstallError, uninstall as do_uninstall

    try:
        report = do_uninstall(host_root, restart)
    except InstallError as exc:
        raise click.ClickException(str(exc)) from None
    _show(report, as_json, "uninstall")


@node.command()
@click.option("--host-root", required=True, help="Where the host's / is mounted (the DaemonSet: /host).")
@click.option("--daemonset", default="cgpud", show_default=True,
              help="The DaemonSet whose deletion undoes the install (in --namespace).")
@click.option("--namespace", envvar="POD_NAMESPACE", default="kube-system", show_default=True,
              help="The DaemonSet's namespace (the DaemonSet gives its own from the downward API).")
@_restart
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning"]))
def keep(host_root: str, daemonset: str, namespace: str, restart: str, log_level: str) -> None:
    """Run beside the node daemon until SIGTERM; then undo `cgpu node install` if (and only if) the
    DaemonSet was deleted (`helm uninstall`): a pod restart or an upgrade leaves the node installed
    (docs/kubernetes.md, Helm)."""
    import logging
    import os
    import sys

    from cgpud.k8s import nodekeeper

    logging.basicConfig(level=log_level.upper(), format="cgpu node keep: %(levelname)s: %(message)s")
    if not os.path.isdir(host_root):
        raise click.ClickException(f"--host-root {host_root} is not a directory")
    sys.exit(nodekeeper.main(host_root, namespace, daemonset, restart))
