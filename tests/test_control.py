"""The control socket against a real daemon: protocol, errors, credentials."""
from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from cgpud.client import Client, ControlError, DaemonUnavailable
from conftest import SIM_T4_BYTES, nobody_python, as_nobody

NAME = "abcdef012345"


def raw(path, payload: bytes) -> list[dict]:
    """Send raw bytes, read every response line until the daemon closes or stops answering."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(path))
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def test_hello_and_query_match_the_tree(daemon):
    with Client(str(daemon.socket)) as c:
        hello = c.call("hello")
        assert hello["gpus"] == 1 and hello["privileged"] is True
        assert hello["version"] == daemon.value("version")
        assert len(hello["devices"]) == 1 and os.path.exists(hello["devices"][0])
        daemon.write("0/policy", "3")
        q = c.call("query")
    g = q["gpus"][0]
    assert g["name"] == "Tesla T4" and g["memory"] == SIM_T4_BYTES
    assert g["policy"] == 3 and g["max_inst"] == int(daemon.value("0/max_inst"))
    assert g["uuid"].startswith("GPU-")


def test_register_shows_in_the_tree_and_deregister_removes_it(daemon):
    with Client(str(daemon.socket)) as c:
        res = c.call("register", name=NAME, gpus=[0], memsize=6 << 30, weight=3, highprio=True)
        assert res["instances"] == [{"gpu": 0, "id": 1, "memsize": 6 << 30, "weight": 3}]
        assert daemon.value(f"0/{NAME}/memsize") == str(6 << 30)
        assert daemon.value(f"0/{NAME}/weight") == "3"
        assert daemon.value(f"0/{NAME}/highprio") == "1"
        assert daemon.value("0/free_weight") == str(16 - 3)
        c.call("deregister", name=NAME)
    assert not os.path.exists(daemon.path(f"0/{NAME}"))
    assert NAME not in os.listdir(daemon.path("0"))


@pytest.mark.parametrize("daemon", ["sim:2xT4"], indirect=True)
def test_register_on_several_gpus_is_all_or_nothing(daemon):
    daemon.write("default_memsize", str(4 << 30))
    with Client(str(daemon.socket)) as c:  # a promise of all but 1 GiB of GPU 1
        c.call("register", name="occupied0001", gpus=[1], memsize=SIM_T4_BYTES - (1 << 30))
    before = daemon.snapshot()
    with Client(str(daemon.socket)) as c:
        with pytest.raises(ControlError) as err:
            c.call("register", name=NAME, gpus=[0, 1], memsize=2 << 30)
        assert err.value.error == "ENOSPC"
        assert daemon.snapshot() == before  # GPU 0 did not keep a half registration
        res = c.call("register", name=NAME, gpus=[0, 1], memsize=[2 << 30, 1 << 30])
    assert [i["gpu"] for i in res["instances"]] == [0, 1]
    assert daemon.value(f"1/{NAME}/memsize") == str(1 << 30)


@pytest.mark.parametrize(
    "request_, error",
    [
        ({"op": "register", "name": "short", "gpus": [0]}, "EINVAL"),
        ({"op": "register", "name": NAME, "gpus": [7]}, "EINVAL"),
        ({"op": "register", "name": NAME, "gpus": []}, "EINVAL"),
        ({"op": "register", "name": NAME, "gpus": [0, 0]}, "EINVAL"),
        ({"op": "register", "name": NAME, "gpus": [0], "weight": "2"}, "EINVAL"),
        ({"op": "register", "name": NAME, "gpus": [0], "weight": 99}, "EINVAL"),
        ({"op": "register", "name": NAME, "gpus": [0], "memsize": 1 << 40}, "ENOSPC"),
        ({"op": "register", "name": NAME, "gpus": [0], "memsize": 1 << 50}, "EINVAL"),
        ({"op": "register", "gpus": [0]}, "EINVAL"),
        ({"op": "deregister", "name": NAME}, "ENOENT"),
        ({"op": "nonsense"}, "EINVAL"),
        ({"no": "op"}, "EINVAL"),
        ([1, 2, 3], "EINVAL"),
    ],
)
def test_bad_requests_get_an_errno_and_change_nothing(daemon, request_, error):
    before = daemon.snapshot()
    [resp] = raw(daemon.socket, json.dumps(request_).encode() + b"\n")
    assert resp["ok"] is False and resp["error"] == error, resp
    assert resp["message"] and "\n" not in resp["message"]
    assert daemon.snapshot() == before


def test_not_json_and_overlong_lines(daemon):
    resps = raw(daemon.socket, b"{not json\n" + json.dumps({"op": "hello"}).encode() + b"\n")
    assert resps[0]["error"] == "EINVAL" and resps[1]["ok"] is True  # the connection goes on
    [resp] = raw(daemon.socket, b"x" * (70 * 1024))
    assert resp["error"] == "EINVAL" and "too long" in resp["message"]
    with Client(str(daemon.socket)) as c:  # the daemon is still there
        assert c.call("hello")["gpus"] == 1


def test_plain_user_may_query_but_not_change(daemon):
    os.chmod(daemon.base, 0o755)
    script = (
        "import json, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile('rwb')\n"
        "for req in ({'op': 'query'}, {'op': 'register', 'name': 'abcdef012345', 'gpus': [0]}):\n"
        "    f.write(json.dumps(req).encode() + b'\\n'); f.flush(); print(f.readline().decode().strip())\n"
    )
    r = as_nobody([nobody_python(), "-c", script, str(daemon.socket)])
    assert r.returncode == 0, r.stderr
    query, register = (json.loads(line) for line in r.stdout.splitlines())
    assert query["ok"] is True and query["result"]["gpus"][0]["name"] == "Tesla T4"
    assert register == {"ok": False, "error": "EACCES", "message": register["message"]}
    assert os.listdir(daemon.path("0")) == [n for n in os.listdir(daemon.path("0")) if n != NAME]


def test_a_second_daemon_does_not_steal_a_live_socket(daemon, make_daemon):
    other = make_daemon(start=False)
    other.extra_args += ["--socket", str(daemon.socket)]
    r = subprocess.run(other.command(), capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert "another daemon answers" in r.stderr and "Traceback" not in r.stderr
    with Client(str(daemon.socket)) as c:
        assert c.call("hello")["gpus"] == 1


def test_client_says_clearly_when_no_daemon_runs(tmp_path):
    with pytest.raises(DaemonUnavailable, match="cgpud is not running"):
        Client(str(tmp_path / "nothing.sock"))
