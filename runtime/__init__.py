"""The speculative-decoding runtime — importable as ``paradraft.runtime``."""
