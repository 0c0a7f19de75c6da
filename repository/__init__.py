"""Triton model repository: scanning, config.pbtxt parsing, version policy (no Ray)."""
