"""SlotCache: a running batch's KV cache in fixed buffers that the model writes in place.

A decoder in the shared-buffer layout (ONNX Runtime's GroupQueryAttention with past and
present bound to the same memory; tools/build_smollm2.py writes one) takes per layer one buffer
[row_capacity, kv_heads, capacity, head_dim] for keys and one for values. Row r of the batch
lives in slot r, its tokens in columns 0 .. lengths[r] - 1; a decode step writes each row's new
token at column lengths[r] and copies nothing else, where the Optimum layout returns a new cache
with every past token copied (docs/rag.md, "The cache in place"). Rows joining are copied in
once; rows leaving are closed up by moving the rows behind them. The buffers grow (rows to the
next power of two, columns by half again, in steps of COLUMN_STEP), never past the rows and
columns admission reserved (limit()), and shrink when less than half is used, so the memory held
follows the batch. Growing past the memory there is raises OutOfMemory (the sequences of that
step fail, the rest of the model serves on). Each buffer is an anonymous memory mapping of its
own, so the memory a shrink or a finished batch frees leaves the process at once (docs/rag.md,
"KV memory: the estimate against RSS").

Thread: used by the generation worker thread only.
"""

from __future__ import annotations

import math
import mmap

import numpy as np

from ..errors import OutOfMemory
from .kv import COLUMN_STEP, round_up

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux


def _rows_for(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def mapped_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros in an anonymous mapping of their own, unmapped when the last view goes. From
    numpy's allocator, glibc serves buffers up to its dynamic mmap threshold (raised to the size
    of the largest mapped block freed so far, up to 32 MiB) from the heap, and keeps them there
    when freed while anything allocated later sits above them: a finished batch's cache stayed
    in the process (+217 MiB against a reservation already given back, measured)."""
    count = math.prod(shape)
    try:  # populated: every page resident now, as the memory budget counts it (decode_loop._show)
        mapping = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE | _POPULATE)
    except (OSError, OverflowError) as exc:  # what np.zeros says as MemoryError
        raise MemoryError(f"cannot map {count * dtype.itemsize} bytes: {exc}") from exc
    return np.frombuffer(mapping, dtype=dtype, count=count).reshape(shape)


class SlotCache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: np.dtype, rows: int, columns: int,
                 max_columns: int):
        self._shape = (kv_heads, head_dim)
        self.dtype = np.dtype(dtype)
        self.context = max_columns  # the model's context: no row ever needs more columns
        self.max_columns = max_columns
        self.max_rows = 0  # 0: no limit on growth by rows
        self.buffers = [self._new(rows, columns) for _ in range(2 * layers)]
        self.lengths = np.zeros(0, dtype=np.int64)

    def _new(self, rows: int, columns: int) -> np.ndarray:
        kv_heads, head_dim = self._shape
        return mapped_zeros((rows, kv_heads, columns, head_dim), self.dtype)

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def row_capacity(self) -> int:
        return min(int(b.shape[0]) for b in self.buffers)

    @property
    def width(self) -> int:
        """Columns allocated per row: the most tokens a row can hold before the buffers grow."""
        return min(int(b.shape[2]) for b in self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buffers)

    def views(self) -> list[np.ndarray]:
        """The running rows of every buffer (contiguous: slots 0 .. rows - 1)."""
        return [b[: self.rows] for b in self.buffers]

    def limit(self, rows: int, columns: int) -> None:
        """Grow to at most `rows` rows and `columns` columns (whole COLUMN_STEPs, within the
        context) from now on, unless a fit asks for more itself."""
        self.max_rows = rows
        self.max_columns = max(columns, min(round_up(columns, COLUMN_STEP), self.context))

    def fit(self, rows: int, columns: int) -> None:
        """Make room for `rows` rows of `columns` tokens each, keeping what the running rows
        hold; give memory back when less than half of either dimension is needed."""
        have_rows, have_columns = self.row_capacity, self.width
        want_rows = have_rows if rows <= have_rows else _rows_for(rows)
        if rows * 2 <= have_rows and have_rows > 1:
            want_rows = _rows_for(rows)
        want_columns = have_columns
        if columns > have_columns:
            want_columns = round_up(max(columns, have_columns + have_columns // 2), COLUMN_STEP)
        elif columns * 2 <= have_columns and have_columns > COLUMN_STEP:
            want_columns = round_up(columns, COLUMN_STEP)
        want_columns = max(min(want_columns, self.max_columns), columns)
        if self.max_rows and (want_rows, want_columns) != (have_rows, have_columns):
            want_rows = max(rows, min(want_rows, self.max_rows))  # rows no longer admitted are not copied on
        n, used = self.rows, int(self.lengths.max(initial=0))
        try:
            for i, old in enumerate(self.buffers):  # one at a time: at most one buffer held twice
                if (old.shape[0], old.shape[2]) != (want_rows, want_columns):
                    new = self._new(want_rows, want_columns)
                    new[:n, :, :used] = old[:n, :, :used]
                    self.buffers[i] = new
        except MemoryError as exc:
            if rows <= have_rows and columns <= have_columns:
                return  # giving memory back is optional; the rows still fit where they are
            need = want_rows * want_columns * self.buffers[0][0, :, 0].nbytes * len(self.buffers)
            raise OutOfMemory(f"the KV cache could not grow to {want_rows} rows x {want_columns} tokens "
                              f"({need / (1 << 20):.1f} MiB): {exc}") from exc

    def join(self, new: SlotCache) -> SlotCache:
        """`new`'s rows appended after this batch's (copied into this batch's buffers)."""
        n, k = self.rows, new.rows
        self.fit(n + k, int(max(self.lengths.max(initial=0), new.lengths.max(initial=0))))
        for mine, theirs in zip(self.buffers, new.buffers):
            for r in range(k):
                length = int(new.lengths[r])
                mine[n + r, :, :length] = theirs[r, :, :length]
        self.lengths = np.concatenate([self.lengths, new.lengths])
        return self

    def keep(self, rows: list[int]) -> SlotCache | None:
        """Only the given rows, in that order, moved to slots 0 .. len(rows) - 1."""
        if not rows:
            return None
        if rows == sorted(rows):  # each row moves down or stays: in place, front to back
            for slot, row in enumerate(rows):
                if slot != row:
                    length = int(self.lengths[row])
                    for b in self.buffers:
                        b[slot, :, :length] = b[row, :, :length]
        else:
            index = np.asarray(rows, dtype=np.int64)
            for b in self.buffers:
                b[: len(rows)] = b[index]
        self.lengths = self.lengths[np.asarray(rows, dtype=np.int64)]
        self.fit(len(rows), int(self.lengths.max()))
        return self
