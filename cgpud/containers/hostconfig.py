"""Docker's and containerd's settings that put cgpu-runtime in the path of
their containers (docs/containers.md, "Docker and containerd"). Pure: text
in, text out; `cgpu runtime-config` reads and writes the files.

- Docker, /etc/docker/daemon.json: `runtimes.cgpu.path` = the wrapper, and
  with `default` also `"default-runtime": "cgpu"`. Every other setting stays.
- containerd, /etc/containerd/config.toml: a runtime `cgpu` of type
  io.containerd.runc.v2 whose `BinaryName` is the wrapper, for the CRI
  plugin (what the kubelet uses; RuntimeClass `cgpu`), and with `default`
  the CRI plugin's `default_runtime_name = "cgpu"`. A table already there is
  never written twice: TOML forbids it, so an existing setting that differs
  is a ConfigError saying what to change by hand.
"""
from __future__ import annotations

import json
import tomllib

DEFAULT_WRAPPER = "/usr/local/bin/cgpu-runtime"
CRI = 'plugins."io.containerd.grpc.v1.cri".containerd'


class ConfigError(ValueError):
    """The file cannot be changed safely; str() is one line saying what to do."""


def docker(text: str | None, wrapper: str = DEFAULT_WRAPPER, default: bool = False) -> str:
    """daemon.json with the cgpu runtime (text None or blank: a new file)."""
    try:
        conf = json.loads(text) if text and text.strip() else {}
    except ValueError as exc:
        raise ConfigError(f"daemon.json is not JSON ({exc}); fix it first") from None
    if not isinstance(conf, dict):
        raise ConfigError("daemon.json is not a JSON object; fix it first")
    runtimes = conf.setdefault("runtimes", {})
    if not isinstance(runtimes, dict):
        raise ConfigError('daemon.json\'s "runtimes" is not an object; fix it first')
    runtimes["cgpu"] = {**(runtimes.get("cgpu") if isinstance(runtimes.get("cgpu"), dict) else {}), "path": wrapper}
    if default:
        conf["default-runtime"] = "cgpu"
    return json.dumps(conf, indent=2) + "\n"


def _table(doc: dict, dotted: str) -> dict | None:
    node = doc
    for key in _split(dotted):
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return None
    return node


def _split(dotted: str) -> list[str]:
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


def containerd(text: str | None, wrapper: str = DEFAULT_WRAPPER, default: bool = False) -> str:
    """config.toml with the cgpu runtime (text None or blank: a new file, version 2)."""
    text = text or ""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config.toml is not TOML ({exc}); fix it first") from None
    if doc.get("version", 1) != 2 and text.strip():
        raise ConfigError("config.toml is not version = 2; run `containerd config migrate` or set the cgpu "
                          "runtime by hand (docs/containers.md)")
    add = []
    if not text.strip():
        add.append("version = 2\n")
    runtime = _table(doc, f"{CRI}.runtimes.cgpu")
    if runtime is None:
        add.append(f'[{CRI}.runtimes.cgpu]\n  runtime_type = "io.containerd.runc.v2"\n'
                   f'[{CRI}.runtimes.cgpu.options]\n  BinaryName = {json.dumps(wrapper)}\n')
    elif (runtime.get("options") or {}).get("BinaryName") != wrapper or runtime.get("runtime_type") != \
            "io.containerd.runc.v2":
        raise ConfigError(f"config.toml has a runtime `cgpu` already, not of type io.containerd.runc.v2 with "
                          f"BinaryName {wrapper}: set those two by hand")
    if default:
        cri = _table(doc, CRI)
        if cri is not None and cri.get("default_runtime_name") == "cgpu":
            pass
        elif cri is not None and set(cri) - {"runtimes"}:  # the table is written out already: never twice
            raise ConfigError(f'config.toml has a [{CRI}] table already: set default_runtime_name = "cgpu" in it '
                              "by hand")
        else:
            add.append(f'[{CRI}]\n  default_runtime_name = "cgpu"\n')
    if not add:
        return text
    sep = "" if not text or text.endswith("\n") else "\n"
    out = text + sep + ("\n" if text.strip() else "") + "\n".join(add)
    tomllib.loads(out)  # (never write what containerd could not read)
    return out
