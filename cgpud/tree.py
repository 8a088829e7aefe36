"""The /proc/cgpu_km table: SPEC §1 declared once.

The FUSE layer serves it, `docs/tree.md` is generated from it
(`python -m cgpud.tree`), and the tests read their expectations from it.
"""
from __future__ import annotations

import errno
import sys

from fusefs import Dir, DynDir, File, InvalidInput, parse_uint
from fusefs.node import walk

from cgpud import __version__
from cgpud.state.durable import Durable
from cgpud.core.model import (
    MAX_INST,
    MEMSIZE_MAX_DIGITS,
    NAME_LEN,
    POLICIES,
    PRIO_RATIO,
)

INST_CTL_LEN = 1 + NAME_LEN


def parse_inst_ctl(text: str, gpu_count: int) -> tuple[str, int | None, str]:
    """`<g><name>` -> ("create", g, name); `-<name>` -> ("destroy", None, name)."""
    if len(text) == INST_CTL_LEN + 1 and text.endswith("\n"):
        text = text[:-1]
    if len(text) != INST_CTL_LEN:
        raise InvalidInput(f"inst_ctl takes exactly {INST_CTL_LEN} bytes, got {len(text)}")
    head, name = text[0], text[1:]
    if head == "-":
        return "destroy", None, name
    if head.isdigit() and int(head) < gpu_count:
        return "create", int(head), name
    raise InvalidInput(f"inst_ctl: {head!r} is neither '-' nor a GPU index below {gpu_count}")


def build(d: Durable, upgrader=None) -> Dir:
    """Bind the table to one node. Handlers look the node up at each call
    (its GPU list is replaced when a state is loaded). `upgrader`
    (cgpud.daemon.upgrade.Upgrader) answers the `upgrade` node; without one it
    reads `none` and a write answers EOPNOTSUPP."""
    node = d.node

    def gpu(key) -> int:
        return int(key[0])

    def gpu_keys(key):
        return [str(g.index) for g in node.gpus]

    def inst_keys(key):
        return node.gpus[gpu(key)].instances

    def inst(key):
        return node.instance(gpu(key), key[1])

    def inst_ctl(key, text):
        op, g, name = parse_inst_ctl(text, len(node.gpus))
        if op == "create":
            d.apply(lambda n: n.create_instance(g, name))
        else:
            d.apply(lambda n: n.destroy(name))

    def upgrade_show(key):
        return upgrader.status.text if upgrader is not None else "none"

    def upgrade_store(key, text):
        parse_uint(text, 1, 1)
        if upgrader is None:
            raise OSError(errno.EOPNOTSUPP, "hot upgrade is not available here")
        return upgrader.request()  # awaited by the write: returns once the new daemon is ready

    def meminfo(key):
        i = inst(key)
        lines = [f"Free: {i.free}"] + [f"PID: {pid} Mem: {n}" for pid, n in sorted(i.procs.items())]
        return "\n".join(lines)

    mem_max = 10**MEMSIZE_MAX_DIGITS - 1
    instance_files = [
        File("id", show=lambda k: str(inst(k).id), doc="the instance number (the minor of its cGPU device)"),
        File(
            "memsize",
            show=lambda k: str(inst(k).memsize),
            store=lambda k, t: d.apply(lambda n: n.set_memsize(gpu(k), k[1], parse_uint(t, 0, mem_max))),
            max_bytes=MEMSIZE_MAX_DIGITS + 1,
            doc="bytes of GPU memory the instance sees and may use",
        ),
        File("meminfo", show=meminfo, doc="`Free: <bytes>` then `PID: <pid> Mem: <bytes>` per process"),
        File(
            "weight",
            show=lambda k: str(inst(k).weight),
            store=lambda k, t: d.apply(lambda n: n.set_weight(gpu(k), k[1], parse_uint(t, 0, MAX_INST[1]))),
            max_bytes=3,
            doc="0..max_inst; the sum on a GPU never passes max_inst",
        ),
        File(
            "highprio",
            show=lambda k: str(int(inst(k).highprio)),
            store=lambda k, t: d.apply(lambda n: n.set_highprio(gpu(k), k[1], parse_uint(t, 0, 1))),
            max_bytes=2,
            doc="`1`: takes the GPU when active, up to prio_ratio %",
        ),
    ]
    gpu_files = [
        File(
            "policy",
            show=lambda k: str(node.gpu(gpu(k)).policy),
            store=lambda k, t: d.apply(
                lambda n: n.set_policy(gpu(k), parse_uint(t, POLICIES.start, POLICIES.stop - 1))
            ),
            max_bytes=2,
            doc="compute policy 0..5 (SPEC §5); takes effect at once",
        ),
        File(
            "max_inst",
            show=lambda k: str(node.gpu(gpu(k)).max_inst),
            store=lambda k, t: d.apply(lambda n: n.set_max_inst(gpu(k), parse_uint(t, *MAX_INST))),
            max_bytes=3,
            doc=f"{MAX_INST[0]}..{MAX_INST[1]}; EBUSY below the instance count or the weight sum",
        ),
        File("free_weight", show=lambda k: str(node.gpu(gpu(k)).free_weight), doc="max_inst − Σ weight"),
        File("major", show=lambda k: str(node.gpu(gpu(k)).info.major), doc="char-device major of the cGPU device"),
        File(
            "prio_ratio",
            show=lambda k: str(node.gpu(gpu(k)).prio_ratio),
            store=lambda k, t: d.apply(lambda n: n.set_prio_ratio(gpu(k), parse_uint(t, *PRIO_RATIO))),
            max_bytes=3,
            doc=f"{PRIO_RATIO[0]}..{PRIO_RATIO[1]}: the most compute a high-priority instance may take (%)",
        ),
        DynDir("<name>", inst_keys, instance_files, doc="one per instance on this GPU"),
    ]
    return Dir(
        "",
        [
            File("version", show=lambda k: __version__, doc="daemon version"),
            File(
                "default_memsize",
                show=lambda k: str(node.default_memsize),
                store=lambda k, t: d.apply(lambda n: n.set_default_memsize(parse_uint(t, 0, mem_max))),
                max_bytes=MEMSIZE_MAX_DIGITS + 1,
                doc="bytes given to an instance created through inst_ctl (0 = the whole device)",
            ),
            File(
                "inst_ctl",
                store=inst_ctl,
                max_bytes=INST_CTL_LEN + 1,
                read_errno=errno.EBADF,
                doc="`<g><name>` creates, `-<name>` destroys everywhere (13 bytes, a 14th `\\n` accepted)",
            ),
            File("upgrade", show=upgrade_show, store=upgrade_store, max_bytes=2,
                 doc="`none`, `in progress`, `done <version> <time>` or `failed: <reason>`; "
                     "`1` starts a hot upgrade (docs/upgrade.md)"),
            DynDir("N", gpu_keys, gpu_files, doc="one per GPU"),
        ],
    )


def markdown(root: Dir) -> str:
    rows = ["| path | mode | longest write | meaning |", "|---|---|---|---|"]
    for path, n in walk(root.children):
        if isinstance(n, File):
            mode = oct(n.mode() & 0o777)[2:]
            size = f"{n.max_bytes} bytes" if n.writable else "—"
            extra = f" (reads: {errno.errorcode[n.read_errno]})" if n.read_errno else ""
            rows.append(f"| `{path}` | {mode} | {size} | {n.doc}{extra} |")
        else:
            rows.append(f"| `{path}/` | 555 | — | {n.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m cgpud.tree > docs/tree-table.md
    from cgpud.core.model import GpuInfo, Node
    from cgpud.state.store import Store

    sys.stdout.write(markdown(build(Durable(Node([GpuInfo(0, "GPU-x", "x", 1)]), Store("/nonexistent")))))
