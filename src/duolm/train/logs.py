"""Run logs with no extra dependency: metrics.jsonl, TensorBoard event files, a loss-curve PNG.

TensorBoard reads TFRecord files of `Event` protobufs. We write the three messages we need by hand:
  Event   {1: wall_time double, 2: step int64, 3: file_version string, 5: summary Summary}
  Summary {1: repeated Value};  Value {1: tag string, 2: simple_value float}
Each record is: uint64 length, uint32 masked_crc32c(length), data, uint32 masked_crc32c(data).
"""
from __future__ import annotations

import json
import math
import os
import socket
import struct
import time
import zlib
from pathlib import Path

# --- metrics.jsonl ------------------------------------------------------------------------------


class JsonlWriter:
    """Appends one JSON object per line and flushes it, so a killed run keeps every finished row."""

    def __init__(self, path: Path, keep_until_step: int | None = None):
        self.path = Path(path)
        if keep_until_step is not None and self.path.exists():
            # resuming: rows past the checkpoint were computed by the killed run and are computed again
            rows = [r for r in read_jsonl(self.path) if r.get("step", 0) <= keep_until_step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            os.replace(tmp, self.path)
        self.f = open(self.path, "a")

    def write(self, row: dict):
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()

    def close(self):
        self.f.close()


def read_jsonl(path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            pass
    return rows


# --- TensorBoard event files ----------------------------------------------------------------------

def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC32C[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, wire: int, payload: bytes) -> bytes:
    key = _varint(num << 3 | wire)
    return key + (_varint(len(payload)) + payload if wire == 2 else payload)


def _event(wall_time: float, step: int = 0, file_version: str | None = None, scalars: dict | None = None) -> bytes:
    msg = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
    if file_version is not None:
        msg += _field(3, 2, file_version.encode())
    if scalars:
        values = b"".join(_field(1, 2, _field(1, 2, tag.encode()) + _field(2, 5, struct.pack("<f", float(v))))
                          for tag, v in scalars.items())
        msg += _field(5, 2, values)
    return msg


class TensorBoardWriter:
    """Writes scalar summaries to RUN/tb/events.out.tfevents.<time>.<host>.<pid>."""

    def __init__(self, logdir: Path):
        Path(logdir).mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = Path(logdir) / name
        self.f = open(self.path, "ab")
        self._record(_event(time.time(), file_version="brain.Event:2"))

    def _record(self, data: bytes):
        header = struct.pack("<Q", len(data))
        self.f.write(header + struct.pack("<I", _masked_crc(header)) + data + struct.pack("<I", _masked_crc(data)))
        self.f.flush()

    def scalars(self, step: int, values: dict):
        finite = {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if finite:
            self._record(_event(time.time(), step=step, scalars=finite))

    def close(self):
        self.f.close()


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    """The varint at buf[i:]: (value, index after it)."""
    v, shift = 0, 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, i


def _parse(buf: bytes) -> dict[int, list]:
    """Minimal protobuf decoder: field number -> list of raw values (int, bytes, or 4/8-byte bytes)."""
    out, i = {}, 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _read_varint(buf, i)
        elif wire == 1:
            v, i = buf[i:i + 8], i + 8
        elif wire == 5:
            v, i = buf[i:i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(buf, i)
            v, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.setdefault(num, []).append(v)
    return out


def read_scalars(path) -> list[tuple[int, str, float]]:
    """Reads an event file back (checking every CRC): [(step, tag, value), ...]."""
    data, i, out = Path(path).read_bytes(), 0, []
    while i < len(data):
        header = data[i:i + 8]
        (n,) = struct.unpack("<Q", header)
        if struct.unpack("<I", data[i + 8:i + 12])[0] != _masked_crc(header):
            raise ValueError(f"{path}: bad length CRC at byte {i}")
        rec = data[i + 12:i + 12 + n]
        if struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] != _masked_crc(rec):
            raise ValueError(f"{path}: bad data CRC at byte {i}")
        i += 16 + n
        ev = _parse(rec)
        for summary in ev.get(5, []):
            for value in _parse(summary).get(1, []):
                v = _parse(value)
                out.append((ev.get(2, [0])[0], v[1][0].decode(), struct.unpack("<f", v[2][0])[0]))
    return out


# --- loss-curve PNG -----------------------------------------------------------------------------

def _png(pixels: bytearray, w: int, h: int) -> bytes:
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    raw = b"".join(b"\x00" + bytes(pixels[y * w * 3:(y + 1) * w * 3]) for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


# 3x5 pixel font: a glyph is 5 rows, each row one octal digit whose bits are its 3 pixels (4 = left).
_FONT = dict(zip("0123456789.-+aeilnoprstv", (
    "75557 26227 71747 71317 55711 74717 74757 71122 75757 75717 00002 00700 02720 "
    "06137 02563 20222 62227 06555 02552 06564 05644 03416 27223 05552").split()))


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round axis-tick values in [lo, hi]: the multiples of the finest 1-2-5 step (.., 0.1, 0.2, 0.5, 1, 2, ..)
    that give 3 to n ticks (else the finest giving at most n).

    nice_ticks(3.21, 7.63): steps 0.1, 0.2, 0.5 give 41, 22, 9 ticks; step 1 gives [4, 5, 6, 7].
    """
    if not hi > lo:
        return [lo]
    e = math.floor(math.log10((hi - lo) / n))
    cands = [[round(i * s, max(0, -e)) for i in range(math.ceil(lo / s - 1e-9), math.floor(hi / s + 1e-9) + 1)]
             for s in (m * 10.0 ** k for k in (e, e + 1) for m in (1, 2, 5))]
    return next((t for t in cands if 3 <= len(t) <= n), None) or next(t for t in cands if len(t) <= n)


def plot_curves(path, curves: dict[str, list[tuple[float, float]]], width: int = 640, height: int = 400):
    """Draws each (step, value) series as a polyline on a white canvas: frame, grid and tick labels at
    nice_ticks values, axis titles "step" / "loss", and a legend in the top right corner.

    Colours in order: blue, orange, green, red (the legend is the order of `curves`; train first).
    Written atomically.
    """
    colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]
    black, grey = (0, 0, 0), (225, 225, 225)
    px = bytearray(b"\xff" * (width * height * 3))
    left, right, top, bottom = 40, width - 20, 32, height - 44
    pts = [(x, y) for c in curves.values() for x, y in c if math.isfinite(y)]

    def put(x, y, col):
        if 0 <= x < width and 0 <= y < height:
            o = (y * width + x) * 3
            px[o:o + 3] = bytes(col)

    def line(x0, y0, x1, y1, col):
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            put(x0, y0, col)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy; x0 += sx
            if e2 <= dx:
                err += dx; y0 += sy

    def rect(x0, y0, w, h, col):
        for y in range(y0, y0 + h):
            line(x0, y, x0 + w - 1, y, col)

    def text(x, y, s, col=black):  # top-left corner at (x, y); each font pixel drawn 2x2
        for i, ch in enumerate(s):
            for r, row in enumerate(_FONT.get(ch, "00000")):
                for c in range(3):
                    if int(row) >> (2 - c) & 1:
                        rect(x + 8 * i + 2 * c, y + 2 * r, 2, 2, col)

    tw = lambda s: 8 * len(s) - 2  # pixel width of `s`
    if pts:
        xmin, xmax = min(p[0] for p in pts), max(p[0] for p in pts)
        ymin, ymax = min(p[1] for p in pts), max(p[1] for p in pts)
        xmax, ymax = (xmax if xmax > xmin else xmin + 1), (ymax if ymax > ymin else ymin + 1)
        yticks, xticks = nice_ticks(ymin, ymax), nice_ticks(xmin, xmax)
        left = 14 + max(tw(f"{v:g}") for v in yticks)
        sx = lambda x: left + round((x - xmin) / (xmax - xmin) * (right - left))
        sy = lambda y: bottom - round((y - ymin) / (ymax - ymin) * (bottom - top))
        for v in yticks:
            line(left, sy(v), right, sy(v), grey)
            line(left - 4, sy(v), left - 1, sy(v), black)
            text(left - 7 - tw(f"{v:g}"), sy(v) - 5, f"{v:g}")
        for v in xticks:
            line(sx(v), top, sx(v), bottom, grey)
            line(sx(v), bottom + 1, sx(v), bottom + 4, black)
            text(min(sx(v) - tw(f"{v:g}") // 2, width - 2 - tw(f"{v:g}")), bottom + 8, f"{v:g}")
        for color, series in zip(colors * 4, curves.values()):
            s = [(sx(x), sy(y)) for x, y in series if math.isfinite(y)]
            for (x0, y0), (x1, y1) in zip(s, s[1:]):
                line(x0, y0, x1, y1, color)
            if len(s) == 1:
                line(s[0][0] - 1, s[0][1], s[0][0] + 1, s[0][1], color)
        # legend: a swatch and the name of each curve, on white, in the top right corner
        lx = right - 30 - max(tw(name) for name in curves)
        rect(lx - 8, top + 1, right - lx + 7, 16 * len(curves) + 10, (255, 255, 255))
        for i, (color, name) in enumerate(zip(colors * 4, curves)):
            rect(lx, top + 13 + 16 * i, 14, 3, color)
            text(lx + 20, top + 10 + 16 * i, name)
        text((left + right) // 2 - tw("step") // 2, bottom + 26, "step")
        text(max(2, left - 7 - tw("loss")), top - 24, "loss")
    for a, b in (((left, top), (right, top)), ((right, top), (right, bottom)),
                 ((right, bottom), (left, bottom)), ((left, bottom), (left, top))):
        line(*a, *b, black)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(_png(px, width, height))
    os.replace(tmp, path)
