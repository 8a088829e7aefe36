"""The fuzzer of the mounted tree and the control socket, shared by
tests/test_fuzz.py (a few hundred cases) and bench/soak.py (>= 100,000).

Each *case* is one input: a write of random bytes at a random offset (with
O_APPEND/O_TRUNC or not) to any node of the tree, or one line (random JSON,
garbage, a partial line, a line over the limit) on the control socket.

The oracle is a *replica*: the model (cgpud.core.model.Node) bound to the same
table (cgpud.tree) and the same request handlers (cgpud.control.server.Control),
in this process, fed the same input through the write rules of SPEC §1. After
every case:
- the daemon answered what the replica answers (bytes written, or the errno;
  ok, or the error of the socket's reply);
- the daemon's settings (one `query`) equal the replica's: a value changed
  only on a write the model accepts, and exactly as it says;
- the invariants of SPEC §4 hold on what the daemon shows;
- the daemon is alive;
and every `full_every` cases and at the end of each example the whole tree,
read back through the mount file by file, equals the replica's rendering.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import string
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from hypothesis import strategies as st

from cgpud.control.protocol import MAX_LINE, Peer, decode_line
from cgpud.control.server import Control
from cgpud.control.views import snapshot
from cgpud.state.durable import Durable
from cgpud.core.model import GpuInfo, Node
from cgpud.core.model import ERRNOS
from cgpud.tree import build
from fusefs.node import Dir, DynDir, File, InvalidInput

NAME_CHARS = string.ascii_letters + string.digits + "_.-"
SKIP_COMPARE = {"upgrade"}  # its state belongs to the upgrade machinery, not to the model


class NullStore:
    """The replica's changes need not reach a disk."""

    path = "(replica)"

    def save(self, state: dict) -> None:
        pass


class Replica:
    def __init__(self, infos: list[GpuInfo]) -> None:
        self.node = Node(infos)
        self.durable = Durable(self.node, NullStore())  # type: ignore[arg-type]
        self.root = build(self.durable)
        self.control = Control(self.durable)
        self.peer = Peer(os.getpid(), 0, 0, 1)

    def load(self, state: dict) -> None:
        self.node.load_state(state)

    def resolve(self, rel: str) -> tuple[Any, tuple] | None:
        cur: Any = self.root
        key: tuple = ()
        for name in rel.split("/"):
            found = None
            if isinstance(cur, File):
                return None
            for child in cur.children:
                if isinstance(child, DynDir):
                    if name in child.keys(key):
                        found, key = child, key + (name,)
                        break
                elif child.name == name:
                    found = child
                    break
            if found is None:
                return None
            cur = found
        return cur, key

    def expect_write(self, rel: str, data: bytes, offset: int) -> int:
        """What `write(2)` of `data` at `offset` answers under SPEC §1's rules
        (bytes written, or -errno), applying it to the replica if accepted."""
        found = self.resolve(rel)
        if found is None:
            return -errno.ENOENT
        node, key = found
        if not isinstance(node, File):
            return -errno.EISDIR
        if not node.writable:
            return -errno.EACCES
        if not data:
            return 0  # the kernel answers an empty write itself
        if offset != 0 or len(data) > node.max_bytes or b"\0" in data:
            return -errno.EINVAL
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            return -errno.EINVAL
        try:
            node.store(key, text)
        except InvalidInput:
            return -errno.EINVAL
        except tuple(ERRNOS) as exc:
            return -next(code for cls, code in ERRNOS.items() if isinstance(exc, cls))
        except OSError as exc:
            return -(exc.errno or errno.EIO)
        return len(data)

    def show(self, rel: str) -> str:
        node, key = self.resolve(rel)  # type: ignore[misc]
        if node.read_errno is not None:
            return f"<{errno.errorcode[node.read_errno]}>"
        text = node.show(key)
        return text if text.endswith("\n") else text + "\n"

    def render(self) -> dict[str, str]:
        """The whole tree as Daemon.snapshot() reads it."""
        out: dict[str, str] = {}

        def visit(node: Any, key: tuple, prefix: str) -> None:
            for child in node.children:
                if isinstance(child, DynDir):
                    for k in child.keys(key):
                        out[prefix + k + "/"] = ""
                        visit(child, key + (k,), prefix + k + "/")
                elif isinstance(child, Dir):
                    out[prefix + child.name + "/"] = ""
                    visit(child, key, prefix + child.name + "/")
                else:
                    rel = prefix + child.name
                    out[rel] = self.show(rel)

        visit(self.root, (), "")
        return out

    def handle(self, req: Any) -> dict:
        return self.control.handle(req, self.peer)


def invariants(q: dict) -> list[str]:
    """SPEC §4 on a `query` result (what the daemon shows)."""
    bad = []
    for g in q["gpus"]:
        insts = g["instances"]
        w = sum(i["weight"] for i in insts)
        m = sum(i["memsize"] for i in insts)
        tag = f"GPU {g['index']}"
        if not 1 <= g["max_inst"] <= 25:
            bad.append(f"{tag}: max_inst {g['max_inst']}")
        if len(insts) > g["max_inst"]:
            bad.append(f"{tag}: {len(insts)} instances > max_inst {g['max_inst']}")
        if w > g["max_inst"]:
            bad.append(f"{tag}: Σ weight {w} > max_inst {g['max_inst']}")
        if g["free_weight"] != g["max_inst"] - w or g["free_weight"] < 0:
            bad.append(f"{tag}: free_weight {g['free_weight']} != {g['max_inst']} - {w}")
        if m > g["memory"]:
            bad.append(f"{tag}: Σ memsize {m} > device {g['memory']}")
        if not 0 <= g["policy"] <= 5 or not 20 <= g["prio_ratio"] <= 99:
            bad.append(f"{tag}: policy {g['policy']} prio_ratio {g['prio_ratio']}")
        for i in insts:
            if not 0 <= i["weight"] <= g["max_inst"] or i["highprio"] not in (0, 1, True, False):
                bad.append(f"{tag}/{i['name']}: weight {i['weight']} highprio {i['highprio']}")
    return bad


# ---- the daemon side -------------------------------------------------------------------------


def write_node(mount: str, rel: str, data: bytes, offset: int, flags: int) -> int:
    """One open/pwrite/close; bytes written or -errno."""
    try:
        fd = os.open(os.path.join(mount, rel), os.O_WRONLY | flags)
    except OSError as exc:
        return -exc.errno
    try:
        return os.pwrite(fd, data, offset)
    except OSError as exc:
        return -exc.errno
    finally:
        os.close(fd)


def read_tree(mount: str) -> dict[str, str]:
    out: dict[str, str] = {}

    def visit(rel: str) -> None:
        for name in sorted(os.listdir(os.path.join(mount, rel))):
            child = f"{rel}/{name}" if rel else name
            path = os.path.join(mount, child)
            if os.path.isdir(path):
                out[child + "/"] = ""
                visit(child)
            else:
                out[child] = read_file(mount, child)

    visit("")
    return out


def read_file(mount: str, rel: str) -> str:
    try:
        with open(os.path.join(mount, rel), "rb") as f:
            return f.read().decode("ascii")
    except OSError as exc:
        return f"<{errno.errorcode[exc.errno]}>"


class Line:
    """A socket connection that speaks one line at a time and notices a close."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock: socket.socket | None = None
        self.buf = b""

    def _connect(self) -> socket.socket:
        if self.sock is None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(30)
            self.sock.connect(self.path)
            self.buf = b""
        return self.sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def send(self, data: bytes) -> None:
        s = self._connect()
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon closed first (an overlong line): the reply is still readable

    def reply(self) -> dict | None:
        """The next reply line; None at EOF (the connection is then closed)."""
        assert self.sock is not None
        while b"\n" not in self.buf:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.close()
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def eof(self) -> bool:
        """Whether the daemon closed the connection (after an overlong line)."""
        assert self.sock is not None
        self.sock.settimeout(30)
        try:
            rest = self.sock.recv(65536)
        except ConnectionResetError:  # closed with our unread bytes still queued
            rest = b""
        self.close()
        return rest == b""


# ---- cases -----------------------------------------------------------------------------------


@dataclass
class TreeWrite:
    rel: str
    data: bytes
    offset: int
    flags: int

    def __repr__(self) -> str:
        data = self.data if len(self.data) <= 40 else self.data[:40] + b"...(%d bytes)" % len(self.data)
        return f"TreeWrite({self.rel!r}, {data!r}, offset={self.offset}, flags={self.flags:#o})"


@dataclass
class SocketInput:
    data: bytes            # what is sent
    kind: str              # "line" (ends in \n), "partial" (no \n, then close), "overlong"

    def __repr__(self) -> str:
        data = self.data if len(self.data) <= 60 else self.data[:60] + b"...(%d bytes)" % len(self.data)
        return f"SocketInput({self.kind}, {data!r})"


def names_pool(tag: str) -> list[str]:
    return [f"{tag}{c}".ljust(12, c)[:12] for c in "abc"]


def strategies(names: list[str], gpus: int) -> st.SearchStrategy:
    """One case: a tree write or a socket input."""
    ws = st.sampled_from(["", "", "", "\n", " ", "\t", "  "])
    number = st.one_of(st.integers(0, 5), st.integers(0, 25), st.integers(-3, 120), st.integers(0, 20 << 30),
                       st.integers(-(10**20), 10**20))
    numeric = st.builds(lambda a, n, b: (a + str(n) + b).encode(), ws, number, ws)
    name = st.one_of(st.sampled_from(names), st.sampled_from(names), st.text(NAME_CHARS, min_size=0, max_size=14),
                     st.text(max_size=14))
    gpu_digit = st.sampled_from([str(g) for g in range(gpus)])
    ctl = st.builds(lambda h, n, nl: (h + n + nl).encode("utf-8", "surrogatepass"),
                    st.one_of(gpu_digit, gpu_digit, st.sampled_from([str(gpus), "-", "-", "x", " "])), name,
                    st.sampled_from(["", "\n", "", "\n\n", " "]))
    big = st.builds(lambda n, c: c * n, st.integers(0, 65536), st.sampled_from([b"1", b" ", b"\0", b"\xff", b"9\n"]))
    anything = st.one_of(numeric, ctl, st.binary(max_size=40), big,
                         st.text(max_size=6).map(lambda t: t.encode("utf-8", "surrogatepass")),
                         st.builds(lambda a, b: a + b"\0" + b, numeric, st.binary(max_size=4)))

    mostly_ctl = st.integers(0, 9).flatmap(lambda k: ctl if k < 6 else anything)
    mostly_numeric = st.integers(0, 9).flatmap(lambda k: numeric if k < 6 else anything)

    fixed = ["version", "default_memsize", "inst_ctl", "inst_ctl", "inst_ctl", "upgrade", "nonexistent"]
    per_gpu = ["", "/policy", "/max_inst", "/free_weight", "/major", "/prio_ratio", "/nonexistent"]
    per_inst = ["", "/id", "/memsize", "/meminfo", "/weight", "/weight", "/highprio"]
    rel = st.one_of(
        st.sampled_from(fixed),
        st.builds(lambda g, f: f"{g}{f}", st.integers(0, gpus), st.sampled_from(per_gpu)),
        st.builds(lambda g, n, f: f"{g}/{n}{f}", st.integers(0, gpus - 1), st.sampled_from(names),
                  st.sampled_from(per_inst)),
    )
    offset = st.one_of(st.just(0), st.just(0), st.just(0), st.just(0), st.integers(0, 16), st.integers(0, 1 << 30))
    flags = st.sampled_from([0, 0, 0, os.O_APPEND, os.O_TRUNC, os.O_APPEND | os.O_TRUNC])
    # mostly what the node takes, else anything (one strategy per path, built once)
    writes = {}

    def write_to(r: str) -> st.SearchStrategy:
        if r not in writes:
            writes[r] = st.builds(TreeWrite, st.just(r), mostly_ctl if r == "inst_ctl" else mostly_numeric, offset, flags)
        return writes[r]

    tree = rel.flatmap(write_to).filter(
        lambda w: not (w.rel == "upgrade" and w.data.strip(b" \t\n") == b"1"))  # (a real upgrade)

    leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 30),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=16), st.sampled_from(names))
    # (st.recursive costs ~5x a flat draw here; two levels find the same type errors)
    value = st.one_of(leaf, leaf, st.lists(leaf, max_size=3), st.dictionaries(st.sampled_from(["op", "name", "a"]), leaf,
                                                                            max_size=2))
    ops = st.sampled_from(["hello", "query", "stats", "register", "deregister", "gpu_alloc", "gpu_free",
                           "gpu_meminfo", "nothing", ""])
    args = st.dictionaries(st.sampled_from(["name", "gpus", "memsize", "weight", "highprio", "policy",
                                            "container", "handle", "bytes", "gpu", "x"]), value, max_size=5)
    register = st.fixed_dictionaries({"op": st.just("register"), "name": st.sampled_from(names),
                                      "gpus": st.lists(st.integers(0, gpus), min_size=1, max_size=gpus, unique=True)},
                                     optional={"memsize": st.integers(0, 16 << 30), "weight": st.integers(-1, 26),
                                               "highprio": st.booleans(), "policy": st.integers(-1, 6)})
    deregister = st.fixed_dictionaries({"op": st.just("deregister"), "name": st.sampled_from(names)})
    req = st.one_of(st.builds(lambda o, a: {"op": o, **a}, ops, args), register, register, deregister, value)
    as_line = req.map(lambda r: SocketInput(json.dumps(r).encode() + b"\n", "line"))
    garbage = st.binary(max_size=80).map(lambda b: SocketInput(b.replace(b"\n", b"") + b"\n", "line"))
    partial = req.map(lambda r: SocketInput(json.dumps(r).encode(), "partial"))
    overlong = st.integers(MAX_LINE + 1, 3 * MAX_LINE).map(lambda n: SocketInput(b"[" + b" " * n + b"]\n", "overlong"))
    sock = st.integers(0, 19).flatmap(lambda k: as_line if k < 14 else garbage if k < 17 else partial if k < 19 else overlong)
    # (weights by a drawn number: hypothesis's one_of does not weight by repeated branches)
    return st.integers(0, 9).flatmap(lambda k: tree if k < 7 else sock)


# ---- the fuzzer ---------------------------------------------------------------------------------


@dataclass
class Fuzzer:
    mount: str
    socket_path: str
    state_file: str
    infos: list[GpuInfo]
    alive: Callable[[], bool]
    names: list[str] = field(default_factory=list)  # instances made at each reset
    full_every: int = 50
    cases: int = 0
    accepted: int = 0
    refused: int = 0
    outcomes: Counter = field(default_factory=Counter)  # "tree EINVAL", "socket ok", ...
    replica: Replica = field(init=False)

    def __post_init__(self) -> None:
        self.replica = Replica(self.infos)
        self.query_conn = Line(self.socket_path)
        self.line = Line(self.socket_path)
        self.baseline: dict | None = None

    def query(self) -> dict:
        self.query_conn.send(b'{"op": "query"}\n')
        resp = self.query_conn.reply()
        assert resp is not None and resp["ok"], f"query failed: {resp}"
        return resp["result"]

    def sync(self) -> None:
        with open(self.state_file) as f:
            self.replica.load(json.load(f)["state"])

    def reset(self) -> None:
        """Back to the settings the daemon had when first seen, default_memsize
        1 GiB, and the instances `names` (round robin over the GPUs) only."""
        q = self.query()
        if self.baseline is None:
            self.baseline = q
        for g in q["gpus"]:
            for i in g["instances"]:
                write_node(self.mount, "inst_ctl", f"-{i['name']}".encode(), 0, 0)
        # (1 GiB, not the whole device: several instances fit, so their files are there to fuzz)
        write_node(self.mount, "default_memsize", str(1 << 30).encode(), 0, 0)
        for g in self.baseline["gpus"]:
            for k in ("policy", "max_inst", "prio_ratio"):
                write_node(self.mount, f"{g['index']}/{k}", str(g[k]).encode(), 0, 0)
        for i, name in enumerate(self.names):  # instance files to fuzz from the start
            write_node(self.mount, "inst_ctl", f"{i % len(self.infos)}{name}".encode(), 0, 0)
        self.line.close()
        self.sync()
        self.check(full=True, what="reset")

    def settings(self, q: dict) -> dict:
        # (of a GPU's health only whether it is in service: the rest — the reason, the advice, the last
        # Xid — is the daemon's health watch's, which the tree's writes never touch and the replica lacks)
        gpus = [{**g, "health": {"healthy": (g.get("health") or {}).get("healthy")}} for g in q["gpus"]]
        return {"default_memsize": q["default_memsize"], "gpus": gpus}

    def check(self, full: bool = False, what: Any = None) -> None:
        assert self.alive(), f"the daemon died after {what!r}"
        q = self.query()
        bad = invariants(q)
        assert not bad, f"after {what!r}: invariants broken: {bad}"
        want = self.settings(snapshot(self.replica.node))
        assert self.settings(q) == want, f"after {what!r}: the daemon's state differs from the model's:\n{q}\n{want}"
        if full:
            got = {k: v for k, v in read_tree(self.mount).items() if k not in SKIP_COMPARE}
            want_tree = {k: v for k, v in self.replica.render().items() if k not in SKIP_COMPARE}
            assert got == want_tree, f"after {what!r}: the tree differs from the model's rendering"

    def run(self, case: Any) -> None:
        self.cases += 1
        if isinstance(case, TreeWrite):
            self._tree(case)
        else:
            self._socket(case)
        self.check(full=self.cases % self.full_every == 0, what=case)

    def _tree(self, w: TreeWrite) -> None:
        offset = 0 if w.flags & os.O_APPEND else w.offset  # (appending to a file whose size is 0)
        want = self.replica.expect_write(w.rel, w.data, offset)
        got = write_node(self.mount, w.rel, w.data, w.offset, w.flags)
        assert got == want, f"{w!r}: the daemon answered {_res(got)}, the model says {_res(want)}"
        self.outcomes["tree " + ("ok" if got >= 0 else _res(got))] += 1
        if got > 0:
            self.accepted += 1
            if self.replica.resolve(w.rel) is not None:
                assert read_file(self.mount, w.rel) == self.replica.show(w.rel), w
        else:
            self.refused += 1

    def _socket(self, s: SocketInput) -> None:
        if s.kind == "partial":  # sent, never finished: nothing happens
            self.line.send(s.data)
            self.line.close()
            self.refused += 1
            return
        self.line.send(s.data)
        if s.kind == "overlong":
            resp = self.line.reply()
            assert resp is not None and resp["error"] == "EINVAL" and "too long" in resp["message"], (s, resp)
            assert self.line.eof(), f"{s!r}: the connection stayed open after an overlong line"
            self.refused += 1
            return
        line = s.data[:-1]
        if not line.strip():
            return  # a blank line gets no reply
        req = decode_line(line)
        want = ({"ok": False, "error": errno.errorcode[req.code]} if isinstance(req, Exception)
                else self.replica.handle(req))
        got = self.line.reply()
        assert got is not None, f"{s!r}: the daemon closed the connection"
        assert (got["ok"], got.get("error")) == (want["ok"], want.get("error")), f"{s!r}: daemon {got}, model {want}"
        if got["ok"] and isinstance(req, dict) and req.get("op") in ("register", "deregister"):
            assert got["result"] == want["result"], (s, got, want)
        self.outcomes["socket " + ("ok" if got["ok"] else got["error"])] += 1
        if got["ok"]:
            self.accepted += 1
        else:
            self.refused += 1


def _res(n: int) -> str:
    return str(n) if n >= 0 else errno.errorcode.get(-n, str(-n))
