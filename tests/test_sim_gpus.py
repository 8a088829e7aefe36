"""Simulated GPU inventories (SPEC §8, issue 2 item 4): `--gpus sim:…` and `file:…`."""
from __future__ import annotations

import re

import pytest

from cgpud.gpus import BadSpec, GpuInfo, discover
from cgpud.gpus.sim import MAX_GPUS, MIB, SIM_MAJOR, sim_uuid

UUID_RE = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")


def summary(gpus: list[GpuInfo]) -> list[tuple[int, str, int]]:
    return [(g.index, g.name, g.memory // MIB) for g in gpus]


def test_t4_is_the_seeds_tesla_t4():
    (g,) = discover("sim:T4")
    assert (g.index, g.name, g.memory) == (0, "Tesla T4", 15109 * MIB)
    assert g.major == SIM_MAJOR
    assert UUID_RE.match(g.uuid)


def test_v100_is_the_seeds_v100_sxm2_16gb():
    assert summary(discover("sim:V100")) == [(0, "Tesla V100-SXM2-16GB", 16160)]


def test_model_names_are_case_insensitive():
    assert summary(discover("sim:t4")) == summary(discover("sim:T4"))


def test_four_t4s():
    gpus = discover("sim:4xT4")
    assert summary(gpus) == [(i, "Tesla T4", 15109) for i in range(4)]
    assert len({g.uuid for g in gpus}) == 4, "each index has its own UUID"


def test_name_and_memory():
    assert summary(discover("sim:MyGPU:8192")) == [(0, "MyGPU", 8192)]
    assert summary(discover("sim:2xMyGPU:1")) == [(0, "MyGPU", 1), (1, "MyGPU", 1)]


def test_mixed_groups_are_numbered_in_order():
    gpus = discover("sim:2xT4,V100, 1xSmall:100")
    assert summary(gpus) == [
        (0, "Tesla T4", 15109),
        (1, "Tesla T4", 15109),
        (2, "Tesla V100-SXM2-16GB", 16160),
        (3, "Small", 100),
    ]
    assert len({g.uuid for g in gpus}) == 4


def test_surrounding_whitespace_is_ignored():
    assert summary(discover("  sim:T4\n")) == summary(discover("sim:T4"))


def test_uuids_are_stable_across_calls():
    a = discover("sim:2xT4,V100")
    b = discover("sim:2xT4,V100")
    assert [g.uuid for g in a] == [g.uuid for g in b]
    assert a == b


def test_uuid_depends_on_index_name_and_machine():
    assert sim_uuid(0, "Tesla T4", "m1") == sim_uuid(0, "Tesla T4", "m1")
    assert len({sim_uuid(0, "Tesla T4", "m1"), sim_uuid(1, "Tesla T4", "m1"),
                sim_uuid(0, "Tesla V100-SXM2-16GB", "m1"), sim_uuid(0, "Tesla T4", "m2")}) == 4
    assert UUID_RE.match(sim_uuid(3, "x", "m"))


def test_the_same_gpu_keeps_its_uuid_when_others_are_added_after_it():
    assert discover("sim:T4")[0].uuid == discover("sim:T4,V100")[0].uuid


def test_at_most_ten_gpus():
    assert len(discover(f"sim:{MAX_GPUS}xT4")) == MAX_GPUS == 10
    with pytest.raises(BadSpec, match="at most 10"):
        discover("sim:11xT4")
    with pytest.raises(BadSpec, match="at most 10"):
        discover("sim:6xT4,5xV100")


@pytest.mark.parametrize(
    "spec,says",
    [
        ("", "expected sim:MODEL"),
        ("T4", "expected sim:MODEL"),
        ("gpu:T4", "expected sim:MODEL"),
        ("sim:", "cannot read"),
        ("sim:T4,", "cannot read"),
        ("sim:NoSuchModel", "unknown model 'NoSuchModel'"),
        ("sim:0xT4", "at least 1"),
        ("sim:X:0", "memory must be"),
        ("sim:X:99999999999", "memory must be"),
        ("sim:X:-5", "cannot read"),
        ("sim:T4:abc", "cannot read"),
        ("sim:2x", "unknown model"),
        ("sim:a b", "cannot read"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, says):
    with pytest.raises(BadSpec) as info:
        discover(spec)
    msg = str(info.value)
    assert says in msg
    assert "\n" not in msg, "one line"
    assert isinstance(info.value, ValueError)


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(BadSpec) as info:
        discover("sim:Z9")
    assert "T4" in str(info.value) and "V100" in str(info.value) and "NAME:MIB" in str(info.value)


# ---- file:PATH -------------------------------------------------------------


def write(tmp_path, text: str) -> str:
    p = tmp_path / "gpus.toml"
    p.write_text(text)
    return str(p)


def test_file_with_models_and_named_devices(tmp_path):
    path = write(
        tmp_path,
        """
[[gpu]]
model = "T4"
count = 2

[[gpu]]
name = "Lab card"
memory_mib = 4096

[[gpu]]
model = "V100"
""",
    )
    gpus = discover(f"file:{path}")
    assert summary(gpus) == [
        (0, "Tesla T4", 15109),
        (1, "Tesla T4", 15109),
        (2, "Lab card", 4096),
        (3, "Tesla V100-SXM2-16GB", 16160),
    ]
    assert [g.uuid for g in gpus] == [g.uuid for g in discover(f"file:{path}")]


def test_file_and_sim_spec_describing_the_same_gpus_agree(tmp_path):
    path = write(tmp_path, '[[gpu]]\nmodel = "T4"\ncount = 2\n')
    assert discover(f"file:{path}") == discover("sim:2xT4")


@pytest.mark.parametrize(
    "text,says",
    [
        ("this is = = not toml", "not valid TOML"),
        ("", "expected one or more [[gpu]] tables"),
        ("gpu = 3", "expected one or more [[gpu]] tables"),
        ("[[gpu]]\nname = \"x\"\n", "give model"),
        ("[[gpu]]\nmemory_mib = 5\n", "give model"),
        ("[[gpu]]\nname = \"x\"\nmemory_mib = \"5\"\n", "give model"),
        ("[[gpu]]\nmodel = \"Nope\"\n", "unknown model"),
        ("[[gpu]]\nmodel = \"T4\"\ncount = \"2\"\n", "count must be an integer"),
        ("[[gpu]]\nmodel = \"T4\"\ncount = 0\n", "at least 1"),
        ("[[gpu]]\nmodel = \"T4\"\ncount = 11\n", "at most 10"),
        ("[[gpu]]\nname = \"x\"\nmemory_mib = 0\n", "memory must be"),
    ],
)
def test_bad_files_say_which_file_and_what(tmp_path, text, says):
    path = write(tmp_path, text)
    with pytest.raises(BadSpec) as info:
        discover(f"file:{path}")
    msg = str(info.value)
    assert says in msg
    if says != "at most 10":
        assert path in msg


def test_bad_entry_is_named_by_position(tmp_path):
    path = write(tmp_path, '[[gpu]]\nmodel = "T4"\n[[gpu]]\nmodel = "Nope"\n')
    with pytest.raises(BadSpec, match=r"\[\[gpu\]\] #2"):
        discover(f"file:{path}")


def test_missing_file(tmp_path):
    path = str(tmp_path / "absent.toml")
    with pytest.raises(BadSpec) as info:
        discover(f"file:{path}")
    assert path in str(info.value) and "No such file" in str(info.value)
