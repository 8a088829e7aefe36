"""Docker's and containerd's settings that put cgpu-runtime in the path of
their containers (docs/containers.md, "Docker and containerd"). Pure: text
in, text out; `cgpu runtime-config` and `cgpu node install` read and write
the files.

- Docker, /etc/docker/daemon.json: `runtimes.cgpu.path` = the wrapper, and
  with `default` also `"default-runtime": "cgpu"`. Every other setting stays.
- containerd, /etc/containerd/config.toml: a runtime `cgpu` of type
  io.containerd.runc.v2 whose `BinaryName` is the wrapper, for the CRI
  plugin (what the kubelet uses; RuntimeClass `cgpu`), and with `default`
  the CRI plugin's `default_runtime_name = "cgpu"`. Version 2 (containerd
  1.x: `plugins."io.containerd.grpc.v1.cri".containerd`) and version 3
  (containerd 2.x: `plugins."io.containerd.cri.v1.runtime".containerd`).
  The runtime's other options (`SystemdCgroup`, …) are those of the runtime
  that was the default, so a node whose kubelet drives systemd's cgroups
  runs cgpu's containers the same way. The runtime passes one kind of
  container annotation into the OCI spec, `container_annotations =
  ["cgpu.aliyun.com/allocation-*"]`: the device plugin's allocation
  (containers.allotted), which the kubelet alone writes; never
  `pod_annotations` (a pod's author writes those). Edited with tomlkit: comments, order
  and every other setting stay as they were.

`undo_containerd` and `undo_docker` take out what these added (and give the
default runtime back), for `cgpu node uninstall`.
"""
from __future__ import annotations

import json
import tomllib

import tomlkit

DEFAULT_WRAPPER = "/usr/local/bin/cgpu-runtime"
CRI = 'plugins."io.containerd.grpc.v1.cri".containerd'  # version 2 (containerd 1.x)
CRI_V3 = 'plugins."io.containerd.cri.v1.runtime".containerd'  # version 3 (containerd 2.x)
RUNC_V2 = "io.containerd.runc.v2"
ANNOTATIONS = ["cgpu.aliyun.com/allocation-*"]  # (containers.allotted.PASSTHROUGH; pure text here)


class ConfigError(ValueError):
    """The file cannot be changed safely; str() is one line saying what to do."""


def docker(text: str | None, wrapper: str = DEFAULT_WRAPPER, default: bool = False) -> str:
    """daemon.json with the cgpu runtime (text None or blank: a new file)."""
    conf = docker_settings(text)
    runtimes = conf.setdefault("runtimes", {})
    if not isinstance(runtimes, dict):
        raise ConfigError('daemon.json\'s "runtimes" is not an object; fix it first')
    runtimes["cgpu"] = {**(runtimes.get("cgpu") if isinstance(runtimes.get("cgpu"), dict) else {}), "path": wrapper}
    if default:
        conf["default-runtime"] = "cgpu"
    new = json.dumps(conf, indent=2) + "\n"
    return text if text is not None and docker_settings(text) == conf and text.endswith("\n") else new


def docker_settings(text: str | None) -> dict:
    try:
        conf = json.loads(text) if text and text.strip() else {}
    except ValueError as exc:
        raise ConfigError(f"daemon.json is not JSON ({exc}); fix it first") from None
    if not isinstance(conf, dict):
        raise ConfigError("daemon.json is not a JSON object; fix it first")
    return conf


def undo_docker(text: str, previous_default: str | None) -> str:
    """daemon.json without the cgpu runtime; the default runtime back to `previous_default`."""
    conf = docker_settings(text)
    runtimes = conf.get("runtimes")
    if isinstance(runtimes, dict):
        runtimes.pop("cgpu", None)
        if not runtimes:
            del conf["runtimes"]
    if conf.get("default-runtime") == "cgpu":
        if previous_default:
            conf["default-runtime"] = previous_default
        else:
            del conf["default-runtime"]
    return json.dumps(conf, indent=2) + "\n"


def containerd_version(text: str | None) -> int:
    """The config's `version` (2 for a new file; 1 when a file says none)."""
    if not text or not text.strip():
        return 2
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config.toml is not TOML ({exc}); fix it first") from None
    version = doc.get("version", 1)
    if version not in (2, 3):
        raise ConfigError(f"config.toml is version {version}: containerd 1.x reads version 2 and containerd 2.x "
                          "version 3; rewrite it in one of those (`containerd config default` shows one)")
    return version


def cri_table(version: int) -> str:
    """The dotted name of the table that holds the CRI plugin's runtimes."""
    return CRI if version == 2 else CRI_V3


def split_dotted(dotted: str) -> list[str]:
    out, cur, quoted = [], "", False
    for ch in dotted:
        if ch == '"':
            quoted = not quoted
        elif ch == "." and not quoted:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur]


def _table(doc, dotted: str, create: bool = False):
    node = doc
    for key in split_dotted(dotted):
        nxt = node.get(key) if hasattr(node, "get") else None
        if nxt is None:
            if not create:
                return None
            nxt = tomlkit.table(is_super_table=True)
            node[key] = nxt
        elif not hasattr(nxt, "get"):
            raise ConfigError(f"config.toml's {key} is not a table; fix it first")
        node = nxt
    return node


def _plain(value):
    return value.unwrap() if hasattr(value, "unwrap") else value


def _check(out: str) -> str:
    tomllib.loads(out)  # (never write what containerd could not read)
    return out


def containerd(text: str | None, wrapper: str = DEFAULT_WRAPPER, default: bool = False) -> str:
    """config.toml with the cgpu runtime (text None or blank: a new file, version 2)."""
    return containerd_edit(text, wrapper, default)[0]


def containerd_edit(text: str | None, wrapper: str = DEFAULT_WRAPPER, default: bool = False) -> tuple[str, str | None]:
    """(config.toml with the cgpu runtime, the default runtime it had before: None if it named none)."""
    version = containerd_version(text)
    doc = tomlkit.parse(text or "")
    if not (text or "").strip():
        doc["version"] = 2
    where = cri_table(version)
    cri = _table(doc, where, create=True)
    previous = cri.get("default_runtime_name")
    previous = None if previous is None else str(previous)
    runtimes = _table(doc, f"{where}.runtimes", create=True)
    have = runtimes.get("cgpu")
    if have is not None:
        options = have.get("options") if hasattr(have, "get") else None
        if not hasattr(options, "get") or options.get("BinaryName") != wrapper or have.get("runtime_type") != RUNC_V2:
            raise ConfigError(f"config.toml has a runtime `cgpu` already, not of type {RUNC_V2} with BinaryName "
                              f"{wrapper}: set those two in [{where}.runtimes.cgpu] by hand")
    else:
        base = runtimes.get(previous or "runc")
        base_options = base.get("options") if hasattr(base, "get") else None
        table = tomlkit.table()
        table["runtime_type"] = RUNC_V2
        options = tomlkit.table()
        for key, value in (base_options.items() if hasattr(base_options, "items") else ()):
            if key != "BinaryName":
                options[key] = _plain(value)
        options["BinaryName"] = wrapper
        table["options"] = options
        runtimes["cgpu"] = table
        have = table
    if list(have.get("container_annotations") or ()) != ANNOTATIONS or have.get("pod_annotations"):
        # (an install before the allocation went by annotations gets it; a pod_annotations list a
        # hand edit put there goes: a pod's annotations are its author's)
        have["container_annotations"] = list(ANNOTATIONS)
        if "pod_annotations" in have:
            del have["pod_annotations"]
    if default and cri.get("default_runtime_name") != "cgpu":
        cri["default_runtime_name"] = "cgpu"
    out = tomlkit.dumps(doc)
    if out == (text or "") or (text and tomllib.loads(out) == tomllib.loads(text)):
        return text, previous
    return _check(out), previous


def default_binary(text: str | None, name: str | None) -> str | None:
    """The BinaryName of the CRI runtime `name` (None: none named, or the runtime runs runc)."""
    if not name or not text:
        return None
    doc = tomllib.loads(text)
    node = doc
    for key in split_dotted(f"{cri_table(containerd_version(text))}.runtimes.{name}.options"):
        node = node.get(key) if isinstance(node, dict) else None
    binary = node.get("BinaryName") if isinstance(node, dict) else None
    return binary or None


def undo_containerd(text: str, previous_default: str | None) -> str:
    """config.toml without the cgpu runtime; default_runtime_name back to `previous_default`."""
    version = containerd_version(text)
    doc = tomlkit.parse(text)
    where = cri_table(version)
    runtimes = _table(doc, f"{where}.runtimes")
    if runtimes is not None and "cgpu" in runtimes:
        del runtimes["cgpu"]
    cri = _table(doc, where)
    if cri is not None and cri.get("default_runtime_name") == "cgpu":
        if previous_default:
            cri["default_runtime_name"] = previous_default
        else:
            del cri["default_runtime_name"]
    return _check(tomlkit.dumps(doc))
