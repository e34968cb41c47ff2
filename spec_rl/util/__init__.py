"""Shared utilities: argument validation, atomic file writes, fault points for crash tests.
Layer 0: may import nothing of spec_rl."""
