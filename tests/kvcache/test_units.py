"""Byte counts in messages: the largest binary unit that keeps the number at 1 or more, three figures."""

import pytest

from kvcache.units import format_bytes


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 bytes"), (1, "1 byte"), (1000, "1000 bytes"), (1023, "1023 bytes"),
    (1024, "1.00 KiB"), (1536, "1.50 KiB"), (10 * 1024 - 1, "10.0 KiB"), (520 * 1024, "520 KiB"),
    (1024 * 1024 - 100, "1.00 MiB"),  # 1023.9 KiB would print as "1024 KiB"
    (96 * 2**20, "96.0 MiB"), (int(3.25 * 2**30), "3.25 GiB"), (8 * 2**30, "8.00 GiB"), (2**40, "1.00 TiB"),
    (-300, "-300 bytes"), (-5 * 2**20, "-5.00 MiB"),  # a budget overdrawn by a forced reservation
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text
