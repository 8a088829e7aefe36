"""Declarations of a tree of control files, in the manner of the kernel's
`ctl_table` and `cgroup_base_files[]`: a node is declared once by its name and
handlers; its mode follows from which handlers it has.

A handler receives the *key* of the node: the names of the dynamic directories
on the path to it, outermost first. For `0/abcdef012345/weight` under the
declaration `DynDir(gpus, [DynDir(instances, [File("weight", …)])])` the key is
`("0", "abcdef012345")`.
"""
from __future__ import annotations

import stat
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence, Union

Key = tuple[str, ...]


class InvalidInput(ValueError):
    """A written value is malformed or out of range: answered EINVAL."""


@dataclass(frozen=True)
class File:
    """One control file.

    show:     key -> the file's text (a trailing newline is added if missing).
    store:    (key, text) -> None; applies one written command or raises.
    max_bytes: the longest write accepted, whitespace and newline included.
    read_errno: answer reads with this errno instead of text (write-only controls).
    """

    name: str
    show: Callable[[Key], str] | None = None
    store: Callable[[Key, str], None] | None = None
    max_bytes: int = 64
    read_errno: int | None = None
    doc: str = ""

    @property
    def writable(self) -> bool:
        return self.store is not None

    def mode(self, group_write: bool = False) -> int:
        perm = 0o444
        if self.store is not None:
            perm |= 0o200 | (0o020 if group_write else 0)
        return stat.S_IFREG | perm


@dataclass(frozen=True)
class Dir:
    """A directory with a fixed name and declared children."""

    name: str
    children: Sequence["Node"] = field(default_factory=tuple)
    doc: str = ""

    def mode(self, group_write: bool = False) -> int:
        return stat.S_IFDIR | 0o555


@dataclass(frozen=True)
class DynDir:
    """One directory per key that `keys(parent_key)` lists right now.

    `label` names the family in docs and messages (`N`, `<name>`).
    """

    label: str
    keys: Callable[[Key], Iterable[str]]
    children: Sequence["Node"] = field(default_factory=tuple)
    doc: str = ""

    def mode(self, group_write: bool = False) -> int:
        return stat.S_IFDIR | 0o555


Node = Union[File, Dir, DynDir]


def walk(children: Sequence[Node], prefix: str = "") -> Iterable[tuple[str, Node]]:
    """Every declared node with a display path (`N/<name>/weight`), depth first."""
    for child in children:
        name = child.label if isinstance(child, DynDir) else child.name
        path = f"{prefix}{name}"
        yield path, child
        if not isinstance(child, File):
            yield from walk(child.children, path + "/")


def parse_uint(text: str, lo: int, hi: int) -> int:
    """Parse one unsigned decimal the way a strict sysctl does.

    Surrounding whitespace (and so one trailing newline) is accepted; a sign,
    a base prefix, an empty value or anything else is not.
    """
    s = text.strip()
    if not s or not s.isascii() or not s.isdigit():
        raise InvalidInput(f"not an unsigned decimal: {text!r}")
    value = int(s)
    if not lo <= value <= hi:
        raise InvalidInput(f"{value} is out of range {lo}..{hi}")
    return value


def parse_bool(text: str) -> bool:
    return bool(parse_uint(text, 0, 1))
