"""Durable state: one JSON document, replaced atomically.

`save` returns only when the new state is on disk: written to a temporary file,
fsync'd, renamed over the old one, and the directory fsync'd. A crash at any
point leaves either the old state or the new one, never a mix.

A state file that cannot be read or parsed stops the start (`CorruptState`):
never a silent reset.
"""
from __future__ import annotations

import errno
import json
import os

FORMAT = 1
FILENAME = "state.json"


class CorruptState(Exception):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(
            f"state file {path} is unusable ({reason}). Nothing was changed. "
            f"Fix it, or move it away to start with no instances and default settings."
        )
        self.path = path


class Store:
    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        self.path = os.path.join(self.directory, FILENAME)
        self._tmp = self.path + ".tmp"
        self._dirfd: int | None = None

    def open(self) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._dirfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)

    def close(self) -> None:
        if self._dirfd is not None:
            os.close(self._dirfd)
            self._dirfd = None

    def load(self) -> dict | None:
        """The saved state, or None when there is none yet."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CorruptState(self.path, exc.strerror or str(exc)) from None
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptState(self.path, f"not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("state"), dict):
            raise CorruptState(self.path, f"not a cgpud state of format {FORMAT}")
        return doc["state"]

    def save(self, state: dict) -> None:
        if self._dirfd is None:
            self.open()
        data = json.dumps({"format": FORMAT, "state": state}, separators=(",", ":")).encode()
        fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        except OSError:
            os.close(fd)
            _unlink_quietly(self._tmp)
            raise
        os.close(fd)
        try:
            os.rename(self._tmp, self.path)
        except OSError:
            _unlink_quietly(self._tmp)
            raise
        os.fsync(self._dirfd)  # type: ignore[arg-type]


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            pass
