"""``spec_rl.integrations.verl_metrics.rollout_metrics``: the step totals verl's trainer logs for spec_rl_agent.

Needs verl (``make test-verl``); skipped elsewhere unless SPEC_RL_REQUIRE_VERL=1.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

if os.environ.get("SPEC_RL_REQUIRE_VERL") == "1":
    import verl.experimental.agent_loop.agent_loop  # noqa: F401
pytest.importorskip("verl.experimental.agent_loop.agent_loop", reason="verl is not installed here (make test-verl)")

from spec_rl.integrations.verl_metrics import SAMPLE_FIELDS, rollout_metrics  # noqa: E402


def columns(**values):
    """A generated batch's non_tensor_batch: object arrays, as verl builds them from extra_fields."""
    out = {}
    for name, vals in values.items():
        arr = np.empty(len(vals), dtype=object)
        arr[:] = vals
        out[f"spec_rl/{name}"] = arr
    return out


def test_totals_and_ratios():
    # 4 samples: no draft (10 generated); whole reuse of 6; 3 of a 5-token draft then 4 generated; a draft of 2
    # rejected at 0 then 5 generated with one discarded resample (exact)
    batch = columns(
        draft_found=[False, True, True, True], draft_len=[0, 6, 5, 2], verified_prefix_len=[0, 6, 3, 0],
        full_reuse=[False, True, False, False], tokens_generated=[10, 0, 4, 5], response_len=[10, 6, 7, 5],
        resamples=[0, 0, 0, 1],
    )  # fmt: skip
    m = rollout_metrics(batch)
    assert m == {
        "spec_rl/samples": 4.0, "spec_rl/draft_found_ratio": 0.75, "spec_rl/full_reuse_ratio": 0.25,
        "spec_rl/reused_tokens": 9.0, "spec_rl/tokens_generated": 19.0, "spec_rl/response_tokens": 28.0,
        "spec_rl/draft_tokens": 13.0, "spec_rl/reused_token_ratio": 9 / 28, "spec_rl/accepted_draft_ratio": 9 / 13,
        "spec_rl/mean_verified_prefix": 3.0, "spec_rl/resamples": 1.0,
    }  # fmt: skip


def test_no_columns_no_metrics_and_partial_columns_refused():
    assert rollout_metrics({"responses": np.zeros(3)}) == {}  # validation batches, other agent loops
    batch = columns(**{f: [0] for f in SAMPLE_FIELDS})
    del batch["spec_rl/resamples"]
    with pytest.raises(ValueError, match="spec_rl/resamples"):
        rollout_metrics(batch)
    batch = columns(**{f: [0, 0] for f in SAMPLE_FIELDS})
    batch["spec_rl/draft_len"] = batch["spec_rl/draft_len"][:1]
    with pytest.raises(ValueError, match="differ in length"):
        rollout_metrics(batch)
