"""What the pages' charts and QR code are drawn from. A chart's data travel as
JSON in a `<script type="application/json">` block (data, not code: the
Content-Security-Policy allows no inline script) and console.js draws them
with uPlot; money stays integer nano-USD until the axis labels it."""
from __future__ import annotations

import base64
import functools
import io
from collections import defaultdict
from datetime import date, timedelta

import segno

from app.limits import QR_BORDER_MODULES, QR_CODES_CACHED_MAX, QR_MODULE_PX, SUMMARY_WINDOW_DAYS_MAX


def days_ending(today: date, count: int = SUMMARY_WINDOW_DAYS_MAX) -> list[str]:
    return [(today - timedelta(days=count - 1 - i)).isoformat() for i in range(count)]


def daily_series(rows: list[dict], split: str, value: str, today: date) -> dict:
    """{"days": [...30 days...], "series": [{"label", "values"}]}: one series per `split` value,
    a day without rows counting 0."""
    days = days_ending(today)
    index = {day: i for i, day in enumerate(days)}
    series: dict[str, list[int]] = defaultdict(lambda: [0] * len(days))
    for row in rows:
        if row["day"] in index:
            series[str(row[split])][index[row["day"]]] += row[value]
    return {"days": days, "series": [{"label": label, "values": values} for label, values in sorted(series.items())]}


def totals(rows: list[dict], split: str, value: str) -> list[tuple[str, int]]:
    summed: dict[str, int] = defaultdict(int)
    for row in rows:
        summed[str(row[split])] += row[value]
    return sorted(summed.items())


@functools.lru_cache(maxsize=QR_CODES_CACHED_MAX)
def qr_svg_data_uri(text: str) -> str:
    """A QR code of `text` as an SVG data URI (an <img>, allowed by the page's policy).
    Drawn once per address: a customer's address never changes, and drawing
    it took a third of the top-up page's time (5 to 12 ms of CPU)."""
    out = io.BytesIO()
    segno.make(text, error="m").save(out, kind="svg", scale=QR_MODULE_PX, border=QR_BORDER_MODULES, xmldecl=False)
    return "data:image/svg+xml;base64," + base64.b64encode(out.getvalue()).decode()
