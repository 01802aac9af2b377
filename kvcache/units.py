"""Byte counts as people read them, for every message that names a size (budgets, refusals, limits).

It lives here, in the package everything else imports, so that the KV pool's and the park budget's
refusals, the model loader's memory check and the recordings' disk budget all speak one format.
"""

from __future__ import annotations

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | float) -> str:
    """`n` bytes in the largest binary unit that keeps it at 1 or more, to three significant figures:
    "0 bytes", "512 bytes", "1.50 KiB", "96.0 MiB", "3.25 GiB". A size is never rounded to nothing, as
    "0.00 GiB" for a 96 MiB park budget was. Negative counts (a budget overdrawn) keep their sign."""
    sign, size = ("-" if n < 0 else ""), float(abs(n))
    if size < 1024:
        return f"{sign}{size:.0f} bytes" if round(size) != 1 else f"{sign}1 byte"
    unit = _UNITS[0]
    for unit in _UNITS:
        size /= 1024
        if size < 1023.5 or unit == _UNITS[-1]:  # (1023.7 KiB would print as "1024 KiB": 1.00 MiB instead)
            break
    digits = 2 if size < 9.995 else 1 if size < 99.95 else 0  # three significant figures after rounding
    return f"{sign}{size:.{digits}f} {unit}"
