"""Where the tree may be mounted (fusefs/mount.py's prepare_mountpoint): the DaemonSet mounts its
hostPath volume at /run/cgpu_km, so the daemon finds a mount there; an empty one is mounted over
(issue 24's test 4 found the daemon refusing it), one with files in it is refused."""
from __future__ import annotations

import subprocess

import pytest

from fusefs.mount import MountError, prepare_mountpoint


@pytest.fixture
def volume(tmp_path):
    src, where = tmp_path / "hostpath", tmp_path / "cgpu_km"
    src.mkdir()
    where.mkdir()
    subprocess.run(["mount", "--bind", src, where], check=True)  # what the container runtime does for a volume
    yield src, where
    subprocess.run(["umount", "-l", where], check=True)


def test_an_empty_volume_mounted_there_is_mounted_over(volume):
    _, where = volume
    prepare_mountpoint(str(where), "cgpu_km")


def test_a_mount_with_files_in_it_is_refused(volume):
    src, where = volume
    (src / "data").write_text("x")
    with pytest.raises(MountError, match=r"is already a mount point \(.*\) with files in it: choose another --mount"):
        prepare_mountpoint(str(where), "cgpu_km")
