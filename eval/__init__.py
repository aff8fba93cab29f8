"""Evaluation entry points (python -m eval.<name>)."""
