"""The real thing: `cgpud serve` in a subprocess, the tree mounted over FUSE,
and real programs (`cat`, `echo`, `printf`, `ls -l`, `stat`) and Python `os`
calls against it. SPEC §1 (the tree and its write rules), §2 (inst_ctl), §4
(invariants), §7 (state), and the daemon's start-up and shutdown.

Expectations about which files exist, their modes and their longest write are
read from the declared table (cgpud/tree.py) and checked against SPEC §1 once,
in `test_declared_table_is_spec_section_1`.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys

import pytest

from cgpud import __version__
from conftest import SIM_T4_BYTES, Daemon, as_nobody, concrete, declared_tree, mounted, nobody_python, shell
from fusefs.node import File

T4 = SIM_T4_BYTES
NAME = "abcdef012345"
GIB = 1 << 30

DECLARED = declared_tree()
FILES = {p: n for p, n in DECLARED.items() if isinstance(n, File)}
DIRS = [p for p, n in DECLARED.items() if not isinstance(n, File)]
WRITABLE = sorted(p for p, n in FILES.items() if n.writable)
READ_ONLY = sorted(p for p, n in FILES.items() if not n.writable)

# SPEC §1, row by row: the longest write ("≤ N bytes"; inst_ctl: §2, 13 bytes
# and a 14th '\n'), None for read-only rows.
SPEC_LONGEST_WRITE = {
    "version": None,
    "default_memsize": 15,
    "inst_ctl": 14,
    "upgrade": 2,  # SPEC gives no limit; `1` is the only command: one digit and '\n'
    "N/policy": 2,
    "N/max_inst": 3,
    "N/free_weight": None,
    "N/major": None,
    "N/prio_ratio": 3,
    "N/<name>/id": None,
    "N/<name>/memsize": 15,
    "N/<name>/meminfo": None,
    "N/<name>/weight": 3,
    "N/<name>/highprio": 2,
}

# What a fresh daemon shows once `NAME` was created on each GPU through
# inst_ctl with the defaults (default_memsize 0 = the whole device, weight 1).
FRESH = {
    "version": lambda v: v == __version__ and re.fullmatch(r"\d+\.\d+\.\d+", v),
    "default_memsize": "0",
    "upgrade": lambda v: re.fullmatch(r"[ -~]+", v),  # [ours]: one printable line
    "N/policy": "0",
    "N/max_inst": "16",
    "N/free_weight": "15",  # 16 − the one instance's weight 1
    "N/major": lambda v: re.fullmatch(r"[1-9]\d*", v),
    "N/prio_ratio": lambda v: v.isdigit() and 20 <= int(v) <= 99,
    "N/<name>/id": lambda v: re.fullmatch(r"[1-9]\d*", v),
    "N/<name>/memsize": str(T4),
    "N/<name>/meminfo": f"Free: {T4}",  # no process holds memory
    "N/<name>/weight": "1",
    "N/<name>/highprio": "0",
}

# Settings: three valid values (none the default, so each write shows), a
# padded one (surrounding whitespace and '\n' within the byte limit), and
# values that must be refused with EINVAL (not a number, out of range).
SETTINGS = {
    "default_memsize": (["1073741824", "0", "99999999999999"], " 4096\n",
                        ["x", "-1", "+1", "0x10", "1e9", "1.5", " ", "1 2", "\n"]),
    "N/policy": (["5", "2", "1"], " 3", ["6", "9", "-1", "a", " ", "+1"]),
    "N/max_inst": (["25", "1", "7"], " 9\n", ["0", "26", "99", "-1", "x", " "]),
    "N/prio_ratio": (["20", "99", "42"], "33\n", ["19", "100", "0", "x", "-50", " "]),
    "N/<name>/memsize": ([str(GIB), "0", str(T4 - 1)], f" {GIB}\n", ["x", "-1", str(GIB) + "k", "1_000"]),
    "N/<name>/weight": (["16", "0", "7"], " 5\n", ["17", "25", "26", "-1", "x", " "]),
    "N/<name>/highprio": (["1", "0", "1"], "1\n", ["2", "9", "-1", "x", " "]),
}


def rel(display: str, gpu: int = 0) -> str:
    return concrete(display, gpu, NAME)


@pytest.fixture
def d(make_daemon) -> Daemon:
    """Two simulated T4s, `NAME` created on both through inst_ctl."""
    dm = make_daemon(gpus="sim:2xT4")
    dm.create(0, NAME)
    dm.create(1, NAME)
    return dm


def bash_in(d: Daemon, cmd: str) -> subprocess.CompletedProcess:
    return shell(cmd, cwd=d.path())


def check_value(display: str, text: str) -> None:
    assert text.endswith("\n") and text.count("\n") == 1, f"{display}: {text!r}: one value ending in one newline"
    want = FRESH[display]
    v = text[:-1]
    assert (want(v) if callable(want) else v == want), f"{display}: read {v!r}"


# ---- the table ---------------------------------------------------------------


def test_declared_table_is_spec_section_1():
    assert set(FILES) == set(SPEC_LONGEST_WRITE) == set(FRESH) | {"inst_ctl"}
    assert DIRS == ["N", "N/<name>"]
    for path, node in FILES.items():
        want = SPEC_LONGEST_WRITE[path]
        if want is None:
            assert not node.writable, path
        else:
            assert node.writable and node.max_bytes == want, (path, node.max_bytes)
    assert set(SETTINGS) == set(WRITABLE) - {"inst_ctl", "upgrade"}


# ---- reading every row -------------------------------------------------------


def test_every_row_reads_its_value_with_a_trailing_newline(d):
    for gpu in (0, 1):
        for display in FILES:
            if display == "inst_ctl":
                continue
            path = rel(display, gpu)
            text = d.read(path)
            check_value(display, text)
            # `cat` sees exactly what read(2) sees
            res = bash_in(d, f"cat {path}")
            assert res.returncode == 0 and res.stdout == text, (path, res)
    assert d.value("0/major") == d.value("1/major")
    # one id per instance, the same name on two GPUs is two instances
    assert d.value(f"0/{NAME}/id") != d.value(f"1/{NAME}/id")


def test_reading_in_small_pieces_and_at_offsets(d):
    fd = os.open(d.path("version"), os.O_RDONLY)
    try:
        text = b"".join(iter(lambda: os.read(fd, 1), b""))
        assert os.pread(fd, 100, 2) == text[2:]
        assert os.pread(fd, 100, 0) == text
    finally:
        os.close(fd)
    assert text.decode() == __version__ + "\n"
    # a file kept open shows the current value at each read from offset 0
    fd = os.open(d.path("0/policy"), os.O_RDONLY)
    try:
        assert os.pread(fd, 10, 0) == b"0\n"
        d.write("0/policy", "4")
        assert os.pread(fd, 10, 0) == b"4\n"
    finally:
        os.close(fd)


def test_inst_ctl_reads_answer_ebadf(d):
    fd = os.open(d.path("inst_ctl"), os.O_RDONLY)
    try:
        with pytest.raises(OSError) as err:
            os.read(fd, 100)
        assert err.value.errno == errno.EBADF
    finally:
        os.close(fd)
    res = bash_in(d, "cat inst_ctl")
    assert res.returncode != 0 and "Bad file descriptor" in res.stderr


def test_ls_l_and_stat_show_modes_and_owner(d):
    expect = {}
    for display, node in DECLARED.items():
        for gpu in (0, 1):
            expect[rel(display, gpu)] = (0o555 if display in DIRS else (0o644 if node.writable else 0o444),
                                         display in DIRS)
    expect[""] = (0o555, True)
    for path, (mode, is_dir) in expect.items():
        st = os.stat(d.path(path))
        assert stat.S_IMODE(st.st_mode) == mode, (path, oct(st.st_mode))
        assert stat.S_ISDIR(st.st_mode) == is_dir and (is_dir or stat.S_ISREG(st.st_mode)), path
        assert (st.st_uid, st.st_gid) == (0, 0), path
        res = subprocess.run(["stat", "-c", "%a %U %G %F", d.path(path)], capture_output=True, text=True)
        kind = "directory" if is_dir else "regular empty file"
        assert res.stdout == f"{mode:o} root root {kind}\n", (path, res)
    # ls -l of every directory: the permission string, root:root, the names
    for display in ["", "0", "1", f"0/{NAME}", f"1/{NAME}"]:
        res = subprocess.run(["ls", "-l", d.path(display)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()[1:]  # after "total 0"
        names = set()
        for line in lines:
            perms, _links, owner, group, *_rest, name = line.split()
            names.add(name)
            path = f"{display}/{name}" if display else name
            mode, is_dir = expect[path]
            assert perms == stat.filemode((stat.S_IFDIR if is_dir else stat.S_IFREG) | mode), line
            assert (owner, group) == ("root", "root"), line
        declared_here = {p for p in expect if p and os.path.dirname(p) == display}
        assert names == {os.path.basename(p) for p in declared_here}, display


def test_inode_numbers_are_stable_and_distinct(d):
    paths = [""] + sorted({rel(p, g) for p in DECLARED for g in (0, 1)})
    first = {p: os.stat(d.path(p)).st_ino for p in paths}
    for p in paths:
        if p and stat.S_ISREG(os.stat(d.path(p)).st_mode) and p != "inst_ctl":
            d.read(p)
    assert {p: os.stat(d.path(p)).st_ino for p in paths} == first
    assert len(set(first.values())) == len(paths)
    # `stat` agrees with os.stat
    res = subprocess.run(["stat", "-c", "%i", d.path("0/policy")], capture_output=True, text=True)
    assert int(res.stdout) == first["0/policy"]
    # an instance destroyed and re-created comes back with the same numbers
    inst = [p for p in paths if NAME in p]
    d.destroy(NAME)
    for p in inst:
        assert not os.path.exists(d.path(p)), p
    d.create(0, NAME)
    d.create(1, NAME)
    assert {p: os.stat(d.path(p)).st_ino for p in inst} == {p: first[p] for p in inst}


# ---- writing every writable row ------------------------------------------------


def _writers(d: Daemon):
    """(how, function(path, value)) for each way a user writes a value."""

    def echo(path, v):
        res = bash_in(d, f"echo {shlex.quote(v)} > {path}")
        assert res.returncode == 0, res.stderr

    def printf(path, v):
        res = bash_in(d, f"printf %s {shlex.quote(v)} > {path}")
        assert res.returncode == 0, res.stderr

    def coreutils_printf(path, v):
        res = bash_in(d, f"/usr/bin/printf '%s\\n' {shlex.quote(v)} > {path}")
        assert res.returncode == 0, res.stderr

    def os_write(path, v):
        assert d.write(path, v) == len(v)

    return [("echo", echo), ("printf", printf), ("os.write", os_write), ("/usr/bin/printf", coreutils_printf)]


@pytest.mark.parametrize("display", sorted(SETTINGS))
def test_each_setting_is_written_by_echo_printf_and_os_write(d, display):
    valid, padded, _ = SETTINGS[display]
    path = rel(display, 1)
    other = rel(display, 0)
    before_other = d.read(other)
    for (how, write), value in zip(_writers(d), valid + [valid[1]]):
        write(path, value)
        assert d.value(path) == value, (how, value)
    write_padded = _writers(d)[2][1]
    write_padded(path, padded)
    assert d.value(path) == padded.strip()
    # the same file on the other GPU did not move (except a node-wide setting)
    if display.startswith("N/"):
        assert d.read(other) == before_other
    # the longest write the table allows is accepted, one byte more is not
    limit = FILES[display].max_bytes
    fits = (padded.strip().rjust(limit - 1, "0") + "\n").encode()
    assert len(fits) == limit
    d.write(path, fits)
    assert d.value(path) == str(int(fits))
    assert d.write_errno(path, b"0" + fits) == errno.EINVAL
    assert d.value(path) == str(int(fits))


@pytest.mark.parametrize("display", sorted(SETTINGS))
def test_bad_values_answer_einval_and_change_nothing(d, display):
    _, _, invalid = SETTINGS[display]
    path = rel(display, 0)
    before = d.snapshot()
    limit = FILES[display].max_bytes
    cases = invalid + ["\u00e9", "1\x00", "1" * (limit + 1), "0" * limit + "1", "1\n2"]
    for bad in cases:
        assert d.write_errno(path, bad.encode()) == errno.EINVAL, (path, bad)
        assert d.snapshot() == before, (path, bad)
    # through a shell: bash reports the errno of the failed write
    for bad in invalid[:3]:
        res = bash_in(d, f"printf %s {shlex.quote(bad)} > {path}")
        assert res.returncode != 0 and "Invalid argument" in res.stderr, (bad, res)
        res = bash_in(d, f"echo {shlex.quote(bad)} > {path}")
        assert res.returncode != 0 and "Invalid argument" in res.stderr, (bad, res)
    assert d.snapshot() == before


def test_memsize_past_the_device_is_refused(d):
    # Out of range (EINVAL) or breaking Σ memsize ≤ device memory (EBUSY): SPEC
    # §1 allows either reading; refused, and nothing changes, either way.
    before = d.snapshot()
    for v in (str(T4 + 1), str(2 * T4), "99999999999999"):
        assert d.write_errno(f"0/{NAME}/memsize", v) in (errno.EINVAL, errno.EBUSY), v
    assert d.snapshot() == before


def test_one_write_is_one_command_at_offset_zero(d):
    fd = os.open(d.path("0/policy"), os.O_WRONLY)
    try:
        # at an offset other than 0
        with pytest.raises(OSError) as err:
            os.pwrite(fd, b"3", 1)
        assert err.value.errno == errno.EINVAL
        assert d.value("0/policy") == "0"
        # a first write is applied; a second one on the same fd is at offset 1
        assert os.write(fd, b"2") == 1
        assert d.value("0/policy") == "2"
        with pytest.raises(OSError) as err:
            os.write(fd, b"3")
        assert err.value.errno == errno.EINVAL
        assert d.value("0/policy") == "2"
        # a value split over two writes: the first half applies alone, the rest is refused
    finally:
        os.close(fd)
    fd = os.open(d.path("0/max_inst"), os.O_WRONLY)
    try:
        os.write(fd, b"1")
        with pytest.raises(OSError) as err:
            os.write(fd, b"2\n")
        assert err.value.errno == errno.EINVAL
    finally:
        os.close(fd)
    assert d.value("0/max_inst") == "1"
    # pwrite at 0 on a fresh fd is fine
    fd = os.open(d.path("0/max_inst"), os.O_WRONLY)
    try:
        assert os.pwrite(fd, b"12", 0) == 2
    finally:
        os.close(fd)
    assert d.value("0/max_inst") == "12"


def test_truncation_by_echo_is_accepted_and_ignored(d):
    before = d.snapshot()
    for path in ["0/policy", "default_memsize", f"1/{NAME}/weight", "inst_ctl"]:
        os.truncate(d.path(path), 0)  # setattr(size=0)
        fd = os.open(d.path(path), os.O_WRONLY | os.O_TRUNC)  # open(O_TRUNC)
        os.ftruncate(fd, 0)
        os.close(fd)
        with pytest.raises(OSError) as err:
            os.truncate(d.path(path), 1)
        assert err.value.errno == errno.EINVAL
    assert d.snapshot() == before
    res = bash_in(d, "echo 3 > 0/policy && echo 3 >| 0/prio_ratio; echo rc=$?")
    assert res.stdout == "rc=1\n" and "Invalid argument" in res.stderr  # 3 is below prio_ratio's 20
    assert d.value("0/policy") == "3" and d.value("0/prio_ratio") == before["0/prio_ratio"][:-1]


def test_upgrade_refuses_anything_but_1(d):
    before = d.snapshot()
    for bad in ["0", "2", "x", "11", "1\n\n", " "]:
        assert d.write_errno("upgrade", bad) == errno.EINVAL, bad
    assert d.snapshot() == before


# ---- EACCES, EPERM -----------------------------------------------------------


def test_read_only_nodes_refuse_opening_for_writing_even_for_root(d):
    assert os.geteuid() == 0, "this suite runs as root (the daemon mounts with allow_other)"
    before = d.snapshot()
    for display in READ_ONLY:
        path = d.path(rel(display))
        for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
            with pytest.raises(OSError) as err:
                os.open(path, flags)
            assert err.value.errno == errno.EACCES, (display, flags)
        with pytest.raises(OSError) as err:
            os.truncate(path, 0)
        assert err.value.errno == errno.EACCES, display
        res = bash_in(d, f"echo 1 > {rel(display)}")
        assert res.returncode != 0 and "Permission denied" in res.stderr, res
    # directories cannot be opened for writing either
    with pytest.raises(OSError) as err:
        os.open(d.path("0"), os.O_WRONLY)
    assert err.value.errno == errno.EISDIR
    assert d.snapshot() == before


def test_creating_removing_renaming_linking_chmod_chown_answer_eperm(d):
    before = d.snapshot()
    inst = f"0/{NAME}"
    commands = [
        "mkdir newdir", "mkdir 0/newdir", f"mkdir {inst}/x", "mkdir 0/bcdef0123456",
        "touch newfile", "touch 0/newfile", f"touch {inst}/newfile",
        "rm version", "rm -f 0/policy", f"rm {inst}/weight", "rm inst_ctl",
        "rmdir 0", f"rmdir {inst}", "rm -rf 1",
        "mv 0/policy 0/p", "mv version 0/version", f"mv {inst} 0/bcdef0123456", "mv 1 2",
        "ln 0/policy hardlink", "ln -s version symlink", f"ln -s /tmp {inst}/l",
        "chmod 666 0/policy", "chmod 644 version", "chmod 777 0", "chmod u+s inst_ctl",
        "chown nobody 0/policy", "chgrp nogroup version", f"chown 65534:65534 {inst}",
        "mkfifo fifo", "mknod 0/node c 1 3",
    ]
    for cmd in commands:
        res = bash_in(d, cmd)
        assert res.returncode != 0 and "Operation not permitted" in res.stderr, (cmd, res.stderr)
    calls = [
        (os.mkdir, ("newdir",)), (os.mkdir, (inst + "/x",)),
        (lambda p: os.open(p, os.O_WRONLY | os.O_CREAT, 0o644), ("newfile",)),
        (lambda p: os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), ("0/newfile",)),
        (os.unlink, ("0/policy",)), (os.rmdir, (inst,)), (os.rmdir, ("1",)),
        (os.rename, ("0/policy", "0/p")), (os.rename, ("version", "default_memsize")),
        (os.link, ("version", "v2")), (os.symlink, ("version", "v3")),
        (os.chmod, ("0/policy", 0o600)), (os.chown, ("0/policy", 65534, -1)), (os.chown, ("0", -1, 65534)),
        (os.mkfifo, ("fifo",)),
    ]
    for fn, args in calls:
        with pytest.raises(OSError) as err:
            fn(*(d.path(a) if isinstance(a, str) else a for a in args))
        assert err.value.errno == errno.EPERM, (fn, args)
    assert d.snapshot() == before
    for display in FILES:  # modes unchanged
        st = os.stat(d.path(rel(display)))
        assert stat.S_IMODE(st.st_mode) == (0o644 if FILES[display].writable else 0o444)
        assert (st.st_uid, st.st_gid) == (0, 0)


# ---- EBUSY, ENOSPC, EEXIST -------------------------------------------------------


def test_ebusy_when_a_change_would_break_an_invariant(make_daemon):
    d = make_daemon(gpus="sim:2xT4")
    d.write("default_memsize", str(GIB))
    for n in ("aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc"):
        d.create(0, n)
    assert d.value("0/free_weight") == "13"
    before = d.snapshot()
    # max_inst below the instance count
    for v in ("1", "2"):
        assert d.write_errno("0/max_inst", v) == errno.EBUSY
    res = shell(f"echo 2 > {d.path('0/max_inst')}")
    assert res.returncode != 0 and "Device or resource busy" in res.stderr
    assert d.snapshot() == before
    # max_inst below the weight sum (7 = 5 + 1 + 1 with 3 instances)
    d.write("0/aaaaaaaaaaaa/weight", "5")
    assert d.value("0/free_weight") == "9"
    before = d.snapshot()
    for v in ("3", "6"):
        assert d.write_errno("0/max_inst", v) == errno.EBUSY
    assert d.snapshot() == before
    d.write("0/max_inst", "7")
    assert d.value("0/free_weight") == "0"
    # a weight over free_weight
    before = d.snapshot()
    assert d.write_errno("0/bbbbbbbbbbbb/weight", "2") == errno.EBUSY
    assert d.write_errno("0/aaaaaaaaaaaa/weight", "6") == errno.EBUSY
    assert d.snapshot() == before
    # a weight in 0..max_inst but over what is free (max_inst 16, sum 16 otherwise)
    d.write("1/max_inst", "16")
    d.create(1, "dddddddddddd")
    d.create(1, "eeeeeeeeeeee")
    d.write("1/dddddddddddd/weight", "15")
    assert d.write_errno("1/eeeeeeeeeeee/weight", "2") == errno.EBUSY
    assert d.value("1/eeeeeeeeeeee/weight") == "1" and d.value("1/free_weight") == "0"
    # lowering is always fine, and frees weight
    d.write("0/aaaaaaaaaaaa/weight", "0")
    assert d.value("0/free_weight") == "5"
    # memsizes on the tree may overcommit (SPEC §3); one memsize past the device may not (EINVAL)
    d.write("0/aaaaaaaaaaaa/memsize", str(T4 - GIB))
    assert d.value("0/aaaaaaaaaaaa/memsize") == str(T4 - GIB)
    before = d.snapshot()
    assert d.write_errno("0/aaaaaaaaaaaa/memsize", str(T4 + 1)) == errno.EINVAL
    assert d.snapshot() == before


def test_enospc_beyond_max_inst_and_memory(make_daemon):
    d = make_daemon(gpus="sim:2xT4")
    # memory overcommits on the tree, as on the real cgpu_km: default_memsize 0 gives each
    # instance the whole device, and a second one is made too (SPEC §3)
    d.create(0, "aaaaaaaaaaaa")
    res = shell(f"echo 0bbbbbbbbbbbb > {d.path('inst_ctl')}")
    assert res.returncode == 0, res.stderr
    assert d.instances(0) == ["aaaaaaaaaaaa", "bbbbbbbbbbbb"]
    assert d.value("0/aaaaaaaaaaaa/memsize") == d.value("0/bbbbbbbbbbbb/memsize") == str(T4)
    d.destroy("bbbbbbbbbbbb")
    # ... but a memsize past the device does not fit on it: ENOSPC
    d.write("default_memsize", str(T4 + 1))
    before = d.snapshot()
    assert d.write_errno("inst_ctl", "1bbbbbbbbbbbb") == errno.ENOSPC
    res = shell(f"echo 1bbbbbbbbbbbb > {d.path('inst_ctl')}")
    assert res.returncode != 0 and "No space left on device" in res.stderr
    assert d.snapshot() == before
    d.write("default_memsize", str(10 * GIB))
    d.create(1, "aaaaaaaaaaaa")
    # instances: max_inst of them and no more (13 GiB of 14.75 given: memory is not the limit)
    d.write("default_memsize", str(GIB))
    d.create(1, "bbbbbbbbbbbb")
    d.write("1/max_inst", "4")
    d.create(1, "cccccccccccc")
    d.create(1, "dddddddddddd")
    assert d.instances(1) == ["aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc", "dddddddddddd"]
    before = d.snapshot()
    assert d.write_errno("inst_ctl", "1eeeeeeeeeeee") == errno.ENOSPC
    assert d.snapshot() == before
    # ... while the other GPU has room
    d.write("0/max_inst", "1")
    assert d.write_errno("inst_ctl", "0eeeeeeeeeeee") == errno.ENOSPC
    d.write("0/max_inst", "2")
    d.create(0, "eeeeeeeeeeee")
    assert d.instances(0) == ["aaaaaaaaaaaa", "eeeeeeeeeeee"]


def test_eexist_for_a_name_already_on_that_gpu(d):
    before = d.snapshot()
    for cmd in (f"0{NAME}", f"0{NAME}\n", f"1{NAME}"):
        assert d.write_errno("inst_ctl", cmd) == errno.EEXIST, cmd
    res = shell(f"echo 0{NAME} > {d.path('inst_ctl')}")
    assert res.returncode != 0 and "File exists" in res.stderr
    assert d.snapshot() == before


# ---- inst_ctl --------------------------------------------------------------------


def test_inst_ctl_create_with_echo_n_then_destroy_everywhere(make_daemon):
    d = make_daemon(gpus="sim:2xT4")
    res = bash_in(d, "echo -n 0abcdef012345 > inst_ctl && ls 0/ && ls -ld 0/abcdef012345/")
    assert res.returncode == 0, res.stderr
    assert "abcdef012345" in res.stdout.split() and "0/abcdef012345/" in res.stdout
    assert res.stdout.splitlines()[-1].startswith("dr-xr-xr-x")
    assert "abcdef012345" not in os.listdir(d.path("1"))
    # 14 bytes with '\n' (plain echo), on the other GPU; printf without
    d.write("default_memsize", str(2 * GIB))
    res = bash_in(d, "echo 1abcdef012345 > inst_ctl && printf %s 1bcdef0123456 > inst_ctl")
    assert res.returncode == 0, res.stderr
    assert d.instances(0) == ["abcdef012345"] and d.instances(1) == ["abcdef012345", "bcdef0123456"]
    # a new instance: memsize = default_memsize (0 = the whole device), weight 1
    assert d.value("0/abcdef012345/memsize") == str(T4)
    assert d.value("1/abcdef012345/memsize") == str(2 * GIB)
    assert d.value("1/abcdef012345/weight") == "1" and d.value("1/free_weight") == "14"
    ids = [d.value(f"{g}/{n}/id") for g in (0, 1) for n in d.instances(g)]
    assert len(set(ids)) == 3
    # destroy: gone from every GPU, and the listing says so at once
    res = bash_in(
        d,
        "echo -abcdef012345 > inst_ctl && ls 0 1 && "
        "if test -d 0/abcdef012345 || test -d 1/abcdef012345 || test -e 1/abcdef012345/weight; "
        "then echo STALE; else echo gone; fi; cat 0/abcdef012345/id",
    )
    assert "abcdef012345" not in res.stdout.split() and res.stdout.splitlines()[-1] == "gone", res.stdout
    assert "No such file or directory" in res.stderr
    assert d.instances(0) == [] and d.instances(1) == ["bcdef0123456"]
    assert not os.path.isdir(d.path("0/abcdef012345"))
    with pytest.raises(FileNotFoundError):
        os.stat(d.path("1/abcdef012345/weight"))
    assert d.value("1/free_weight") == "15" and d.value("0/free_weight") == "16"
    # destroying again: no such instance
    assert d.write_errno("inst_ctl", "-abcdef012345") == errno.ENOENT


def test_inst_ctl_accepts_exactly_13_bytes_and_a_newline(d):
    d.destroy(NAME)
    d.write("default_memsize", str(GIB))
    before = d.snapshot()
    bad = [
        "0abcdef01234",  # 12 bytes
        "0abcdef0123456",  # 14, the 14th not '\n'
        f"0{NAME}\n\n",  # 15
        f"0{NAME} ",  # 14, a space
        f" 0{NAME}"[:14],
        "0abcdef01234!",  # a character outside [0-9A-Za-z_.-]
        "0abc def01234",
        "0abcdef01234/",
        "0abcdef\u00e912",
        "0abcdef01234\0",
        f"2{NAME}",  # no GPU 2
        f"9{NAME}",
        f"x{NAME}",  # neither a digit nor '-'
        f"+{NAME}",
        "-abcdef01234",
        "-abcdef01234!",
        "\n" * 13,
        "",
    ]
    for cmd in bad:
        if cmd:
            assert d.write_errno("inst_ctl", cmd.encode()) == errno.EINVAL, repr(cmd)
    assert d.snapshot() == before
    # every allowed character, a name starting with '-' included
    for name in ("A.b_C-9z.Y_0", "-leading.dsh", "............"):
        d.create(0, name)
        assert name in d.instances(0)
    d.destroy("-leading.dsh")
    assert "-leading.dsh" not in d.instances(0)


def test_a_new_instance_gets_weight_min_1_free_weight(make_daemon):
    d = make_daemon()
    d.write("default_memsize", str(GIB))
    d.write("0/max_inst", "2")
    d.create(0, "aaaaaaaaaaaa")
    d.write("0/aaaaaaaaaaaa/weight", "2")
    assert d.value("0/free_weight") == "0"
    d.create(0, "bbbbbbbbbbbb")  # free_weight 0: weight 0, as the seeds say
    assert d.value("0/bbbbbbbbbbbb/weight") == "0" and d.value("0/free_weight") == "0"


def test_files_of_a_destroyed_instance_are_gone_for_open_handles(d):
    rfd = os.open(d.path(f"0/{NAME}/weight"), os.O_RDONLY)
    wfd = os.open(d.path(f"0/{NAME}/weight"), os.O_WRONLY)
    try:
        d.destroy(NAME)
        with pytest.raises(OSError) as err:
            os.pread(rfd, 10, 0)
        assert err.value.errno == errno.ENOENT
        with pytest.raises(OSError) as err:
            os.write(wfd, b"3")
        assert err.value.errno == errno.ENOENT
    finally:
        os.close(rfd)
        os.close(wfd)
    assert d.instances(0) == [] == d.instances(1)


# ---- the plain user ------------------------------------------------------------

NOBODY_PROBE = r"""
import errno, json, os, sys
mount, paths = sys.argv[1], json.loads(sys.argv[2])
out = {}
for p in paths:
    try:
        fd = os.open(os.path.join(mount, p), os.O_WRONLY)
    except OSError as exc:
        out[p] = errno.errorcode[exc.errno]
    else:
        os.close(fd)
        out[p] = "opened"
for name, fn in [("mkdir", lambda: os.mkdir(os.path.join(mount, "0", "x"))),
                 ("create", lambda: os.open(os.path.join(mount, "new"), os.O_CREAT | os.O_WRONLY)),
                 ("unlink", lambda: os.unlink(os.path.join(mount, "0", "policy"))),
                 ("truncate", lambda: os.truncate(os.path.join(mount, "0", "policy"), 0))]:
    try:
        fn()
        out[name] = "done"
    except OSError as exc:
        out[name] = errno.errorcode[exc.errno]
print(json.dumps(out))
"""


def test_plain_user_reads_everything_and_writes_nothing(d):
    d.write("0/policy", "2")
    before = d.snapshot()
    readable = [p for p in before if not p.endswith("/") and p != "inst_ctl"]
    res = as_nobody(["cat", *readable], cwd=d.path())
    assert res.returncode == 0, res.stderr
    assert res.stdout == "".join(before[p] for p in readable)
    res = as_nobody("ls -lR . >/dev/null && stat -c %a 0/policy", cwd=d.path())
    assert res.returncode == 0 and res.stdout == "644\n", res.stderr
    res = as_nobody("cat inst_ctl", cwd=d.path())
    assert res.returncode != 0 and "Bad file descriptor" in res.stderr
    files = [p for p in before if not p.endswith("/")]
    # every write, through the shell: Permission denied
    for p in files:
        value = "1" if p != "inst_ctl" else "0bbbbbbbbbbbb"
        for cmd in (f"echo {value} > {p}", f"printf %s {value} > {p}", f"echo {value} >> {p}"):
            res = as_nobody(cmd, cwd=d.path())
            assert res.returncode != 0 and "Permission denied" in res.stderr, (cmd, res)
    res = as_nobody(f"echo -{NAME} > inst_ctl", cwd=d.path())
    assert res.returncode != 0 and "Permission denied" in res.stderr
    # and through os calls
    res = as_nobody([nobody_python(), "-c", NOBODY_PROBE, d.path(), json.dumps(files)])
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got == {**{p: "EACCES" for p in files}, "mkdir": "EACCES", "create": "EACCES",
                   "unlink": "EACCES", "truncate": "EACCES"}
    assert d.snapshot() == before


# ---- the daemon: start, stop, restart ------------------------------------------------


def run(cmd: list[str], timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def assert_one_line_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    assert res.returncode != 0, res
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize("spec", ["sim:bogus", "sim:0xT4", "sim:11xT4", "sim:T4:x", "nvml", "cuda:0", "file:/nonexistent.toml"])
def test_bad_gpus_spec_is_one_clear_line(make_daemon, spec):
    d = make_daemon(start=False)
    res = run(d.command(gpus=spec))
    assert_one_line_error(res)
    assert not mounted(d.mount)


@pytest.mark.parametrize("content", [b"{not json", b"", b'{"format": 99, "state": {}}', b"\xff\xfe",
                                     b'{"format": 1, "state": {"gpus": []}}'])
def test_corrupt_state_file_stops_the_start_naming_the_file(make_daemon, content):
    d = make_daemon(start=False)
    d.state_dir.mkdir(mode=0o700)
    state = d.state_dir / "state.json"
    state.write_bytes(content)
    res = run(d.command())
    assert_one_line_error(res, str(state))
    assert state.read_bytes() == content  # never a silent reset
    assert not mounted(d.mount)


def test_state_for_other_gpus_stops_the_start(make_daemon):
    d = make_daemon(gpus="sim:2xT4")
    d.create(1, NAME)
    d.stop()
    state = (d.state_dir / "state.json").read_bytes()
    res = run(d.command(gpus="sim:T4"))
    assert_one_line_error(res, str(d.state_dir / "state.json"))
    assert (d.state_dir / "state.json").read_bytes() == state
    d.start()
    assert d.instances(1) == [NAME]


def test_mountpoint_served_by_a_live_daemon_is_refused(make_daemon):
    first = make_daemon()
    first.write("0/policy", "3")
    second = make_daemon(start=False, mount=first.mount)
    res = run(second.command())
    assert_one_line_error(res, first.path())
    assert first.alive() and mounted(first.mount)
    assert first.value("0/policy") == "3"
    # and through the fixture: the second start fails loudly (it does not take
    # the first one's mount for its own), the first still serves
    with pytest.raises(pytest.fail.Exception, match="already served"):
        second.start()
    assert not second.alive()
    assert first.value("0/policy") == "3"


def test_dead_mount_of_a_killed_daemon_is_cleared_at_the_next_start(make_daemon):
    d = make_daemon()
    d.write("0/policy", "4")
    d.kill9()
    assert mounted(d.mount)
    with pytest.raises(OSError) as err:
        os.listdir(d.path())
    assert err.value.errno == errno.ENOTCONN
    d.start()
    assert d.value("0/policy") == "4"
    with open("/proc/self/mountinfo") as f:
        assert sum(1 for line in f if line.split()[4] == d.path()) == 1  # not stacked on the dead one
    assert "Traceback" not in d.log_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_unmount_cleanly(make_daemon, sig):
    d = make_daemon()
    fd = os.open(d.path("0/policy"), os.O_RDONLY)  # an open file does not hold the daemon up
    try:
        assert d.signal_stop(sig) == 0
    finally:
        os.close(fd)
    assert not mounted(d.mount) and os.listdir(d.path()) == []
    assert "Traceback" not in d.log_text()
    d.start()  # and it starts again on the same mount point
    assert d.value("0/policy") == "0"


def gpu_uuids(d: Daemon) -> list[str]:
    from cgpud.client import Client

    with Client(str(d.socket)) as c:
        return [g["uuid"] for g in c.call("query")["gpus"]]


def test_a_restart_shows_the_identical_tree(make_daemon):
    d = make_daemon(gpus="sim:2xT4")
    d.write("default_memsize", str(3 * GIB))
    for g, n in [(0, "aaaaaaaaaaaa"), (1, "aaaaaaaaaaaa"), (0, "bbbbbbbbbbbb"), (1, "cccccccccccc"), (0, "dddddddddddd")]:
        d.create(g, n)
    d.destroy("bbbbbbbbbbbb")  # leaves a hole in the ids
    d.write("0/policy", "2")
    d.write("1/policy", "5")
    d.write("1/max_inst", "9")
    d.write("0/prio_ratio", "55")
    d.write("0/aaaaaaaaaaaa/weight", "6")
    d.write("1/cccccccccccc/memsize", str(GIB + 1))
    d.write("0/dddddddddddd/highprio", "1")
    d.write("default_memsize", "12345")
    before = d.snapshot()
    assert len([p for p in before if p.endswith("/")]) == 6
    uuids = gpu_uuids(d)  # not in the tree; the control socket shows them
    assert len(set(uuids)) == 2 and all(u.startswith("GPU-") for u in uuids)
    d.restart()
    assert d.snapshot() == before and gpu_uuids(d) == uuids
    d.kill9()
    d.start()
    assert d.snapshot() == before and gpu_uuids(d) == uuids
    # ids keep their numbers: a new instance takes a free one, not a reused one
    d.create(1, "eeeeeeeeeeee")
    taken = [before[f"{g}/{n}/id"] for g, n in
             [(0, "aaaaaaaaaaaa"), (1, "aaaaaaaaaaaa"), (1, "cccccccccccc"), (0, "dddddddddddd")]]
    assert d.read("1/eeeeeeeeeeee/id") not in taken


def test_a_missing_dev_fuse_is_one_clear_line(make_daemon):
    """The daemon in a mount namespace of its own whose /dev is an empty tmpfs."""
    d = make_daemon(start=False)
    cmd = " ".join(f"'{c}'" for c in d.command())
    r = subprocess.run(["unshare", "-m", "bash", "-c", f"mount -t tmpfs tmpfs /dev && exec {cmd}"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1, r
    assert r.stderr.strip() == ("Error: /dev/fuse is missing: load the fuse module (modprobe fuse), "
                                "or give the container the device (--device /dev/fuse)")
    assert not mounted(d.mount)
