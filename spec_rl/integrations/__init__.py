"""Adapters that plug spec-rl's speculative rollouts into existing RL trainers (TRL, verl, OpenRLHF).
Layer 10: may import every layer below (util .. trainer).

Each adapter lives in its own module and imports its trainer library lazily, so
importing ``spec_rl.integrations`` never requires any of them:

- :mod:`spec_rl.integrations.trl`: ``trl.GRPOTrainer`` through its ``rollout_func`` hook (with
  :mod:`~spec_rl.integrations.trl_checks`, :mod:`~spec_rl.integrations.trl_batch`,
  :mod:`~spec_rl.integrations.trl_rollout` and :mod:`~spec_rl.integrations.trl_checkpoint`).
- :mod:`spec_rl.integrations.verl`: a verl agent loop (``spec_rl_agent``) against vLLM/SGLang rollout servers.
- :mod:`spec_rl.integrations.openrlhf`: an OpenRLHF agent executor.
- :mod:`spec_rl.integrations.requests` (framework-neutral per-sample requests, with
  :mod:`~spec_rl.integrations.request_types` and :mod:`~spec_rl.integrations.server_checks`),
  :mod:`spec_rl.integrations.exact` (exact acceptance: its options and the residual draw on a server) and
  :mod:`spec_rl.drafts.directory` (a draft cache shared by many processes through a directory).
"""
