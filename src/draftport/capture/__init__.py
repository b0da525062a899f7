"""Capture: the target writes the training data (regeneration) and its hidden states (a checksummed, resumable store)."""
