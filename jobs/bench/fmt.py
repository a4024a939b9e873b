"""Numbers as the bench's tables and log lines print them; a missing value is a dash."""
from __future__ import annotations

import math


def num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def percent(value: float | None) -> str:
    return "–" if value is None or math.isnan(value) else f"{100 * value:.0f}%"
