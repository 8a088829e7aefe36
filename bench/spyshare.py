"""bench/spyshare: where the extender's samples went in a py-spy record (bench/binpack.py --profile:
`--gil --threads --format raw`, collapsed stacks with the sampled thread first), as shares of all samples:
by what the thread was doing (filter, prioritize, bind, the node and pod watches, the events thread, the
HTTP server's own parsing) and, across them, by what the sample was in (JSON, TLS, the kubernetes
client's own Python, urllib3, pydantic's call validation, http.server's header parsing).

    .venv/bin/python bench/spyshare.py FILE...
"""
from __future__ import annotations

import sys
from collections import Counter

# (category, a frame text that says it), first match from the sample's root wins
DOING = (("filter", "filter_nodes ("), ("prioritize", "prioritize (cgpud/k8s/score"),
         ("bind: choose and patch the Node", "_choose_and_write ("), ("bind: the rest", "_bind ("),
         ("watch: nodes", "cgpud-watch-nodes"), ("watch: pods", "cgpud-watch-pods"),
         ("events thread", "cgpud-extender-events"), ("GET /metrics", "do_GET ("),
         ("HTTP server: reading requests", "process_request_thread"))
# what the innermost frames are in, last frame first
IN = (("JSON", "json/"), ("TLS (ssl)", "ssl.py"), ("pydantic validation", "pydantic"),
      ("urllib3", "urllib3/"), ("kubernetes client", "kubernetes/client"), ("kubernetes watch", "kubernetes/watch"),
      ("http.server / email headers", ("http/server.py", "email/", "http/client.py")),
      ("cgpud", "cgpud/"), ("threading / queue", ("threading.py", "queue.py")))


def classify(stack: str) -> tuple[str, str]:
    doing = next((name for name, mark in DOING if mark in stack), "other")
    frames = stack.split(";")
    inside = "other"
    for frame in reversed(frames):
        hit = next((name for name, mark in IN
                    if any(m in frame for m in ((mark,) if isinstance(mark, str) else mark))), None)
        if hit:
            inside = hit
            break
    return doing, inside


def main() -> None:
    for path in sys.argv[1:]:
        doing, inside, total = Counter(), Counter(), 0
        for line in open(path, encoding="utf-8", errors="replace"):
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not n.isdigit():
                continue
            d, i = classify(stack)
            doing[d] += int(n)
            inside[(d, i)] += int(n)
            total += int(n)
        print(f"{path}: {total} samples holding the GIL")
        for d, n in doing.most_common():
            parts = ", ".join(f"{i} {m / total:.1%}" for (dd, i), m in inside.most_common() if dd == d and m / total >= .005)
            print(f"  {d:34s} {n / total:6.1%}  ({parts})")
        print("  across all: " + ", ".join(f"{i} {n / total:.1%}" for i, n in
                                           sum((Counter({i: m}) for (_, i), m in inside.items()), Counter()).most_common()))


if __name__ == "__main__":
    main()
