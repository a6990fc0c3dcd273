"""The live KV buffer view: capacity, the graph's window over it, the valid rows, the slot being written,
and the end pointer's history with a red mark at each compaction.

`KVProbe(engine).snapshot()` reads a few integers from the kv_manager cache (no array is touched); the worker
takes one per token, between steps, and the panel paints it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QBrush, QColor, QFont, QPainter, QPen, QPolygonF
from PySide6.QtWidgets import QLabel, QSizePolicy, QVBoxLayout, QWidget

from staticlm.kv_manager import Strategy
from staticlm.runtime.family.manifest import GraphKind

HISTORY = 600  # end-pointer samples kept for the strip

C_FREE, C_VALID, C_PAD = QColor("#e9ecef"), QColor("#4c8bf5"), QColor("#c9d7f2")
C_WINDOW, C_SLOT, C_COMPACT, C_TEXT = QColor("#f08c00"), QColor("#2f9e44"), QColor("#e03131"), QColor("#343a40")


@dataclass(frozen=True)
class KVSnapshot:
    strategy: str
    capacity: int  # rows in the buffer
    end: int  # the end pointer: the next row to write
    length: int  # valid (committed) rows
    window: int  # P of the graph that runs next (the context ladder's rung)
    slot: int  # rows the next decode step writes at `end`
    max_context: int
    compactions: int
    copied_rows: int
    copied_bytes: int
    reserved_bytes: int

    @property
    def window_start(self) -> int:
        return self.end - self.window

    @property
    def valid_start(self) -> int:
        return self.end - self.length


class KVProbe:
    """Reads the kv_manager's counters for one engine: a handful of integers, never a buffer."""

    def __init__(self, engine) -> None:
        self.engine = engine
        # The decode ladder's windows, smallest first: the engine runs the smallest that holds every row.
        self.windows = tuple(sorted(g.shape.past_len for g in engine.manifest.graphs_of(GraphKind.DECODE)))
        self.strategy = engine.kv_strategy.value
        self.in_place = engine.kv_strategy is Strategy.IN_PLACE

    def window_for(self, length: int) -> int:
        if self.in_place:  # GroupQueryAttention reads exactly the valid rows
            return length
        return next((w for w in self.windows if w >= length), self.windows[-1])

    def snapshot(self) -> KVSnapshot:
        kv = self.engine.kv
        length, s = int(kv.lengths[0]), kv.stats
        return KVSnapshot(strategy=self.strategy, capacity=int(kv.capacity), end=int(kv.ends[0]), length=length,
                          window=self.window_for(length), slot=1, max_context=int(self.engine.max_context),
                          compactions=int(s.num_compactions), copied_rows=int(s.copied_rows),
                          copied_bytes=int(s.copied_bytes), reserved_bytes=int(s.reserved_bytes))


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def numbers_text(s: KVSnapshot) -> str:
    return (f"rows used {s.length} / {s.capacity} capacity · window {s.window} · end {s.end}\n"
            f"copies so far: {s.compactions} compaction{'s' if s.compactions != 1 else ''}, "
            f"{s.copied_rows} rows, {_bytes(s.copied_bytes)} · reserved {_bytes(s.reserved_bytes)}")


class KVBufferCanvas(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.snapshot: KVSnapshot | None = None
        self.ends: deque[int] = deque(maxlen=HISTORY)
        self.marks: deque[int] = deque(maxlen=64)  # sample indices (absolute) of compactions
        self.num_samples = 0
        self.setMinimumHeight(150)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(420, 160)

    def push(self, snap: KVSnapshot) -> None:
        prev = self.snapshot
        if prev is not None and snap.compactions > prev.compactions:
            self.marks.append(self.num_samples)
        self.snapshot = snap
        self.ends.append(snap.end)
        self.num_samples += 1
        self.update()

    def paintEvent(self, _event) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        w, h = self.width(), self.height()
        p.fillRect(0, 0, w, h, QColor("#ffffff"))
        s = self.snapshot
        font = QFont(self.font())
        font.setPointSizeF(max(7.0, font.pointSizeF() * 0.85))
        p.setFont(font)
        if s is None or s.capacity <= 0:
            p.setPen(C_TEXT)
            p.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, "no model loaded")
            return
        left, right = 8.0, w - 8.0
        scale = (right - left) / s.capacity

        def x(row: float) -> float:
            return left + max(0.0, min(float(s.capacity), row)) * scale

        # the buffer, with the window (orange outline), its padding, the valid rows and the slot
        top, bar_h = 22.0, 30.0
        p.setPen(C_TEXT)
        p.drawText(QRectF(left, 2, right - left, 18), Qt.AlignmentFlag.AlignLeft,
                   f"KV buffer · {s.capacity} rows ({s.strategy})")
        p.fillRect(QRectF(left, top, right - left, bar_h), C_FREE)
        p.fillRect(QRectF(x(s.window_start), top, x(s.valid_start) - x(s.window_start), bar_h),
                   QBrush(C_PAD, Qt.BrushStyle.BDiagPattern))
        p.fillRect(QRectF(x(s.valid_start), top, x(s.end) - x(s.valid_start), bar_h), C_VALID)
        p.fillRect(QRectF(x(s.end), top, max(2.0, x(s.end + s.slot) - x(s.end)), bar_h), C_SLOT)
        p.setPen(QPen(C_WINDOW, 2.0))
        p.setBrush(Qt.BrushStyle.NoBrush)
        p.drawRect(QRectF(x(s.window_start), top - 4, x(s.end) - x(s.window_start), bar_h + 8))
        p.setPen(QPen(QColor("#868e96"), 1.0))
        p.drawRect(QRectF(left, top, right - left, bar_h))
        p.setPen(C_TEXT)
        p.drawText(QRectF(left, top + bar_h + 4, 60, 14), Qt.AlignmentFlag.AlignLeft, "0")
        end_label = QRectF(x(s.end) - 40, top + bar_h + 4, 80, 14)
        if end_label.right() < right - 40:  # the capacity is in the title too: the end pointer's label wins
            p.drawText(QRectF(right - 60, top + bar_h + 4, 60, 14), Qt.AlignmentFlag.AlignRight, str(s.capacity))
        else:
            end_label.moveRight(right)
        p.drawText(end_label, Qt.AlignmentFlag.AlignRight if end_label.right() >= right else
                   Qt.AlignmentFlag.AlignHCenter, f"end {s.end}")

        # legend
        ly = top + bar_h + 22
        lx = left
        for color, label, outline in ((C_VALID, "valid", False), (C_PAD, "padding", False),
                                      (C_WINDOW, "window", True), (C_SLOT, "slot", False),
                                      (C_COMPACT, "compaction", False)):
            if outline:
                p.setPen(QPen(color, 2.0))
                p.drawRect(QRectF(lx, ly + 2, 10, 10))
            else:
                p.fillRect(QRectF(lx, ly + 2, 10, 10), color)
            p.setPen(C_TEXT)
            p.drawText(QRectF(lx + 14, ly, 80, 14), Qt.AlignmentFlag.AlignLeft, label)
            lx += 14 + p.fontMetrics().horizontalAdvance(label) + 12

        # the end pointer over time: a sawtooth under pointer-offset shifts, red where it compacted
        st, sh = ly + 20, h - (ly + 20) - 4
        if sh < 16:
            return
        p.fillRect(QRectF(left, st, right - left, sh), QColor("#f8f9fa"))
        n = len(self.ends)
        first = self.num_samples - n
        span = max(n - 1, 1)
        dx = (right - left) / max(span, 60)
        p.setPen(QPen(C_COMPACT, 1.5))
        for m in self.marks:
            if m >= first:
                mx = left + (m - first) * dx
                p.drawLine(int(mx), int(st), int(mx), int(st + sh))
        p.setPen(QPen(C_VALID, 1.5))
        p.drawPolyline(QPolygonF([QPointF(left + i * dx, st + sh - 1 - min(e, s.capacity) / s.capacity * (sh - 2))
                                  for i, e in enumerate(self.ends)]))
        p.setPen(QColor("#868e96"))
        p.drawText(QRectF(left + 4, st + sh - 15, right - left - 8, 14), Qt.AlignmentFlag.AlignRight,
                   "end pointer per token")
        p.end()


class KVPanel(QWidget):
    """The canvas plus the numbers, updated from the worker's per-token snapshots."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.canvas = KVBufferCanvas(self)
        self.numbers = QLabel("no model loaded")
        self.numbers.setWordWrap(True)
        self.numbers.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.canvas)
        layout.addWidget(self.numbers)

    @property
    def snapshot(self) -> KVSnapshot | None:
        return self.canvas.snapshot

    def push(self, snap: KVSnapshot) -> None:
        self.canvas.push(snap)
        self.numbers.setText(numbers_text(snap))
