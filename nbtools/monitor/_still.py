"""The drawing surface of the pane's still picture: Pillow's ``ImageDraw`` on a white page.

Drawn at ``_S`` times the final size and reduced once, then to a palette of
at most 64 colours, which keeps the PNG at tens of KB. Every coordinate a caller passes is in final pixels or in data units
(seconds since the epoch, the panel's values).
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

__all__ = ["Canvas", "Panel"]

_S = 1  # supersampling factor (2: smoother, about twice the time)
_TEXT = "#2a3f5f"
_MUTED = "#666666"
_GRID = "#e3e8f2"
_FRAME = "#b8c2d6"
_WARN = "#b45309"
_LEFT, _RIGHT = 58, 16
_PANEL_H, _PANEL_GAP = 150, 30
_LINE = 16  # text line height
_STEPS = (10, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 28800, 86400)


def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size * _S)
    except (TypeError, OSError):  # Pillow without FreeType: its small bitmap font
        return ImageFont.load_default()


def _rgb(color: str) -> tuple[int, int, int]:
    color = color.lstrip("#")
    return int(color[0:2], 16), int(color[2:4], 16), int(color[4:6], 16)


def _tint(color: str, alpha: float) -> tuple[int, int, int]:
    """``color`` at ``alpha`` over white."""
    return tuple(round(255 - alpha * (255 - c)) for c in _rgb(color))  # type: ignore[return-value]


class Panel:
    """One panel's plot area: maps data to pixels and draws into it."""

    def __init__(
        self,
        draw: ImageDraw.ImageDraw,
        box: tuple[int, int, int, int],
        span: tuple[float, float],
        values: tuple[float, float],
    ) -> None:
        self._draw = draw
        self.x0, self.y0, self.x1, self.y1 = box
        self._t0, self._t1 = span
        self._v0, self._v1 = values

    def x(self, t: float | np.ndarray) -> float | np.ndarray:
        return _S * (self.x0 + (t - self._t0) / (self._t1 - self._t0) * (self.x1 - self.x0))

    def y(self, v: float | np.ndarray) -> float | np.ndarray:
        return _S * (self.y1 - (v - self._v0) / (self._v1 - self._v0) * (self.y1 - self.y0))

    def line(
        self, times: np.ndarray, values: np.ndarray, color: str, *, dashed: bool = False
    ) -> None:
        """A polyline, broken where a value is missing (NaN); dashed for a second host."""
        if not len(times):
            return
        xs = self.x(np.asarray(times))
        ys = self.y(np.clip(np.asarray(values), self._v0, self._v1))
        ok = ~np.isnan(ys)
        # Runs of consecutive available points.
        edges = np.flatnonzero(np.diff(np.concatenate([[0], ok.astype(np.int8), [0]])))
        for start, stop in zip(edges[::2], edges[1::2], strict=True):
            points = list(zip(xs[start:stop].tolist(), ys[start:stop].tolist(), strict=True))
            if dashed:
                for k in range(0, len(points) - 1, 4):
                    self._draw.line(points[k : k + 3], fill=color, width=max(1, 3 * _S // 2))
            elif len(points) == 1:
                px, py = points[0]
                self._draw.ellipse((px - 2, py - 2, px + 2, py + 2), fill=color)
            else:
                self._draw.line(points, fill=color, width=max(1, 3 * _S // 2), joint="curve")

    def band(self, start: float, end: float, color: str, alpha: float) -> None:
        """A shaded span (a save that blocked, an input stall), under the lines."""
        a, b = sorted((max(start, self._t0), min(end, self._t1)))
        if b < self._t0 or a > self._t1:
            return
        left, right = self.x(a), max(self.x(b), self.x(a) + _S)
        self._draw.rectangle((left, _S * self.y0, right, _S * self.y1), fill=_tint(color, alpha))

    def vline(self, t: float, color: str, style: str) -> None:
        """A vertical line across the panel: ``"-"`` solid, ``"--"`` dashed, ``":"`` dotted."""
        if not self._t0 <= t <= self._t1:
            return
        x = self.x(t)
        top, bottom = _S * self.y0, _S * self.y1
        if style == "-":
            self._draw.line((x, top, x, bottom), fill=color, width=max(1, 3 * _S // 2))
            return
        on, off = (8 * _S, 5 * _S) if style == "--" else (2 * _S, 4 * _S)
        y = top
        while y < bottom:
            self._draw.line((x, y, x, min(y + on, bottom)), fill=color, width=max(1, 3 * _S // 2))
            y += on + off

    def marker(self, t: float, color: str, shape: str) -> None:
        """An event's marker on the panel's top edge."""
        if not self._t0 <= t <= self._t1:
            return
        x, y, r = self.x(t), _S * self.y0, 5 * _S
        if shape == "s":
            self._draw.rectangle((x - r, y - r, x + r, y + r), fill=color, outline="white")
        elif shape == "D":
            self._draw.polygon(
                [(x, y - r), (x + r, y), (x, y + r), (x - r, y)], fill=color, outline="white"
            )
        elif shape == "^":
            self._draw.polygon(
                [(x, y - r), (x + r, y + r), (x - r, y + r)], fill=color, outline="white"
            )
        elif shape == ">":
            self._draw.polygon(
                [(x - r, y - r), (x + r, y), (x - r, y + r)], fill=color, outline="white"
            )
        elif shape == "v":
            self._draw.polygon(
                [(x - r, y - r), (x + r, y - r), (x, y + r)], fill=color, outline="white"
            )
        elif shape == "x":
            self._draw.line((x - r, y - r, x + r, y + r), fill=color, width=2 * _S)
            self._draw.line((x - r, y + r, x + r, y - r), fill=color, width=2 * _S)
        else:
            self._draw.ellipse((x - r, y - r, x + r, y + r), outline=color, width=2 * _S)


class Canvas:
    """The page: title, status, readings table, legend, three panels, time axis, events.

    Args:
        width: Final width in pixels.
        rows: Rows of the readings table (its header included).
        listed: Lines of the events list (its heading included).
    """

    def __init__(self, width: int, rows: int, listed: int, panels: int = 3) -> None:
        self.width = width
        self._rows = min(rows, 9)
        self._table_top = 48
        self._legend_top = self._table_top + _LINE * self._rows + 8
        self._panels_top = self._legend_top + 40
        self._axis_top = self._panels_top + panels * _PANEL_H + (panels - 1) * _PANEL_GAP
        self._events_top = self._axis_top + 26
        self.height = self._events_top + _LINE * listed + 10
        self._image = Image.new("RGB", (width * _S, self.height * _S), "white")
        self._draw = ImageDraw.Draw(self._image)
        self._font = _font(12)
        self._small = _font(11)
        self._big = _font(15)
        self._panels: list[Panel] = []

    def _text(
        self, x: float, y: float, text: str, *, color: str = _TEXT, font=None, anchor: str = "la"
    ) -> None:
        self._draw.text((x * _S, y * _S), text, fill=color, font=font or self._font, anchor=anchor)

    def title(self, text: str, *, warn: bool = False) -> None:
        self._text(10, 8, text, color=_WARN if warn else _TEXT, font=self._big)

    def status(self, text: str) -> None:
        self._text(10, 28, text, color=_MUTED, font=self._small)

    def _column(
        self,
        x: float,
        y: float,
        lines: Sequence[str],
        *,
        color: str = _TEXT,
        font=None,
        right: bool = False,
    ) -> None:
        """Lines of text ``_LINE`` pixels apart, in one drawing call."""
        if not lines:
            return
        font = font or self._font
        spacing = _LINE * _S - self._draw.textbbox((0, 0), "A", font=font)[3]
        self._draw.multiline_text(
            (x * _S, y * _S),
            "\n".join(lines),
            fill=color,
            font=font,
            spacing=spacing,
            anchor="ra" if right else "la",
            align="right" if right else "left",
        )

    def table(self, rows: Sequence[Sequence[str]]) -> None:
        """The latest readings: first column left-aligned, numbers right-aligned, a note last."""
        stops = (10, 250, 370, 450, 560, 580)
        shown = [tuple(row) for row in rows[: self._rows]]
        if len(rows) > self._rows:
            shown[-1] = (f"… and {len(rows) - self._rows + 1} more GPUs",) + ("",) * 5
        if not shown:
            return
        for c, cell in enumerate(shown[0]):
            self._column(stops[c], self._table_top, [cell], color=_MUTED, right=c not in (0, 5))
        for c in range(len(shown[0])):
            self._column(
                stops[c],
                self._table_top + _LINE,
                [row[c] for row in shown[1:]],
                right=c not in (0, 5),
            )

    def legend(self, entries: Sequence[tuple[str, str, bool]]) -> None:
        x = _LEFT
        for label, color, dashed in entries:
            y = (self._legend_top + 9) * _S
            if dashed:
                for k in range(3):
                    self._draw.line(
                        (x * _S + 8 * k * _S, y, x * _S + (8 * k + 5) * _S, y),
                        fill=color,
                        width=3 * _S,
                    )
            else:
                self._draw.line((x * _S, y, (x + 22) * _S, y), fill=color, width=3 * _S)
            self._text(x + 27, self._legend_top + 2, label, font=self._small)
            x += 40 + self._draw.textlength(label, font=self._small) / _S
            if x > self.width - 120:
                break

    def panel(
        self,
        index: int,
        label: str,
        span: tuple[float, float],
        values: tuple[float, float],
        *,
        empty: bool = False,
    ) -> Panel:
        """Frame, grid and value axis of panel ``index``; returns it to draw into."""
        top = self._panels_top + index * (_PANEL_H + _PANEL_GAP)
        box = (_LEFT, top, self.width - _RIGHT, top + _PANEL_H)
        self._text(_LEFT, top - 17, label, font=self._small)
        panel = Panel(self._draw, box, span, values)
        low, high = values
        step = _nice((high - low) / 4)
        tick = math.ceil(low / step) * step
        while tick <= high + 1e-9:
            y = panel.y(tick)
            self._draw.line((box[0] * _S, y, box[2] * _S, y), fill=_GRID, width=_S)
            text = f"{tick:g}" if step >= 1 else f"{tick:.1f}"
            self._text(box[0] - 5, y / _S - 7, text, color=_MUTED, font=self._small, anchor="ra")
            tick += step
        self._draw.rectangle(tuple(v * _S for v in box), outline=_FRAME, width=_S)
        if empty:
            self._text(
                (box[0] + box[2]) / 2,
                top + _PANEL_H / 2 - 7,
                "no GPU reading",
                color=_MUTED,
                anchor="ma",
            )
        self._panels.append(panel)
        return panel

    def time_axis(self, span: tuple[float, float]) -> None:
        """Local clock times under the last panel, and a light line per tick across every panel."""
        t0, t1 = span
        step = next((s for s in _STEPS if (t1 - t0) / s <= 9), None)
        step = step or 86400 * math.ceil((t1 - t0) / 86400 / 9)
        offset = time.localtime(t1).tm_gmtoff
        tick = math.ceil((t0 + offset) / step) * step - offset
        fmt = "%H:%M:%S" if step < 60 else "%H:%M" if step < 86400 else "%m-%d"
        while tick <= t1:
            for panel in self._panels:
                x = panel.x(tick)
                self._draw.line((x, _S * panel.y0, x, _S * panel.y1), fill=_GRID, width=_S)
            if self._panels:
                self._text(
                    self._panels[-1].x(tick) / _S,
                    self._axis_top + 5,
                    time.strftime(fmt, time.localtime(tick)),
                    color=_MUTED,
                    font=self._small,
                    anchor="ma",
                )
            tick += step

    def events(self, lines: Sequence[tuple[str, str, str, str]], *, total: int) -> None:
        """The newest events, newest first: clock time, kind (in its colour), details."""
        head = (
            "No events yet"
            if not total
            else ("Events" if total <= len(lines) else f"Events (newest {len(lines)} of {total})")
        )
        self._text(10, self._events_top, head)
        top = self._events_top + _LINE
        self._column(
            10, top, [clock for clock, _k, _d, _c in lines], color=_MUTED, font=self._small
        )
        self._column(250, top, [detail[:120] for _t, _k, detail, _c in lines], font=self._small)
        for k, (_clock, kind, _detail, color) in enumerate(lines):
            self._text(80, top + k * _LINE, kind, color=color, font=self._small)

    def png(self) -> bytes:
        image = self._image.reduce(_S)
        image = image.quantize(colors=64, method=Image.Quantize.FASTOCTREE)
        out = io.BytesIO()
        image.save(out, format="PNG", optimize=False, compress_level=4)
        return out.getvalue()


def _nice(raw: float) -> float:
    """1, 2 or 5 times a power of ten, at least ``raw``."""
    if raw <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
