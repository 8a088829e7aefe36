"""make gpu-check (issue 23, part 4): what can be checked without a GPU. Here it says in one line
that there is none and exits 77; with a stand-in node (what `cgpu run` would have answered), its
checks give the table and the exit status from what the instances report."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check  # (its dataclass looks itself up there)
spec.loader.exec_module(gpu_check)
MEMSIZE, MIB = gpu_check.MEMSIZE, 1 << 20


def test_without_a_gpu_it_says_so_in_one_line_and_exits_77():
    r = subprocess.run([sys.executable, ROOT / "scripts" / "gpu_check.py"], capture_output=True, text=True, timeout=60)
    assert r.returncode == gpu_check.NO_GPU == 77, r
    assert r.stdout.splitlines() == [r.stdout.strip()] and r.stdout.startswith("gpu-check: no NVIDIA GPU"), r.stdout
    assert r.stderr == ""
    mk = subprocess.run(["make", "-s", "-n", "-C", ROOT, "gpu-check"], capture_output=True, text=True)
    assert mk.stdout.strip().splitlines()[-1] == ".venv/bin/python scripts/gpu_check.py", mk.stdout


def test_no_gpu_reason_names_what_is_missing(tmp_path):
    assert "is missing" in gpu_check.no_gpu_reason(tmp_path / "version")


class FakeNode:
    """What `cgpu run` would bring back from each instance (its JSON line and exit status)."""

    def __init__(self, answers: dict) -> None:
        self.answers = answers
        self.ran: list[str] = []

    def run(self, name: str, argv: list[str], timeout: float = 300, **kw) -> dict:
        self.ran.append(name)
        return dict(self.answers[name])

    def write(self, rel: str, value: str) -> None:
        pass

    def stats(self) -> dict:
        return {"drains": 0}

    def start(self, name: str, argv: list[str], **kw):
        raise AssertionError(f"{name}: only run() in this test")


def rows_of(answers: dict) -> dict:
    node = FakeNode(answers)
    # (the timed checks, graphs and shares, start instances beside: left out here, run end to end below)
    rows = gpu_check.run_checks([c for c in gpu_check.checks(node) if not c[0].startswith(("graph", "share"))])
    return {r.check: r for r in rows}, rows


def test_the_checks_judge_what_the_instances_report():
    """cuda-bindings and CuPy are installed here (their checks ran against the fake node);
    PyTorch, JAX and nvidia-smi are not (SKIP, with the reason)."""
    good = {"gpucheckmem1": {"total": [MEMSIZE, MEMSIZE], "free": MEMSIZE - 300 * MIB, "rc": 0},
            "gpucheckoom1": {"got": MEMSIZE - 64 * MIB, "error": "CUDA_ERROR_OUT_OF_MEMORY", "rc": 0}}
    by, rows = rows_of(good)
    assert by["memsize shown (cuda-bindings)"].result == "PASS"
    assert by["oom at memsize (cupy)"].result == "PASS"
    assert by["oom at memsize (jax)"].result == "SKIP" and "not installed" in by["oom at memsize (jax)"].detail
    assert by["nvidia-smi's view"].result == "SKIP"
    assert gpu_check.exit_code(rows) == 0
    # the card shown whole, and an allocation that was killed rather than refused: failures
    bad = {"gpucheckmem1": {"total": [16 << 30], "free": 15 << 30, "rc": 0},
           "gpucheckoom1": {"got": MEMSIZE, "rc": -9, "error": "Killed"}}
    by, rows = rows_of(bad)
    assert by["memsize shown (cuda-bindings)"].result == "FAIL" and "16384" in by["memsize shown (cuda-bindings)"].detail
    assert by["oom at memsize (cuda-bindings)"].result == "FAIL" and "exit -9" in by["oom at memsize (cuda-bindings)"].detail
    assert gpu_check.exit_code(rows) == 1


def test_a_check_that_raises_fails_and_the_table_has_one_line_each():
    def boom():
        raise ValueError("no such device\nmore")
    rows = gpu_check.run_checks([("a", lambda: ("PASS", "fine")), ("b", boom), ("c", lambda: ("SKIP", "nothing"))])
    assert [(r.check, r.result) for r in rows] == [("a", "PASS"), ("b", "FAIL"), ("c", "SKIP")]
    assert rows[1].detail == "ValueError: no such device"
    lines = gpu_check.table(rows).splitlines()
    assert len(lines) == 2 + 3
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["check", "result", "detail"]
    assert [c.strip() for c in lines[3].strip("|").split("|")] == ["b", "FAIL", "ValueError: no such device"]
    assert len({len(line) for line in lines}) == 1  # (aligned)
    assert gpu_check.exit_code(rows) == 1 and gpu_check.exit_code(rows[::2]) == 0


def test_the_checks_run_end_to_end_against_the_stand_in_driver(tmp_path):
    """The script itself on this machine, its daemon on a simulated GPU (`--gpus sim:T4`) and the
    instances on the stand-in driver: what cuda-bindings and CuPy can check here passes (the
    stand-in keeps no contents: graph replays are not compared), what is not installed is SKIP."""
    from real_cuda import UUID
    from test_libcgpu import build_libs
    stubs = build_libs(tmp_path / "stubs")
    env = dict(os.environ, LD_LIBRARY_PATH=os.fspath(stubs), CGPU_STUB_CUDA_UUIDS=UUID,
               CGPU_STUB_CUDA_STATE=os.fspath(tmp_path / "card"), CUPY_CACHE_DIR=os.fspath(tmp_path / "cupy"))
    r = subprocess.run([sys.executable, ROOT / "scripts" / "gpu_check.py", "--gpus", "sim:T4", "--quick"], env=env,
                       capture_output=True, text=True, timeout=300)
    rows = {cells[0]: cells[1:] for line in r.stdout.splitlines()[2:]
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    for client in ("cuda-bindings", "cupy"):
        assert rows[f"memsize shown ({client})"][0] == "PASS", rows
        assert rows[f"oom at memsize ({client})"][0] == "PASS", rows
    result, detail = rows["graph capture while the gate closes (cupy)"]
    assert result == "PASS" and " 0 invalidated" in detail, detail
    result, detail = rows["share 1:2 under policy 2 (cupy)"]
    share = float(detail.split()[3])
    assert 0.25 <= share <= 0.42, detail  # (the script's own band is 5 pp; this machine is shared)
    assert {rows[k][0] for k in rows if "torch" in k or "jax" in k or "nvidia-smi" in k} == {"SKIP"}, rows
    assert r.returncode == (0 if result == "PASS" else 1), r.stdout + r.stderr
