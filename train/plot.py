"""The memory-over-steps plot, as a PNG, with no plotting library.

A pod image should not need matplotlib for a smoke run, so this draws lines and a 5x7 bitmap
font into an RGB buffer and writes it with zlib. Enough for "where did memory go, and how does
it compare with the prediction and the limit", which is all the plot has to say.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

# 5x7 glyphs, one row per string, '#' set. Upper case only: labels are upper-cased.
_FONT = {
    "0": ".###.#...##..###.#.###..##...#.###.", "1": "..#...##....#....#....#....#...###.",
    "2": ".###.#...#....#...#...#...#...#####", "3": "#####...#...#.....#.....##...#.###.",
    "4": "...#...##..#.#.#..#.#####...#....#.", "5": "#####.....####.....#....##...#.###.",
    "6": "..##..#...#....####.#...##...#.###.", "7": "#####....#...#...#...#....#....#...",
    "8": ".###.#...##...#.###.#...##...#.###.", "9": ".###.#...##...#.####....#...#..##..",
    "A": ".###.#...##...#######...##...##...#", "B": "####.#...##...#####.#...##...#####.",
    "C": ".###.#...##....#....#....#...#.###.", "D": "####.#...##...##...##...##...#####.",
    "E": "######....#....####.#....#....#####", "F": "######....#....####.#....#....#....",
    "G": ".###.#...##....#.####...##...#.####", "H": "#...##...##...#######...##...##...#",
    "I": ".###...#....#....#....#....#...###.", "K": "#...##..#.#.#..##...#.#..#..#.#...#",
    "L": "#....#....#....#....#....#....#####", "M": "#...###.###.#.##...##...##...##...#",
    "N": "#...###..##.#.##..###...##...##...#", "O": ".###.#...##...##...##...##...#.###.",
    "P": "####.#...##...#####.#....#....#....", "R": "####.#...##...#####.#.#..#..#.#...#",
    "S": ".####.....#.....###.....#....#####.", "T": "#####..#....#....#....#....#....#..",
    "U": "#...##...##...##...##...##...#.###.", "V": "#...##...##...##...##...#.#.#...#..",
    "W": "#...##...##...##.#.##.#.##.#.#.#.#.", "X": "#...##...#.#.#...#...#.#.#...##...#",
    "Y": "#...##...#.#.#...#....#....#....#..", "Z": "#####....#...#...#...#...#....#####",
    ".": "..............................##...", "-": "................###................",
    "/": "....#....#...#...#...#...#....#....", "%": "##..###..#...#...#...#...#..###..##",
    "(": "...#...#...#....#....#.....#.....#.", ")": ".#.....#.....#....#....#...#...#...",
    ":": ".......#...................#.......", " ": "." * 35, "=": "..........#####.....#####..........",
    "J": "..###...#....#....#....#.#..#..##..", "Q": ".###.#...##...##...##.#.##..#..##.#",
}

WHITE, BLACK, GREY = (255, 255, 255), (40, 40, 40), (215, 215, 215)
COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]


@dataclass
class Series:
    label: str
    points: list[tuple[float, float]]  # (step, value)
    dashed: bool = False


class Canvas:
    def __init__(self, width: int, height: int):
        self.w, self.h = width, height
        self.px = bytearray(WHITE * (width * height))

    def set(self, x: int, y: int, rgb) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i: i + 3] = bytes(rgb)

    def line(self, x0, y0, x1, y1, rgb, thick: int = 1, dashed: bool = False) -> None:
        x0, y0, x1, y1 = int(round(x0)), int(round(y0)), int(round(x1)), int(round(y1))
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, n = dx + dy, 0
        while True:
            if not dashed or (n // 6) % 2 == 0:
                for t in range(thick):
                    self.set(x0, y0 + t, rgb)
                    self.set(x0 + t, y0, rgb)
            if x0 == x1 and y0 == y1:
                break
            e2, n = 2 * err, n + 1
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, s: str, rgb=BLACK, scale: int = 1) -> None:
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT[" "])
            for i, c in enumerate(glyph):
                if c == "#":
                    for a in range(scale):
                        for b in range(scale):
                            self.set(x + (i % 5) * scale + a, y + (i // 5) * scale + b, rgb)
            x += 6 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * self.w * y: 3 * self.w * (y + 1)]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def _nice_step(span: float, ticks: int = 5) -> float:
    raw = span / ticks
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def line_plot(path: str, title: str, series: list[Series], unit: str = "GIB", scale: float = 1 << 30,
              width: int = 720, height: int = 400) -> None:
    """Write a line plot of the series (values divided by `scale`) to `path`."""
    c = Canvas(width, height)
    left, right, top, bottom = 70, width - 20, 40, height - 70
    pts = [(x, y / scale) for s in series for x, y in s.points]
    xs = [p[0] for p in pts] or [0, 1]
    ys = [p[1] for p in pts] or [0, 1]
    x_lo, x_hi = min(xs), max(max(xs), min(xs) + 1)
    y_hi = max(ys) * 1.1 or 1.0
    ystep = _nice_step(y_hi)
    y_hi = ystep * (int(y_hi / ystep) + 1)

    def X(v):
        return left + (v - x_lo) / (x_hi - x_lo) * (right - left)

    def Y(v):
        return bottom - v / y_hi * (bottom - top)

    c.text(left, 12, title, scale=2)
    k = 0
    while k * ystep <= y_hi + 1e-9:
        y = Y(k * ystep)
        c.line(left, y, right, y, GREY)
        c.text(5, int(y) - 3, f"{k * ystep:g}")
        k += 1
    c.line(left, top, left, bottom, BLACK)
    c.line(left, bottom, right, bottom, BLACK)
    for i in range(6):
        v = x_lo + (x_hi - x_lo) * i / 5
        c.text(int(X(v)) - 6, bottom + 6, f"{v:.0f}")
    c.text((left + right) // 2 - 12, bottom + 18, "STEP")
    c.text(5, top - 12, unit)
    for i, s in enumerate(series):
        rgb = COLOURS[i % len(COLOURS)]
        p = sorted(s.points)
        scaled = [(X(x), Y(y / scale)) for x, y in p]
        for (x0, y0), (x1, y1) in zip(scaled, scaled[1:]):
            c.line(x0, y0, x1, y1, rgb, thick=2, dashed=s.dashed)
        for x0, y0 in scaled if len(scaled) < 30 else []:
            for d in range(-2, 3):
                c.set(int(x0) + d, int(y0), rgb)
                c.set(int(x0), int(y0) + d, rgb)
        lx, ly = left + (i % 3) * 210, height - 32 + (i // 3) * 14
        c.line(lx, ly + 3, lx + 18, ly + 3, rgb, thick=2, dashed=s.dashed)
        c.text(lx + 24, ly, s.label)
    with open(path, "wb") as f:
        f.write(c.png())
