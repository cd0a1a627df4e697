"""paradraft: speculative decoding with a parallel draft model and causal correction."""

__version__ = "0.1.0"
