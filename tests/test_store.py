"""The durable state file (SPEC §7 State; issue 2 item 7)."""
from __future__ import annotations

import json
import os
import stat

import pytest

from cgpud.core.model import GpuInfo, Node
from cgpud.state.store import FILENAME, FORMAT, CorruptState, Store


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "state"))
    yield s
    s.close()


def a_state() -> dict:
    n = Node([GpuInfo(0, "GPU-a", "A", 1000), GpuInfo(1, "GPU-b", "B", 2000)])
    n.set_default_memsize(100)
    n.set_policy(1, 2)
    n.set_max_inst(0, 4)
    n.create_instance(0, "abcdef012345", weight=3, highprio=True)
    n.create_instance(1, "abcdef012345", memsize=2000)
    return n.to_state()


def test_nothing_saved_yet_is_none(store):
    assert store.load() is None
    assert not os.path.exists(store.directory), "load creates nothing"


def test_save_then_load_round_trips(store):
    state = a_state()
    store.save(state)
    assert store.load() == state
    # a second store on the same directory (a restart) reads the same
    again = Store(store.directory)
    assert again.load() == state


def test_save_replaces_the_previous_state(store):
    store.save({"x": 1})
    store.save(a_state())
    assert store.load() == a_state()


def test_the_file_is_private_and_versioned(store):
    store.save(a_state())
    assert os.listdir(store.directory) == [FILENAME]
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(store.directory).st_mode) == 0o700
    with open(store.path) as f:
        doc = json.load(f)
    assert doc == {"format": FORMAT, "state": a_state()}


def test_no_tmp_file_is_left_behind(store):
    for i in range(5):
        store.save({"n": i})
        assert sorted(os.listdir(store.directory)) == [FILENAME]


def test_a_stale_tmp_from_a_crash_is_ignored_and_replaced(store):
    store.save({"n": 1})
    with open(store.path + ".tmp", "w") as f:
        f.write("half a stat")  # a crash between write and rename
    assert store.load() == {"n": 1}
    store.save({"n": 2})
    assert sorted(os.listdir(store.directory)) == [FILENAME]
    assert store.load() == {"n": 2}


def corrupt(store: Store, data: bytes) -> None:
    os.makedirs(store.directory, exist_ok=True)
    with open(store.path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize(
    "data,why",
    [
        (b"", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b'{"format": 1, "state": {"a": 1}', "not valid JSON"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
        (b"[]", "not a cgpud state of format 1"),
        (b"null", "not a cgpud state of format 1"),
        (b'{"state": {}}', "not a cgpud state of format 1"),
        (b'{"format": 2, "state": {}}', "not a cgpud state of format 1"),
        (b'{"format": "1", "state": {}}', "not a cgpud state of format 1"),
        (b'{"format": 1}', "not a cgpud state of format 1"),
        (b'{"format": 1, "state": []}', "not a cgpud state of format 1"),
    ],
)
def test_a_corrupt_file_stops_with_a_message_naming_it(store, data, why):
    corrupt(store, data)
    with pytest.raises(CorruptState) as info:
        store.load()
    msg = str(info.value)
    assert info.value.path == store.path
    assert store.path in msg
    assert why in msg
    assert "move it away" in msg, "says what to do"
    assert "Nothing was changed" in msg
    with open(store.path, "rb") as f:
        assert f.read() == data, "the bad file is left as it was, never reset"


def test_an_unreadable_file_is_corrupt_not_missing(store):
    # as root no mode bits stop a read; a directory in the file's place does
    os.makedirs(store.path)
    with pytest.raises(CorruptState) as info:
        store.load()
    assert store.path in str(info.value) and "Is a directory" in str(info.value)
    assert os.path.isdir(store.path)


def test_an_unreadable_directory_is_corrupt_not_missing(tmp_path):
    # the state "directory" is a file: the state cannot be reached
    (tmp_path / "notadir").write_text("x")
    s = Store(str(tmp_path / "notadir"))
    with pytest.raises(CorruptState) as info:
        s.load()
    assert s.path in str(info.value)


def test_a_save_that_cannot_write_leaves_the_old_state_and_no_tmp(store):
    store.save({"n": 1})
    os.makedirs(store.path + ".tmp")  # the temporary file cannot be created
    with pytest.raises(OSError):
        store.save({"n": 2})
    os.rmdir(store.path + ".tmp")
    assert store.load() == {"n": 1}
    assert sorted(os.listdir(store.directory)) == [FILENAME]


def test_save_opens_the_directory_itself(tmp_path):
    s = Store(str(tmp_path / "a" / "b"))
    try:
        s.save({"k": "v"})
        assert s.load() == {"k": "v"}
    finally:
        s.close()
    s.close()  # twice is harmless
