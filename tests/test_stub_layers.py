"""The stand-in libcuda's files in layers (issue 34, "the house"): the card model (the executor and
its events, the cards' memory) at the bottom, the API files calling down into it, and no file
calling one at its own level or above it, so no circle. The layers are cuda_stub.h's; what each
file calls is read from its object file's undefined symbols (nm), and who defines each symbol from
the others' defined ones: the compiler's view, not a grep of the sources."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

STUBS = Path(__file__).resolve().parent.parent / "native" / "stubs"


def layers() -> list[set[str]]:
    """cuda_stub.h's layers, top first: a line " *   name.c    what it is", two files on one line
    (each after two spaces or more) being one layer."""
    text = (STUBS / "cuda_stub.h").read_text()
    start = text.index("The layers")
    out = []
    for line in text[start:text.index("*/", start)].splitlines():
        if re.match(r"\s\*\s+[a-z_]+\.c\s", line):
            out.append(set(re.findall(r"(?:^\s\*\s+|\s{2,})([a-z_]+\.c)(?=\s{2,}|$)", line)))
    return out


def symbols(obj: Path) -> tuple[set[str], set[str]]:
    out = subprocess.run(["nm", os.fspath(obj)], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "TDBRWV":
            defined.add(parts[2])
        elif len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
    return defined, undefined


def test_each_file_of_the_stand_in_calls_only_the_layers_below_it(tmp_path):
    order = layers()
    built = sorted(p.name for p in STUBS.glob("*.c")
                   if p.name != "libnvidia-ml.c" and not p.name.startswith("nvml_"))  # (libnvidia-ml.so.1's)
    assert sorted(f for layer in order for f in layer) == built, (order, built)  # every file has its layer
    assert {"cuda_exec.c", "card.c"} <= set().union(*order[-3:])  # the card model at the bottom
    level = {f: i for i, layer in enumerate(order) for f in layer}  # 0: the top
    defined_by, calls = {}, {}
    for f in built:
        obj = tmp_path / (f + ".o")
        subprocess.run(["cc", "-c", "-fPIC", "-O1", "-o", os.fspath(obj), os.fspath(STUBS / f)], check=True)
        defined, undefined = symbols(obj)
        for s in defined:
            defined_by[s] = f
        calls[f] = undefined
    wrong = sorted((f, s, defined_by[s]) for f, used in calls.items() for s in used
                   if s in defined_by and level[defined_by[s]] <= level[f])
    assert not wrong, f"calls sideways or up (file, symbol, its file): {wrong}"
