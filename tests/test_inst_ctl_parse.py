"""inst_ctl's wire format (SPEC §2) and the strict number parser (SPEC §1).

Fast tier: cgpud.tree.parse_inst_ctl and fusefs.node.parse_uint called directly.
"""
from __future__ import annotations

import errno

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cgpud.core.model import InvalidValue, Node, GpuInfo
from cgpud.core.model import ERRNOS
from cgpud.tree import INST_CTL_LEN, parse_inst_ctl
from fusefs import InvalidInput, parse_bool, parse_uint

NAME = "abcdef012345"


def test_the_command_is_13_bytes():
    assert INST_CTL_LEN == 13


# ---- inst_ctl --------------------------------------------------------------


@pytest.mark.parametrize("g", range(10))
def test_digit_then_name_creates_on_that_gpu(g):
    assert parse_inst_ctl(f"{g}{NAME}", 10) == ("create", g, NAME)


def test_dash_then_name_destroys_everywhere():
    assert parse_inst_ctl(f"-{NAME}", 1) == ("destroy", None, NAME)
    assert parse_inst_ctl(f"-{NAME}", 0) == ("destroy", None, NAME)  # destroy does not need a GPU


def test_a_14th_byte_newline_is_accepted():
    assert parse_inst_ctl(f"0{NAME}\n", 1) == ("create", 0, NAME)
    assert parse_inst_ctl(f"-{NAME}\n", 1) == ("destroy", None, NAME)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n",
        "0",
        f"0{NAME[:-1]}",  # 12 bytes
        f"0{NAME}x",  # 14th byte not a newline
        f"0{NAME} ",
        f"0{NAME}\r",
        f"0{NAME}\n\n",  # 15 bytes
        f"\n0{NAME}",  # the newline must be the 14th byte, not the first
        f"0{NAME}0",
        f"00{NAME}",
        f"-{NAME}-",
        f"--{NAME}",
    ],
)
def test_any_other_length_is_einval(text):
    with pytest.raises(InvalidInput):
        parse_inst_ctl(text, 10)


@given(st.text(alphabet=st.characters(codec="ascii"), max_size=40).filter(lambda t: len(t) not in (13, 14)))
def test_every_length_but_13_and_14_is_refused(text):
    with pytest.raises(InvalidInput):
        parse_inst_ctl(text, 10)


@pytest.mark.parametrize("gpu_count,g", [(1, 1), (1, 9), (2, 2), (4, 7)])
def test_a_gpu_digit_at_or_past_the_gpu_count_is_einval(gpu_count, g):
    with pytest.raises(InvalidInput):
        parse_inst_ctl(f"{g}{NAME}", gpu_count)
    assert parse_inst_ctl(f"{gpu_count - 1}{NAME}", gpu_count)[1] == gpu_count - 1


@pytest.mark.parametrize("head", ["+", "a", " ", "x", "/", "\t", "\x00", ".", "\n"])
def test_anything_but_a_digit_or_dash_first_is_einval(head):
    with pytest.raises(InvalidInput):
        parse_inst_ctl(f"{head}{NAME}", 10)
    with pytest.raises(InvalidInput):
        parse_inst_ctl(f"{head}{NAME}\n", 10)


def test_invalid_input_is_a_value_error_answered_einval():
    # fusefs maps InvalidInput to EINVAL; the model's own refusal of a name is also EINVAL
    assert issubclass(InvalidInput, ValueError)
    assert ERRNOS[InvalidValue] == errno.EINVAL


@pytest.mark.parametrize(
    "name", [NAME[:-1] + "\n", "abcdef 12345", "abcdef/12345", "abcdef:12345", "ab\tdef012345", "abc\ndef01234"]
)
def test_bad_names_get_through_the_parser_and_are_refused_by_the_model(name):
    op, g, got = parse_inst_ctl(f"0{name}", 1)
    assert (op, g, got) == ("create", 0, name)
    n = Node([GpuInfo(0, "GPU-x", "x", 100)])
    with pytest.raises(InvalidValue):
        n.create_instance(g, got)
    with pytest.raises(InvalidValue):
        n.destroy(got)
    assert list(n.instances()) == []


def test_the_name_keeps_dots_dashes_and_underscores():
    assert parse_inst_ctl("0a.b-c_d.e-f_", 1) == ("create", 0, "a.b-c_d.e-f_")
    assert parse_inst_ctl("--a.b-c_d.e-f", 1) == ("destroy", None, "-a.b-c_d.e-f")


# ---- parse_uint ------------------------------------------------------------


@pytest.mark.parametrize(
    "text,value",
    [("0", 0), ("5", 5), ("5\n", 5), (" 5", 5), ("\t5 \n", 5), ("007", 7), ("25", 25), ("  12  ", 12)],
)
def test_plain_decimals_with_surrounding_whitespace(text, value):
    assert parse_uint(text, 0, 25) == value


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n",
        "   ",
        "+1",
        "-1",
        "-0",
        "0x1",
        "0b1",
        "0o7",
        "1e1",
        "1.0",
        "1_0",
        "1 2",
        "one",
        "١",  # ARABIC-INDIC DIGIT ONE
        "²",
        "５",  # FULLWIDTH DIGIT FIVE
        "1\x00",
        "\x001",
    ],
)
def test_signs_prefixes_empty_and_non_ascii_are_refused(text):
    with pytest.raises(InvalidInput):
        parse_uint(text, 0, 100)


def test_range_is_inclusive_and_enforced():
    assert parse_uint("20", 20, 99) == 20
    assert parse_uint("99", 20, 99) == 99
    for text in ("19", "100", "0"):
        with pytest.raises(InvalidInput, match="out of range"):
            parse_uint(text, 20, 99)


def test_huge_values_are_out_of_range_not_a_crash():
    with pytest.raises(InvalidInput):
        parse_uint("9" * 40, 0, 10**14 - 1)


@given(st.integers(0, 10**15))
def test_every_decimal_parses_back_to_itself(v):
    text = str(v)
    if v <= 10**14 - 1:
        assert parse_uint(text + "\n", 0, 10**14 - 1) == v
    else:
        with pytest.raises(InvalidInput):
            parse_uint(text, 0, 10**14 - 1)


def test_parse_bool():
    assert parse_bool("1\n") is True
    assert parse_bool("0") is False
    for text in ("2", "true", "", "-1"):
        with pytest.raises(InvalidInput):
            parse_bool(text)
