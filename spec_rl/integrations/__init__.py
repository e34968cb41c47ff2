"""Adapters that plug spec-rl's speculative rollouts into existing RL trainers.

Each adapter lives in its own module and imports its trainer library lazily, so
importing ``spec_rl.integrations`` never requires any of them:

- :mod:`spec_rl.integrations.trl`: ``trl.GRPOTrainer`` through its ``rollout_func`` hook.
"""
