"""Small inline SVG charts for the job report: line segments and grouped bars, axes with round ticks.

Hand-drawn so that the report needs no plotting library and no network: a chart is a string of SVG.
"""
from __future__ import annotations

import math
from html import escape

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
WIDTH, HEIGHT = 640, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 130, 14, 40  # margins; the legend sits in the right one


def color(i: int) -> str:
    return COLORS[i % len(COLORS)]


def nice_ticks(high: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least `high` (1, 2 or 5 times a power of ten apart)."""
    if high <= 0:
        return [0.0, 1.0]
    raw = high / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(math.ceil(high / step - 1e-9) + 1)]


def _fmt(value: float) -> str:
    return f"{value:g}" if abs(value) < 1e5 else f"{value:.3g}"


class _Frame:
    """Scales from data to pixels and draws the axes, ticks, labels and legend."""

    def __init__(self, x_max: float, y_max: float, x_label: str, y_label: str, x_ticks: bool = True):
        self.xt, self.yt = nice_ticks(x_max), nice_ticks(y_max)
        self.x_max, self.y_max = self.xt[-1], self.yt[-1]
        self.w, self.h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
        self.parts = [f'<line x1="{LEFT}" y1="{TOP + self.h}" x2="{LEFT + self.w}" y2="{TOP + self.h}" class="axis"/>',
                      f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + self.h}" class="axis"/>']
        for y in self.yt:
            py = self.py(y)
            self.parts.append(f'<line x1="{LEFT}" y1="{py:.1f}" x2="{LEFT + self.w}" y2="{py:.1f}" class="grid"/>'
                              f'<text x="{LEFT - 6}" y="{py + 4:.1f}" text-anchor="end">{_fmt(y)}</text>')
        if x_ticks:
            for x in self.xt:
                self.parts.append(f'<text x="{self.px(x):.1f}" y="{TOP + self.h + 16}" text-anchor="middle">{_fmt(x)}</text>')
        self.parts.append(f'<text x="{LEFT + self.w / 2}" y="{HEIGHT - 6}" text-anchor="middle">{escape(x_label)}</text>'
                          f'<text transform="translate(14 {TOP + self.h / 2}) rotate(-90)" text-anchor="middle">'
                          f'{escape(y_label)}</text>')

    def px(self, x: float) -> float:
        return LEFT + self.w * x / self.x_max

    def py(self, y: float) -> float:
        return TOP + self.h * (1 - y / self.y_max)

    def legend(self, names: list[str]) -> None:
        for i, name in enumerate(names):
            y = TOP + 6 + 16 * i
            self.parts.append(f'<rect x="{WIDTH - RIGHT + 12}" y="{y - 8}" width="10" height="10" fill="{color(i)}"/>'
                              f'<text x="{WIDTH - RIGHT + 27}" y="{y + 1}">{escape(name)}</text>')

    def svg(self, title: str) -> str:
        return (f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
                f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>{"".join(self.parts)}</svg>')


def line_chart(series: dict[str, list[list[tuple[float, float]]]], title: str, x_label: str, y_label: str,
               y_max: float | None = None, markers: bool = False) -> str:
    """One colour per series; each series is a list of polylines (x, y points), drawn unconnected;
    `markers` puts a dot on every point (a one-point line shows no stroke)."""
    points = [p for lines in series.values() for line in lines for p in line]
    frame = _Frame(max((x for x, _ in points), default=1.0), y_max or max((y for _, y in points), default=1.0),
                   x_label, y_label)
    for i, lines in enumerate(series.values()):
        for line in lines:
            coords = " ".join(f"{frame.px(x):.1f},{frame.py(y):.1f}" for x, y in line)
            frame.parts.append(f'<polyline points="{coords}" fill="none" stroke="{color(i)}" stroke-width="2"/>')
            if markers:
                frame.parts += [f'<circle cx="{frame.px(x):.1f}" cy="{frame.py(y):.1f}" r="3" fill="{color(i)}"/>'
                                for x, y in line]
    frame.legend(list(series))
    return frame.svg(title)


def bar_chart(categories: list[str], series: dict[str, list[float]], title: str, x_label: str, y_label: str,
              y_max: float | None = None) -> str:
    """Grouped bars: one group per category, one bar per series within it."""
    values = [v for vs in series.values() for v in vs]
    frame = _Frame(1.0, y_max or max(values, default=1.0), x_label, y_label, x_ticks=False)
    group = frame.w / max(len(categories), 1)
    bar = group * 0.8 / max(len(series), 1)
    every = max(1, math.ceil(len(categories) / 20))  # at most ~20 category labels
    for c, name in enumerate(categories):
        if c % every == 0:
            frame.parts.append(f'<text x="{LEFT + group * (c + 0.5):.1f}" y="{TOP + frame.h + 16}" '
                               f'text-anchor="middle">{escape(name)}</text>')
        for i, values_i in enumerate(series.values()):
            top = frame.py(values_i[c])
            frame.parts.append(f'<rect x="{LEFT + group * (c + 0.1) + bar * i:.1f}" y="{top:.1f}" width="{max(bar, 0.5):.1f}" '
                               f'height="{TOP + frame.h - top:.1f}" fill="{color(i)}"/>')
    frame.legend(list(series))
    return frame.svg(title)
