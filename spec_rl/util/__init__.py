"""Shared utilities: argument validation, atomic file writes, what a model config says about its attention.
Layer 0: may import nothing of spec_rl."""
