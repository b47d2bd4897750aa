"""Size flags: the accepted spellings, by hand, and the refused ones."""

import random

import pytest

from foundation.byte_size import format_bytes, parse_byte_size


@pytest.mark.parametrize(
    "text,expected",
    [("40GiB", 40 * 2**30), ("512MiB", 512 * 2**20), ("2e9", 2_000_000_000), ("1048576", 1_048_576),
     ("1.5GB", 1_500_000_000), ("8 KiB", 8192), ("3g", 3 * 2**30)],
)
def test_accepted_spellings(text, expected):
    assert parse_byte_size(text) == expected


def test_plain_integers_round_trip():
    for _ in range(100):
        value = random.randint(1, 2**45)
        assert parse_byte_size(str(value)) == value


@pytest.mark.parametrize("text", ["", "lots", "-1", "0", "1.5", "1e400", "5XB", "GiB"])
def test_refused_spellings_name_the_value(text):
    with pytest.raises(ValueError, match="size"):
        parse_byte_size(text)


def test_format_bytes():
    assert format_bytes(40 * 2**30) == "40.00 GiB"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(12) == "12 B"
