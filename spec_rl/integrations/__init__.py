"""Adapters that plug spec-rl's speculative rollouts into existing RL trainers (TRL, verl, OpenRLHF).

Layer 9: may import every layer below (util .. trainer). Each adapter is its own module, so importing
``spec_rl.integrations`` needs none of the trainer libraries (docs/integrations.md)."""
