"""docs/tree.md shows exactly the table the code declares (`python -m cgpud.tree`)."""
from __future__ import annotations

import os
import subprocess
import sys

from cgpud.state.durable import Durable
from cgpud.core.model import GpuInfo, Node
from cgpud.state.store import Store
from cgpud.tree import build, markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "tree.md")
BEGIN, END = "<!-- table:begin -->\n", "<!-- table:end -->"


def documented_table() -> str:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{DOC}: one {BEGIN.strip()} and one {END}"
    start = text.index(BEGIN) + len(BEGIN)
    stop = text.index(END)
    assert start <= stop, "markers in the wrong order"
    return text[start:stop]


def declared_table() -> str:
    return markdown(build(Durable(Node([GpuInfo(0, "GPU-x", "x", 1)]), Store("/nonexistent"))))


def test_docs_table_is_the_declared_table():
    assert documented_table() == declared_table(), (
        "docs/tree.md is out of date: put the output of `python -m cgpud.tree` between its markers"
    )


def test_the_module_prints_the_same_table():
    out = subprocess.run(
        [sys.executable, "-m", "cgpud.tree"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out == declared_table()


def test_the_table_has_every_spec_row():
    table = declared_table()
    rows = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert rows == {
        "version",
        "default_memsize",
        "inst_ctl",
        "upgrade",
        "N/",
        "N/policy",
        "N/max_inst",
        "N/free_weight",
        "N/major",
        "N/prio_ratio",
        "N/<name>/",
        "N/<name>/id",
        "N/<name>/memsize",
        "N/<name>/meminfo",
        "N/<name>/weight",
        "N/<name>/highprio",
    }
    # modes and limits as SPEC §1 says
    assert "| `version` | 444 | — |" in table
    assert "| `N/free_weight` | 444 | — |" in table
    assert "| `N/policy` | 644 | 2 bytes |" in table
    assert "| `N/max_inst` | 644 | 3 bytes |" in table
    assert "| `N/<name>/memsize` | 644 | 15 bytes |" in table
    assert "| `inst_ctl` | 644 | 14 bytes |" in table and "EBADF" in table
