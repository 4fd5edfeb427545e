"""Optimize stage: graph passes and the pass pipeline."""
