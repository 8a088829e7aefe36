"""On Kubernetes the allocation is what the kubelet allotted, never the pod's spec (issue 44, SPEC §2
"who sets them"; cgpud/containers/allotted.py, docs/security.md "The pod's spec").

- pure: a plain host's environment is the contract; a Kubernetes container's contract variables come
  from the device plugin's annotation, and one its pod (or image) set otherwise fails the start with
  one line; its NVIDIA_VISIBLE_DEVICES is narrowed to the allotted GPUs;
- the hook's reading (hookd.hook_env), the containerd settings that pass the annotation and nothing
  a pod writes;
- cgpu-runtime in front of a recording stand-in runtime, with the daemon: a forged Kubernetes spec
  fails the create and the real runtime never runs; the GPUs a CUDA image names are narrowed in the
  config.json the real runtime (nvidia-container-runtime on a node) reads; the allotted container
  gets its hooks.
"""
from __future__ import annotations

import json
import os

import pytest

from cgpud.containers import allotted, hookd, hostconfig
from test_runtime import calls, fake_runtime, run_wrapper  # noqa: F401  (fake_runtime is a fixture)

T4 = "GPU-00000000-0000-0000-0000-000000000000"
ALLOC = {"NVIDIA_VISIBLE_DEVICES": T4, "ALIYUN_COM_GPU_MEM_IDX": "0", "ALIYUN_COM_GPU_MEM_CONTAINER": "1",
         "ALIYUN_COM_GPU_MEM_DEV": "14", "ALIYUN_COM_GPU_MEM_POD": "1"}
CRI = {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-id": "f" * 64,
       "io.kubernetes.cri.sandbox-namespace": "tenant", "io.kubernetes.cri.sandbox-name": "p"}


def spec(env: list[str], annotations: dict | None = None) -> dict:
    return {"ociVersion": "1.0.2", "process": {"args": ["sh"], "env": ["PATH=/bin", *env]},
            "annotations": annotations or {}}


def k8s(pod_env: list[str], alloc: dict | None = ALLOC, image_env: tuple[str, ...] = ()) -> dict:
    """A container's spec as containerd's CRI makes it: the image's ENV, then the kubelet's (the
    device plugin's environment, then the pod's own), the CRI annotations and the allocation's."""
    ann = {**CRI, **(allotted.annotations("aliyun.com/gpu-mem", alloc) if alloc is not None else {})}
    return spec([*image_env, *(f"{k}={v}" for k, v in (alloc or {}).items()), *pod_env], ann)


def read(config: dict) -> tuple[dict, str | None]:
    return allotted.contract_env(hookd.env_of(config), config)


# ---- pure -------------------------------------------------------------------------------------


def test_a_plain_hosts_environment_is_the_contract():
    env = ["ALIYUN_COM_GPU_MEM_CONTAINER=12", "CGPU_DISABLE=false", "ALIYUN_COM_GPU_SCHD_WEIGHT=16",
           "NVIDIA_VISIBLE_DEVICES=all"]
    got, nvidia = read(spec(env))
    assert nvidia is None and got["ALIYUN_COM_GPU_MEM_CONTAINER"] == "12" and got["NVIDIA_VISIBLE_DEVICES"] == "all"
    # a sandbox (pause) container is not a tenant's container either
    got, nvidia = read(spec(env, {"io.kubernetes.cri.container-type": "sandbox"}))
    assert nvidia is None and got["ALIYUN_COM_GPU_SCHD_WEIGHT"] == "16"


def test_the_allotted_container_reads_the_allocation_and_a_cuda_images_all_is_overridden():
    got, nvidia = read(k8s([], image_env=("NVIDIA_VISIBLE_DEVICES=all",)))
    assert nvidia is None and {k: got[k] for k in ALLOC} == ALLOC and got["PATH"] == "/bin"
    got, nvidia = read(k8s(["ALIYUN_COM_GPU_MEM_CONTAINER=1"]))  # the same value again: harmless, read
    assert nvidia is None and got["ALIYUN_COM_GPU_MEM_CONTAINER"] == "1"


@pytest.mark.parametrize("pod_env, line", [
    (["ALIYUN_COM_GPU_MEM_CONTAINER=12"], "ALIYUN_COM_GPU_MEM_CONTAINER=12 is set by the pod's spec or image, and on "
                                          "Kubernetes the allocation is what the kubelet allotted (the device plugin "
                                          "allotted ALIYUN_COM_GPU_MEM_CONTAINER=1): remove it from the pod"),
    (["CGPU_DISABLE=true"], "CGPU_DISABLE=true is set by the pod's spec or image"),
    (["ALIYUN_COM_GPU_HIGH_PRIO=1"], "(the device plugin did not set it)"),
    (["ALIYUN_COM_GPU_SCHD_WEIGHT=16"], "ALIYUN_COM_GPU_SCHD_WEIGHT=16 is set by the pod's spec"),
    (["ALIYUN_COM_GPU_MEM_DEV=1"], "ALIYUN_COM_GPU_MEM_DEV=1 is set by the pod's spec"),
    (["ALIYUN_COM_GPU_VISIBLE_DEVICES=0,1"], "ALIYUN_COM_GPU_VISIBLE_DEVICES=0,1 is set"),
    (["CGPU_DRA_CLAIM=x/y", "ALIYUN_COM_GPU_MEM_CONTAINER=12"], "ALIYUN_COM_GPU_MEM_CONTAINER=12 is set"),
])
def test_a_contract_variable_the_pod_set_fails_the_start_with_one_line(pod_env, line):
    with pytest.raises(allotted.AllotError) as exc:
        read(k8s(pod_env))
    assert line in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(hookd.HookError, match="is set by the pod's spec or image"):
        hookd.hook_env(k8s(pod_env))


def test_a_pod_with_no_allocation_asks_nothing_and_its_gpus_are_none():
    with pytest.raises(allotted.AllotError, match="ALIYUN_COM_GPU_MEM_CONTAINER=12 .* did not set it"):
        read(k8s(["ALIYUN_COM_GPU_MEM_CONTAINER=12", "NVIDIA_VISIBLE_DEVICES=all"], alloc=None))
    got, nvidia = read(k8s(["NVIDIA_VISIBLE_DEVICES=all"], alloc=None))
    assert nvidia == "void" and "NVIDIA_VISIBLE_DEVICES" not in got
    with pytest.raises(hookd.HookError, match="the container sees the GPUs the kubelet allotted \\(void\\)"):
        hookd.hook_env(k8s(["NVIDIA_VISIBLE_DEVICES=all"], alloc=None))
    for none in ("void", "none", ""):
        assert read(k8s([f"NVIDIA_VISIBLE_DEVICES={none}"], alloc=None))[1] is None


def test_the_pods_nvidia_visible_devices_is_narrowed_to_the_allotted_gpus():
    config = k8s(["NVIDIA_VISIBLE_DEVICES=all"], image_env=("NVIDIA_VISIBLE_DEVICES=all",))
    got, nvidia = read(config)
    assert nvidia == T4 and got["NVIDIA_VISIBLE_DEVICES"] == T4
    fixed = allotted.with_nvidia(config, nvidia)
    assert [e for e in fixed["process"]["env"] if e.startswith("NVIDIA_")] == [f"NVIDIA_VISIBLE_DEVICES={T4}"]
    assert read(fixed)[1] is None and config["process"]["env"][-1] == "NVIDIA_VISIBLE_DEVICES=all", "input kept"


def test_a_privileged_containers_nvidia_visible_devices_is_believed_as_nvidias_toolkit_does():
    """cgpud's own DaemonSet pods (privileged, NVIDIA_VISIBLE_DEVICES=all for NVML) keep their GPUs;
    a tenant's pod may not be privileged (Pod Security baseline)."""
    config = k8s(["NVIDIA_VISIBLE_DEVICES=all"], alloc=None)
    config["process"]["capabilities"] = {"bounding": ["CAP_CHOWN", "CAP_SYS_ADMIN"]}
    assert read(config) == ({"PATH": "/bin"}, None)
    config["process"]["capabilities"] = {"bounding": ["CAP_CHOWN", "CAP_NET_RAW"]}
    assert read(config)[1] == "void"
    config["process"]["env"].append("CGPU_DISABLE=true")  # (the contract's variables: privileged or not)
    with pytest.raises(allotted.AllotError, match="CGPU_DISABLE=true is set by the pod's spec"):
        read(config)


def test_a_claims_container_is_read_from_its_cdi_environment_only_with_the_claims_bind():
    """DRA: a claim's CDI device sets every contract variable and CGPU_DRA_CLAIM, and binds the
    daemon's tenant directory into each container of the claim; a pod with no claim that sets the
    variables and CGPU_DRA_CLAIM itself has no such bind (it would need a hostPath volume)."""
    tenant = "/run/cgpud/tenant"
    env = ["CGPU_DRA_CLAIM=u1/gpu", "ALIYUN_COM_GPU_MEM_CONTAINER=3", f"NVIDIA_VISIBLE_DEVICES={T4}"]
    config = k8s(env, alloc=None)
    with pytest.raises(allotted.AllotError, match="CGPU_DRA_CLAIM=u1/gpu is set by the pod's spec or image, not by a "
                                                  "claim's CDI device .*/run/cgpud/tenant"):
        read_dra(config, tenant)
    with pytest.raises(allotted.AllotError, match="CGPU_DRA_CLAIM=u1/gpu is set by the pod's spec"):
        read_dra(config, None)  # (a daemon that cannot tell: no claim believed)
    config["mounts"] = [{"destination": "/run/cgpud", "type": "bind", "source": tenant, "options": ["rbind", "ro"]}]
    got, nvidia = read_dra(config, tenant)
    assert nvidia is None and (got["ALIYUN_COM_GPU_MEM_CONTAINER"], got["NVIDIA_VISIBLE_DEVICES"]) == ("3", T4)


def read_dra(config: dict, tenant: str | None) -> tuple[dict, str | None]:
    return allotted.contract_env(hookd.env_of(config), config, tenant)


@pytest.mark.parametrize("value, why", [
    ("{", "not an allocation of the device plugin"),
    ('{"ALIYUN_COM_GPU_MEM_CONTAINER": 12}', "not an allocation of the device plugin"),
    ('{"LD_PRELOAD": "/x.so"}', "LD_PRELOAD is not a variable of the allocation"),
])
def test_a_malformed_allocation_annotation_fails_the_start(value, why):
    with pytest.raises(allotted.AllotError, match=why):
        read(spec([], {**CRI, "cgpu.aliyun.com/allocation-gpu-mem": value}))


def test_allocations_of_two_resources_merge_and_may_not_disagree():
    core = allotted.annotations("aliyun.com/gpu-core.percentage", {"ALIYUN_COM_GPU_CORE_PERCENTAGE": "30"})
    assert list(core) == ["cgpu.aliyun.com/allocation-gpu-core-percentage"]
    config = k8s([])
    config["annotations"].update(core)
    config["process"]["env"].append("ALIYUN_COM_GPU_CORE_PERCENTAGE=30")
    assert read(config)[0]["ALIYUN_COM_GPU_CORE_PERCENTAGE"] == "30"
    config["annotations"]["cgpu.aliyun.com/allocation-gpu"] = json.dumps({"NVIDIA_VISIBLE_DEVICES": "GPU-other"})
    with pytest.raises(allotted.AllotError, match="another allocation gives GPU-other"):
        read(config)


def test_containerd_passes_the_allocation_annotation_and_never_a_pods():
    """The cgpu runtime handler's container_annotations is our allocation's prefix alone, and a
    pod_annotations list (a pod's author writes those) is taken out, on containerd 1.x and 2.x."""
    for version, table in ((2, hostconfig.CRI), (3, hostconfig.CRI_V3)):
        text = (f"version = {version}\n[{table}.runtimes.cgpu]\n  runtime_type = \"io.containerd.runc.v2\"\n"
                f"  pod_annotations = [\"*\"]\n[{table}.runtimes.cgpu.options]\n  BinaryName = "
                f"\"{hostconfig.DEFAULT_WRAPPER}\"\n")
        import tomllib

        node = tomllib.loads(hostconfig.containerd_edit(text)[0])
        for key in hostconfig.split_dotted(table):
            node = node[key]
        cgpu = node["runtimes"]["cgpu"]
        assert cgpu["container_annotations"] == [allotted.PASSTHROUGH] and "pod_annotations" not in cgpu


# ---- cgpu-runtime and the daemon's prepare ------------------------------------------------------


def bundle(tmp_path, config: dict, name: str = "b"):
    b = tmp_path / name
    b.mkdir()
    (b / "config.json").write_text(json.dumps(config))
    return b


def test_the_runtime_refuses_a_pod_that_sets_its_own_allocation(daemon, tmp_path, fake_runtime):
    for n, pod_env in enumerate((["ALIYUN_COM_GPU_MEM_CONTAINER=12"], ["CGPU_DISABLE=true"],
                                 ["ALIYUN_COM_GPU_HIGH_PRIO=1"], ["ALIYUN_COM_GPU_SCHD_WEIGHT=16"])):
        d = tmp_path / str(n)
        d.mkdir()
        b = bundle(d, k8s(pod_env, {**ALLOC, "NVIDIA_VISIBLE_DEVICES": uuid_of(daemon)}))
        before = (b / "config.json").read_bytes()
        r = run_wrapper(["create", "--bundle", os.fspath(b), f"{n}" * 64], d, fake_runtime, daemon.socket)
        assert r.returncode == 1 and r.stderr.startswith(f"cgpu-runtime: {pod_env[0]} is set by the pod's spec")
        assert r.stderr.count("\n") == 1, r.stderr
        assert calls(d) == [], "the real runtime never ran"
        assert (b / "config.json").read_bytes() == before


def uuid_of(daemon, index: int = 0) -> str:
    from cgpud.client import Client

    with Client(os.fspath(daemon.socket)) as c:
        return next(g["uuid"] for g in c.call("query")["gpus"] if int(g["index"]) == index)


def test_the_runtime_narrows_the_gpus_a_pod_or_image_names_before_the_real_runtime(daemon, tmp_path, fake_runtime):
    # no allocation: a CUDA image's NVIDIA_VISIBLE_DEVICES=all becomes void, the container is not managed
    b = bundle(tmp_path, k8s([], alloc=None, image_env=("NVIDIA_VISIBLE_DEVICES=all",)), "none")
    r = run_wrapper(["create", "--bundle", os.fspath(b), "a" * 64], tmp_path, fake_runtime, daemon.socket)
    assert r.returncode == 0, r.stderr
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert [e for e in seen["process"]["env"] if e.startswith("NVIDIA_")] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert "hooks" not in seen
    # allotted one GPU, the pod names all: the real runtime sees the allotted one, and the hooks are in
    alloc = {**ALLOC, "NVIDIA_VISIBLE_DEVICES": uuid_of(daemon)}
    b = bundle(tmp_path, k8s(["NVIDIA_VISIBLE_DEVICES=all"], alloc), "one")
    r = run_wrapper(["create", "--bundle", os.fspath(b), "b" * 64], tmp_path, fake_runtime, daemon.socket)
    assert r.returncode == 0, r.stderr
    seen = json.loads((tmp_path / "seen.json").read_text())
    want = "NVIDIA_VISIBLE_DEVICES=" + alloc["NVIDIA_VISIBLE_DEVICES"]
    assert [e for e in seen["process"]["env"] if e.startswith("NVIDIA_")] == [want]
    assert seen["hooks"]["createRuntime"] and seen["hooks"]["poststop"]
    # a plain host's container naming all GPUs is not looked at (docker run --gpus all: the host's admin)
    b = bundle(tmp_path, spec(["NVIDIA_VISIBLE_DEVICES=all"]), "plain")
    before = (b / "config.json").read_bytes()
    r = run_wrapper(["create", "--bundle", os.fspath(b), "c" * 64], tmp_path, fake_runtime, daemon.socket)
    assert r.returncode == 0 and (b / "config.json").read_bytes() == before


def test_the_hook_op_refuses_a_forged_kubernetes_spec_and_registers_nothing(daemon, tmp_path):
    """The hook alone (hooks.d, or a spec cgpu-runtime did not prepare): the daemon reads the same
    rule, and a spec whose GPUs it can no longer narrow is refused too."""
    from cgpud.client import Client, ControlError

    before = daemon.snapshot()
    for n, (pod_env, alloc, words) in enumerate((
            (["ALIYUN_COM_GPU_MEM_CONTAINER=12"], ALLOC, "ALIYUN_COM_GPU_MEM_CONTAINER=12 is set by the pod's spec"),
            (["CGPU_DISABLE=true"], ALLOC, "CGPU_DISABLE=true is set by the pod's spec"),
            (["NVIDIA_VISIBLE_DEVICES=all"], ALLOC, "start it through the cgpu runtime, which narrows it"))):
        b = bundle(tmp_path, k8s(pod_env, {**alloc, "NVIDIA_VISIBLE_DEVICES": uuid_of(daemon)}), f"h{n}")
        with Client(os.fspath(daemon.socket)) as c:
            with pytest.raises(ControlError) as exc:
                c.call("hook", stage="createRuntime", state={"ociVersion": "1.0.2", "id": f"{n}" * 64,
                                                            "pid": os.getppid(), "bundle": os.fspath(b)})
        assert words in str(exc.value) and exc.value.error == "EINVAL", exc.value
    assert daemon.snapshot() == before


def test_the_runtime_believes_a_claims_environment_only_with_the_claims_bind(daemon, tmp_path, fake_runtime):
    env = ["CGPU_DRA_CLAIM=u1/gpu", "ALIYUN_COM_GPU_MEM_CONTAINER=1", "ALIYUN_COM_GPU_MEM_IDX=0",
           f"NVIDIA_VISIBLE_DEVICES={uuid_of(daemon)}"]
    forged = bundle(tmp_path, k8s(env, alloc=None), "forged")
    r = run_wrapper(["create", "--bundle", os.fspath(forged), "f" * 64], tmp_path, fake_runtime, daemon.socket)
    assert r.returncode == 1 and "CGPU_DRA_CLAIM=u1/gpu is set by the pod's spec or image" in r.stderr, r.stderr
    assert calls(tmp_path) == []
    claimed = k8s(env, alloc=None)
    claimed["mounts"] = [{"destination": os.fspath(daemon.socket.parent), "type": "bind", "options": ["rbind", "ro"],
                          "source": os.fspath(daemon.socket.parent / "tenant")}]
    b = bundle(tmp_path, claimed, "claimed")
    r = run_wrapper(["create", "--bundle", os.fspath(b), "e" * 64], tmp_path, fake_runtime, daemon.socket)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "seen.json").read_text())["hooks"]["createRuntime"]
