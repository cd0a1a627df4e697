"""Torch's intra-op thread count around the decoder's own ops."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def glue_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads (None: as they are).

    torch's thread count is process-wide: another thread whose first torch op falls inside
    the block keeps ``n`` threads. The decoder's caller (the CLI, the server's one
    scheduler thread) is the process's only heavy torch user, so this is safe there; an
    application running its own torch work in other threads should set the count itself."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
