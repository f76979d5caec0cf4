"""The byte pattern every test side (Python target, C target, initiator) computes."""

import numpy as np


def pattern(seed: int, length: int) -> bytes:
    """(i * 131 + seed) mod 251 for i in range(length): 251 is prime, so no period divides a
    power of two and a misplaced chunk shows."""
    i = np.arange(length, dtype=np.uint64)
    return ((i * 131 + seed) % 251).astype(np.uint8).tobytes()
