"""A small informer on the official client's `watch.Watch` (client-go's
reflector, tools/cache): LIST once, then WATCH from the list's
resourceVersion, each event handed on as the API's JSON (a dict); LIST again
only when the API server says the version is gone (410) — a watch that ends
or breaks is opened again from the last version seen. Bookmarks
(allowWatchBookmarks) keep that version fresh on a quiet watch, so coming
back after a break seldom needs a LIST.

    inf = Informer("pods", api.list_pod_for_all_namespaces, replace, event,
                   field_selector="spec.nodeName=node-1")
    inf.sync()                  # the first LIST (at start: said, not hidden)
    threading.Thread(target=inf.run, daemon=True).start()   # WATCH, resync on 410

`replace(items)` gets every object of a LIST (the first, and each resync);
`event(type, obj)` each ADDED / MODIFIED / DELETED. `healthy` is False (and
`problem` says why in one line) while the API server cannot be watched.
"""
from __future__ import annotations

import json
import logging
import random
import threading

from cgpud.k8s.api import one_line

log = logging.getLogger("cgpud.k8s")

WATCH_SECONDS = 300  # the server ends each watch after 5-10 minutes (as client-go asks); we watch again
BACKOFF = (0.2, 5.0)  # s: first and longest wait before trying again after a failure


class Informer:
    def __init__(self, what: str, list_fn, replace, event, *, field_selector: str | None = None,
                 convert=None) -> None:
        self.what, self.list_fn, self.replace, self.event = what, list_fn, replace, event
        self.field_selector = field_selector
        self.convert = convert  # what `replace` gets for each LISTed object (default: its JSON as a dict)
        self.version: str | None = None  # the last resourceVersion seen (None: LIST next)
        self.healthy = False
        self.problem = "not read yet"
        self.lists = 0
        self.changed = threading.Condition()  # notified after each applied event
        self._stop = threading.Event()
        self._watch = None

    def _args(self) -> dict:
        return {"field_selector": self.field_selector} if self.field_selector else {}

    def sync(self) -> None:
        """LIST (from the API server's cache: resourceVersion 0) and hand every object to `replace`."""
        resp = self.list_fn(resource_version="0", _preload_content=False, **self._args())
        version, items = parse_list(resp.data, self.convert)
        self.lists += 1
        self.replace(items)
        self.version = version
        self.healthy, self.problem = True, ""
        with self.changed:
            self.changed.notify_all()

    def _watch_once(self) -> None:
        from kubernetes import watch

        def raw(**kw):  # (no model type named: the events' objects stay the API's JSON)
            resp = self.list_fn(**kw)
            if 200 <= getattr(resp, "status", 200) < 300:  # watching again (events or not)
                self.healthy, self.problem = True, ""
            return resp

        w = self._watch = watch.Watch()
        timeout = int(WATCH_SECONDS * (1 + random.random()))
        for ev in w.stream(raw, resource_version=self.version, allow_watch_bookmarks=True, timeout_seconds=timeout,
                           _request_timeout=(10, timeout + 60), **self._args()):
            obj = ev.get("raw_object") or ev.get("object") or {}
            kind = ev.get("type")
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                self.event(kind, obj)
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if version:
                self.version = version
            self.healthy, self.problem = True, ""
            with self.changed:
                self.changed.notify_all()
            if self._stop.is_set():
                w.stop()
                break

    def run(self) -> None:
        """Watch until stop(); LIST again after 410 Gone; after any other failure wait (backing off) and
        watch again from the last version (its errors logged, never raised)."""
        from kubernetes.client.exceptions import ApiException

        wait = BACKOFF[0]
        while not self._stop.is_set():
            try:
                if self.version is None:
                    self.sync()
                    log.info("%s: listed again (resourceVersion %s)", self.what, self.version)
                self._watch_once()
                wait = BACKOFF[0]
                continue
            except ApiException as exc:
                if exc.status == 410:  # too old: the API server no longer has the changes since our version
                    log.info("%s: resourceVersion %s is gone (410): listing again", self.what, self.version)
                    self.version = None
                    continue
                problem = one_line(exc)
            except Exception as exc:  # noqa: BLE001 - connection trouble of any kind: try again
                if self._stop.is_set():
                    break
                problem = one_line(exc)
            said = self.healthy or problem != self.problem
            self.healthy, self.problem = False, problem  # (before the log line: what the log says is so)
            if said:
                log.warning("%s: cannot watch (%s); trying again", self.what, problem)
            with self.changed:
                self.changed.notify_all()
            self._stop.wait(wait)
            wait = min(BACKOFF[1], wait * 2)

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.run, name=f"cgpud-watch-{self.what}", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()


def parse_list(data: bytes, convert=None) -> tuple[str, list]:
    """A LIST's resourceVersion and items; with `convert`, each item is converted as soon as it is
    parsed (and left out when convert gives None), so a LIST of 40,000 pods never exists as 40,000
    pods' worth of dicts at once: only as its bytes and what is kept of each."""
    def hook(d: dict):
        meta = d.get("metadata")
        if "items" not in d and isinstance(meta, dict) and "name" in meta:  # an object of the list
            return _Converted(convert(d))
        return d

    doc = json.loads(data, object_hook=hook if convert is not None else None)
    items = doc.get("items") or []
    if convert is not None:
        items = [i.value for i in items if isinstance(i, _Converted) and i.value is not None]
    return str((doc.get("metadata") or {}).get("resourceVersion") or ""), items


class _Converted:
    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value
