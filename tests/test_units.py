import pytest

from cgpud.core.units import human, parse_size


@pytest.mark.parametrize("text, value", [
    ("6G", 6 << 30), ("6GiB", 6 << 30), ("6gb", 6 << 30), ("512M", 512 << 20), ("1048576", 1 << 20),
    (" 2 K ", 2048), ("1T", 1 << 40),
])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "G", "-1G", "1.5G", "6X", "six"])
def test_bad_sizes(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_human():
    assert human(6 << 30) == "6.0 GiB" and human(512 << 20) == "512.0 MiB" and human(10) == "10 B"
