"""pyfuse3 Operations over a declared tree: a thin translator.

Inodes are interned by path and never reused while the process lives, so an
inode number is stable for as long as its path exists (and comes back the same
when a path reappears). Files are opened `direct_io` (their size is reported as
0, like procfs), so every read reaches the handler; lookups and attributes are
cached by the kernel for `timeout` seconds and invalidated when a dynamic
directory disappears, so listings are never stale.

Write rules (one place for all of them):
- one write(2) is one command at offset 0, applied whole or refused;
- longer than the node's `max_bytes`, not ASCII, or holding a NUL: EINVAL;
- opening a read-only node for writing: EACCES, for root too;
- creating, removing, renaming, linking, chmod/chown: EPERM;
- truncation (O_TRUNC or setattr size 0) of a writable file: accepted, ignored.
"""
from __future__ import annotations

import errno
import inspect
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import pyfuse3
import trio

from .errors import ErrnoTable, boundary
from .node import Dir, DynDir, File, Key, Node

log = logging.getLogger("fusefs")

Path = tuple[str, ...]


@dataclass
class _Entry:
    path: Path
    node: Node
    key: Key


@dataclass
class _Handle:
    entry: _Entry
    text: bytes | None = None


@dataclass
class _DirHandle:
    entry: _Entry
    names: list[tuple[bytes, int]] = field(default_factory=list)


class Operations(pyfuse3.Operations):
    """Serve `root` (a Dir whose name is ignored).

    errors:  application exception type -> errno, for the boundary.
    version: a cheap counter the application bumps whenever a dynamic directory
             appears or goes; when it moves, vanished directories are
             invalidated in the kernel before the write that moved it returns.
    write_gid: a group whose members may write too (mode 0664), or None.
    """

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self,
        root: Dir,
        *,
        errors: ErrnoTable,
        version: Callable[[], int] = lambda: 0,
        uid: int = 0,
        gid: int = 0,
        write_gid: int | None = None,
        timeout: float = 3600.0,
    ) -> None:
        super().__init__()
        self.root = root
        self.errors = errors
        self._version = version
        self._seen_version = version()
        self._uid = uid
        self._gid = write_gid if write_gid is not None else gid
        self._group_write = write_gid is not None
        self._timeout = timeout
        self._time_ns = time.time_ns()
        root_entry = _Entry((), root, ())
        self._by_path: dict[Path, int] = {(): pyfuse3.ROOT_INODE}
        self._by_ino: dict[int, _Entry] = {pyfuse3.ROOT_INODE: root_entry}
        self._next_ino = pyfuse3.ROOT_INODE + 1
        self._handles: dict[int, _Handle | _DirHandle] = {}
        self._next_fh = 1
        # Dynamic directories the kernel may hold a dentry for: path -> parent inode.
        self._dyn_seen: dict[Path, int] = {}
        self._invalidate: Callable[[int, bytes], None] = pyfuse3.invalidate_entry
        self.in_flight = 0  # handlers holding a request (counted by the boundary)
        self.pausing = False  # fusefs.handover is pausing the loop: do not wait for invalidations

    # ---- the tree --------------------------------------------------------

    def _children(self, entry: _Entry) -> list[tuple[str, Node, Key]]:
        """The names in a directory now, in declaration order."""
        node = entry.node
        assert not isinstance(node, File)
        out: list[tuple[str, Node, Key]] = []
        for child in node.children:
            if isinstance(child, DynDir):
                for k in child.keys(entry.key):
                    out.append((k, child, entry.key + (k,)))
            else:
                out.append((child.name, child, entry.key))
        return out

    def _child(self, entry: _Entry, name: str) -> tuple[Node, Key] | None:
        node = entry.node
        if isinstance(node, File):
            return None
        for child in node.children:
            if isinstance(child, DynDir):
                if name in child.keys(entry.key):
                    return child, entry.key + (name,)
            elif child.name == name:
                return child, entry.key
        return None

    def _intern(self, parent: _Entry, name: str, node: Node, key: Key) -> int:
        path = parent.path + (name,)
        ino = self._by_path.get(path)
        if ino is None:
            ino = self._next_ino
            self._next_ino += 1
            self._by_path[path] = ino
        # (Re)bind: a path that vanished and came back keeps its number.
        self._by_ino[ino] = _Entry(path, node, key)
        if isinstance(node, DynDir):
            self._dyn_seen[path] = self._by_path[parent.path]
        return ino

    def _exists(self, entry: _Entry) -> bool:
        """Whether a previously interned path still exists now."""
        cur = self._by_ino[pyfuse3.ROOT_INODE]
        for name in entry.path:
            found = self._child(cur, name)
            if found is None:
                return False
            node, key = found
            cur = _Entry(cur.path + (name,), node, key)
        return True

    def _entry(self, ino: int) -> _Entry:
        entry = self._by_ino.get(ino)
        if entry is None or (entry.path and isinstance(entry.node, DynDir) and not self._exists(entry)):
            raise pyfuse3.FUSEError(errno.ENOENT)
        if entry.key and not self._key_alive(entry):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return entry

    def _key_alive(self, entry: _Entry) -> bool:
        # A file inside a dynamic directory lives as long as that directory.
        # Check only the dynamic components (cheap: one keys() call each).
        if isinstance(entry.node, DynDir):
            return True  # checked by _exists
        depth = len(entry.path) - 1
        parent_path = entry.path[:depth]
        parent_ino = self._by_path.get(parent_path)
        if parent_ino is None:
            return False
        parent = self._by_ino[parent_ino]
        if isinstance(parent.node, DynDir):
            return self._exists(parent)
        return True

    def attrs(self, ino: int, node: Node) -> pyfuse3.EntryAttributes:
        """The one builder of attributes."""
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        a.entry_timeout = self._timeout
        a.attr_timeout = self._timeout
        a.st_mode = node.mode(self._group_write)
        a.st_nlink = 1 if isinstance(node, File) else 2
        a.st_uid = self._uid
        a.st_gid = self._gid
        a.st_rdev = 0
        a.st_size = 0
        a.st_blksize = 4096
        a.st_blocks = 0
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = self._time_ns
        return a

    # ---- keeping the kernel's cache honest --------------------------------

    async def refresh(self) -> None:
        """Invalidate dentries of dynamic directories that no longer exist.

        Runs the blocking notification in a worker thread: the kernel may need
        this very event loop to answer a lookup before it can drop the entry.
        """
        v = self._version()
        if v == self._seen_version:
            return
        self._seen_version = v
        gone = [p for p in self._dyn_seen if not self._exists(self._by_ino[self._by_path[p]])]
        for path in gone:
            # A concurrent refresh may have taken it while we awaited: invalidate
            # anyway, so that this write too returns only once the entry is gone.
            parent_ino = self._dyn_seen.pop(path, None) or self._by_path[path[:-1]]
            name = path[-1].encode()
            if self.pausing:
                pyfuse3.invalidate_entry_async(parent_ino, name, ignore_enoent=True)
                continue
            try:
                await trio.to_thread.run_sync(self._invalidate, parent_ino, name)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTCONN, errno.EBADF):
                    log.warning("could not invalidate %s: %s", "/".join(path), exc)

    # ---- handing the connection to another process (fusefs.handover) ---------

    def export_state(self) -> dict:
        """What the kernel knows of us, as plain data: inode numbers by path,
        open file and directory handles, the attribute times."""
        handles = {}
        for fh, h in self._handles.items():
            if isinstance(h, _Handle):
                handles[str(fh)] = {"path": list(h.entry.path),
                                    "text": None if h.text is None else h.text.decode("ascii")}
            else:
                handles[str(fh)] = {"path": list(h.entry.path), "dir": [[n.decode(), i] for n, i in h.names]}
        return {
            "inodes": [[list(p), ino] for p, ino in self._by_path.items()],
            "next_ino": self._next_ino,
            "handles": handles,
            "next_fh": self._next_fh,
            "dyn_seen": [[list(p), parent] for p, parent in self._dyn_seen.items()],
            "time_ns": self._time_ns,
        }

    def _resolve(self, path: Path) -> _Entry | None:
        """The declared node at `path`, whether or not it exists now."""
        cur = self._by_ino[pyfuse3.ROOT_INODE]
        for name in path:
            if isinstance(cur.node, File):
                return None
            static = [c for c in cur.node.children if not isinstance(c, DynDir) and c.name == name]
            dyn = [c for c in cur.node.children if isinstance(c, DynDir)]
            if static:
                cur = _Entry(cur.path + (name,), static[0], cur.key)
            elif dyn:
                cur = _Entry(cur.path + (name,), dyn[0], cur.key + (name,))
            else:
                return None
        return cur

    def import_state(self, state: dict) -> None:
        """Take over what another process's `export_state` gave: the same
        numbers for the same paths, the same open handles. A path this tree
        no longer declares answers ENOENT."""
        for p, ino in state["inodes"]:
            path = tuple(p)
            self._by_path[path] = ino
            entry = self._resolve(path)
            if entry is not None:
                self._by_ino[ino] = entry
        self._next_ino = max(self._next_ino, state["next_ino"])
        for fh, h in state["handles"].items():
            entry = self._resolve(tuple(h["path"]))
            if entry is None:
                continue
            if "dir" in h:
                self._handles[int(fh)] = _DirHandle(entry, [(n.encode(), i) for n, i in h["dir"]])
            else:
                self._handles[int(fh)] = _Handle(entry, None if h["text"] is None else h["text"].encode("ascii"))
        self._next_fh = max(self._next_fh, state["next_fh"])
        self._dyn_seen.update({tuple(p): parent for p, parent in state["dyn_seen"]})
        self._time_ns = state["time_ns"]

    # ---- handlers ----------------------------------------------------------

    @boundary
    async def lookup(self, parent_inode, name, ctx=None):
        parent = self._entry(parent_inode)
        found = self._child(parent, os.fsdecode(name))
        if found is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        node, key = found
        ino = self._intern(parent, os.fsdecode(name), node, key)
        return self.attrs(ino, node)

    async def forget(self, inode_list):
        return None  # inodes are interned by path for the life of the process

    @boundary
    async def getattr(self, inode, ctx=None):
        entry = self._entry(inode)
        return self.attrs(inode, entry.node)

    @boundary
    async def setattr(self, inode, attr, fields, fh, ctx):
        entry = self._entry(inode)
        if fields.update_mode or fields.update_uid or fields.update_gid:
            raise pyfuse3.FUSEError(errno.EPERM)
        if fields.update_size:
            if not isinstance(entry.node, File) or not entry.node.writable:
                raise pyfuse3.FUSEError(errno.EACCES)
            if attr.st_size != 0:
                raise pyfuse3.FUSEError(errno.EINVAL)
            # `echo x > file`: the truncation before the write; nothing to do.
        # Time updates (touch) are accepted and ignored, as procfs does.
        return self.attrs(inode, entry.node)

    @boundary
    async def open(self, inode, flags, ctx):
        entry = self._entry(inode)
        node = entry.node
        if not isinstance(node, File):
            raise pyfuse3.FUSEError(errno.EISDIR)
        if (flags & os.O_ACCMODE) != os.O_RDONLY and not node.writable:
            raise pyfuse3.FUSEError(errno.EACCES)
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = _Handle(entry)
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False, nonseekable=False)

    @boundary
    async def read(self, fh, off, size):
        h = self._handles[fh]
        assert isinstance(h, _Handle)
        node = h.entry.node
        assert isinstance(node, File)
        if node.read_errno is not None:
            raise pyfuse3.FUSEError(node.read_errno)
        if node.show is None:
            raise pyfuse3.FUSEError(errno.EACCES)
        if off == 0 or h.text is None:
            # (A node that vanished since open makes show() raise its own
            # not-found error, which the boundary maps.)
            text = node.show(h.entry.key)
            if not text.endswith("\n"):
                text += "\n"
            h.text = text.encode("ascii")
        return h.text[off : off + size]

    @boundary
    async def write(self, fh, off, buf):
        h = self._handles[fh]
        assert isinstance(h, _Handle)
        node = h.entry.node
        assert isinstance(node, File) and node.store is not None
        if off != 0 or len(buf) > node.max_bytes or b"\0" in buf:
            raise pyfuse3.FUSEError(errno.EINVAL)
        try:
            text = buf.decode("ascii")
        except UnicodeDecodeError:
            raise pyfuse3.FUSEError(errno.EINVAL) from None
        if h.entry.key and not self._key_alive(h.entry):
            raise pyfuse3.FUSEError(errno.ENOENT)
        pending = node.store(h.entry.key, text)
        if inspect.isawaitable(pending):  # a store that takes time (cgpud's hot upgrade)
            await pending
        await self.refresh()
        return len(buf)

    async def release(self, fh):
        self._handles.pop(fh, None)

    @boundary
    async def opendir(self, inode, ctx):
        entry = self._entry(inode)
        if isinstance(entry.node, File):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = _DirHandle(entry)
        return fh

    @boundary
    async def readdir(self, fh, start_id, token):
        h = self._handles[fh]
        assert isinstance(h, _DirHandle)
        if start_id == 0:  # a listing is a snapshot taken at its first read
            h.names = []
            for name, node, key in self._children(h.entry):
                ino = self._intern(h.entry, name, node, key)
                h.names.append((name.encode(), ino))
        for i in range(start_id, len(h.names)):
            name, ino = h.names[i]
            if not pyfuse3.readdir_reply(token, name, self.attrs(ino, self._by_ino[ino].node), i + 1):
                break

    async def releasedir(self, fh):
        self._handles.pop(fh, None)

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_namemax = 255
        return s

    # Everything that would create, remove, rename or link: refused.
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        raise pyfuse3.FUSEError(errno.EPERM)

    async def mkdir(self, parent_inode, name, mode, ctx):
        raise pyfuse3.FUSEError(errno.EPERM)

    async def create(self, parent_inode, name, mode, flags, ctx):
        raise pyfuse3.FUSEError(errno.EPERM)

    async def unlink(self, parent_inode, name, ctx):
        raise pyfuse3.FUSEError(errno.EPERM)

    async def rmdir(self, parent_inode, name, ctx):
        raise pyfuse3.FUSEError(errno.EPERM)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        raise pyfuse3.FUSEError(errno.EPERM)

    async def symlink(self, parent_inode, name, target, ctx):
        raise pyfuse3.FUSEError(errno.EPERM)

    async def link(self, inode, new_parent_inode, new_name, ctx):
        raise pyfuse3.FUSEError(errno.EPERM)
