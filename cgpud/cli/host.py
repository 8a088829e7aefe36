"""`cgpu runtime-config` and `cgpu doctor`: setting up a host and checking it
(docs/containers.md, docs/monitoring.md)."""
from __future__ import annotations

import json
import os
import sys

import click

from cgpud.cli.common import Ctx, pass_ctx


@click.command("runtime-config")
@click.argument("engine", type=click.Choice(["docker", "containerd"]))
@click.option("--root", default="/", show_default=True,
              help="The host's root, where the wrapper must be (an install staged below a DESTDIR).")
@click.option("--etc", default=None, help="Where Docker's and containerd's settings are (default: ROOT/etc).")
@click.option("--wrapper", default=None, help="cgpu-runtime's path on the host (default: /usr/local/bin/cgpu-runtime).")
@click.option("--default", "default", is_flag=True, help="Make cgpu the default runtime too.")
def runtime_config(engine: str, root: str, etc: str | None, wrapper: str | None, default: bool) -> None:
    """Put cgpu-runtime in Docker's (daemon.json) or containerd's
    (config.toml) settings, keeping every other setting; then restart that
    engine. docs/containers.md, "Docker and containerd"."""
    from cgpud.containers import hostconfig

    from cgpud.core.hostroot import resolve

    wrapper = wrapper or hostconfig.DEFAULT_WRAPPER
    etc = etc or os.path.join(root, "etc")
    found = resolve(root, wrapper) if os.path.isabs(wrapper) else None
    if found is None or not os.access(found, os.X_OK):
        raise click.ClickException(f"{wrapper} is not there (or not executable): install it first with `make "
                                   "install-hooks` as root (a Kubernetes node: `cgpu node install`), or name it with "
                                   "--wrapper")
    path = os.path.join(etc, "docker", "daemon.json") if engine == "docker" else \
        os.path.join(etc, "containerd", "config.toml")
    try:
        with open(path) as f:
            old = f.read()
    except FileNotFoundError:
        old = None
    except OSError as exc:
        raise click.ClickException(f"cannot read {path}: {exc.strerror}") from None
    edit = hostconfig.docker if engine == "docker" else hostconfig.containerd
    try:
        new = edit(old, wrapper, default)
    except hostconfig.ConfigError as exc:
        raise click.ClickException(f"{path}: {exc}") from None
    if new == old:
        click.echo(f"{path}: cgpu-runtime is set already")
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.cgpu-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(new)
            f.flush()
            os.fsync(f.fileno())
        if old is not None:
            st = os.stat(path)
            os.chmod(tmp, st.st_mode & 0o7777)
        os.replace(tmp, path)
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror}") from None
    how = "systemctl restart docker" if engine == "docker" else "systemctl restart containerd"
    click.echo(f"{path}: cgpu-runtime added{' as the default runtime' if default else ''}; apply it with `{how}`")


@click.command()
@click.option("--mount", "mountpoint", default=None, envvar="CGPUD_MOUNT", help="The tree (default: the daemon's default).")
@click.option("--etc", default="/etc", show_default=True, help="Where Docker's and containerd's settings are.")
@click.option("--hooks-dir", "hooks_dirs", multiple=True, help="hooks.d directories to look in (default: podman's).")
@click.option("--json", "as_json", is_flag=True, help="One JSON list of {check, status, message}.")
@pass_ctx
def doctor(ctx: Ctx, mountpoint: str | None, etc: str, hooks_dirs: tuple[str, ...], as_json: bool) -> None:
    """Check every part of a container's path into cgpud, one line each with
    what to do: the daemon, the tree, FUSE, cgroups, hooks.d, Docker,
    containerd, NVML. Exit 0 only when nothing failed."""
    from cgpud.observe import doctor as dr
    from cgpud.state.paths import default_mount

    host = dr.Host(socket=ctx.socket, mount=mountpoint or default_mount(), etc=etc,
                   **({"hooks_dirs": hooks_dirs} if hooks_dirs else {}))
    results = dr.run(host)
    if as_json:
        click.echo(json.dumps([{"check": r.name, "status": r.status, "message": r.message} for r in results]))
    else:
        for r in results:
            click.echo(f"{r.status.upper():5} {r.name:11} {r.message}")
    if any(r.status == dr.FAIL for r in results):
        sys.exit(1)
