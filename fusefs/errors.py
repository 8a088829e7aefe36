"""The one errno boundary.

Handlers call application code that raises its own typed exceptions; here they
become `FUSEError(errno)` through the table the application gave. Anything not
in the table is a bug: it is logged with its traceback and answered `EIO`, so
that one bad request never stops the filesystem (pyfuse3 ends its main loop on
any other exception escaping a handler).
"""
from __future__ import annotations

import errno
import functools
import logging
from typing import Mapping

import pyfuse3

from .node import InvalidInput

log = logging.getLogger("fusefs")

ErrnoTable = Mapping[type, int]


def to_errno(exc: BaseException, table: ErrnoTable) -> int | None:
    if isinstance(exc, InvalidInput):
        return errno.EINVAL
    for cls in type(exc).__mro__:
        if cls in table:
            return table[cls]
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return None


def boundary(method):
    """Wrap an async Operations handler: map known errors, answer EIO for the rest."""

    @functools.wraps(method)
    async def wrapper(self, *args, **kwargs):
        # Counted while in flight: a handover pauses the loop only when none is (fusefs.handover).
        self.in_flight = getattr(self, "in_flight", 0) + 1
        try:
            return await method(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # noqa: BLE001 - this is the last-resort boundary
            code = to_errno(exc, self.errors)
            if code is None:
                log.error("internal error in %s; answered EIO", method.__name__, exc_info=True)
                code = errno.EIO
            else:
                log.debug("%s: %s -> %s", method.__name__, exc, errno.errorcode.get(code, code))
            raise pyfuse3.FUSEError(code) from None
        finally:
            self.in_flight -= 1

    return wrapper
