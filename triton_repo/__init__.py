"""Triton model-repository templates (``paradraft serve`` fills them in for an engine set)."""
