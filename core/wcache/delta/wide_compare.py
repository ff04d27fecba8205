"""Where two equal-length byte buffers of one dtype differ, compared eight bytes at a time: the changed elements.

The bytes are compared as 64-bit words first (a quarter of the comparisons for bf16, an eighth for int8 and
fp8), and only inside the few words that differ element by element; every comparison is on bit patterns, so
-0.0 against 0.0 or two NaNs with different payloads count as changed and equal bit patterns never do.
"""

from __future__ import annotations

import numpy as np

from wcache.delta.format import BITS

WORD_BYTES = 8


class ChangedElements:
    """The changed elements of one buffer pair, for a tensor whose elements are `itemsize` bytes.

    `scratch` (one per comparing thread) is reused for the word comparison's result, so comparing allocates
    only what it returns.
    """

    def __init__(self, itemsize: int, scratch: np.ndarray) -> None:
        if WORD_BYTES % itemsize:
            raise ValueError(f"an element of {itemsize} bytes does not divide a {WORD_BYTES}-byte word")
        self.itemsize = itemsize
        self.bits = np.dtype(BITS[itemsize])
        self.per_word = WORD_BYTES // itemsize
        self._shift = self.per_word.bit_length() - 1
        self._scratch = scratch

    def find(self, before: np.ndarray, after: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray]:
        """The changed elements between `before` and `after` (uint8 buffers of the same length, a whole number
        of elements, 8-byte aligned): their indices counted from element `first` (int64, ascending) and their
        new bit patterns."""
        words = len(before) // WORD_BYTES
        head = words * WORD_BYTES
        found_at: list[np.ndarray] = []
        found: list[np.ndarray] = []
        if words:
            old_words, new_words = before[:head].view(np.uint64), after[:head].view(np.uint64)
            differs = self._scratch[:words]
            np.not_equal(old_words, new_words, out=differs)
            changed_words = np.flatnonzero(differs)
            if changed_words.size:
                # Integer gathers, not boolean masks: numpy's masked indexing costs several times more.
                old_elements = old_words[changed_words].view(self.bits)
                new_elements = new_words[changed_words].view(self.bits)
                lanes = np.flatnonzero(old_elements != new_elements)
                # Shifts and masks: numpy divides int64 slowly, and a word holds a power of two of elements.
                at = changed_words[lanes >> self._shift]
                at <<= self._shift
                at |= lanes & (self.per_word - 1)
                found_at.append(at)
                found.append(new_elements[lanes])
        if head < len(before):  # the tail shorter than a word: a size that is not a multiple of 8 bytes
            old_tail, new_tail = before[head:].view(self.bits), after[head:].view(self.bits)
            tail_changed = np.flatnonzero(old_tail != new_tail)
            found_at.append(tail_changed + head // self.itemsize)
            found.append(new_tail[tail_changed])
        if not found_at:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=self.bits)
        indices = np.concatenate(found_at) if len(found_at) > 1 else found_at[0]
        values = np.concatenate(found) if len(found) > 1 else found[0]
        if first:
            indices += first
        return indices, values
