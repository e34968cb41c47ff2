"""Shared utilities: argument validation, atomic file writes, fault points for the kill tests.

Layer 0: may import nothing of spec_rl (the lowest layer).
"""
