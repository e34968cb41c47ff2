"""``spec_rl.integrations.verl_metrics.rollout_metrics``: the step totals verl's trainer logs for spec_rl_agent.

Needs verl (``make test-vllm``, .venv-vllm); skipped elsewhere unless SPEC_RL_REQUIRE=1.
"""

from __future__ import annotations

import numpy as np
import pytest
from optional import require

pytestmark = [pytest.mark.engines]
require("verl.experimental.agent_loop.agent_loop")

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
    # rejected at 0 then 5 generated with one discarded resample (exact); a draft of 3 rejected at 1 whose
    # without-draft draw ran out of attempts (3 discarded, the last kept: one fallback)
    batch = columns(
        draft_found=[False, True, True, True, True],
        draft_len=[0, 6, 5, 2, 3],
        verified_prefix_len=[0, 6, 3, 0, 1],
        full_reuse=[False, True, False, False, False],
        tokens_generated=[10, 0, 4, 5, 2],
        response_len=[10, 6, 7, 5, 3],
        resamples=[0, 0, 0, 1, 3],
        draw_fallbacks=[0, 0, 0, 0, 1],
    )
    m = rollout_metrics(batch)
    assert m == {
        "spec_rl/samples": 5.0,
        "spec_rl/draft_found_ratio": 0.8,
        "spec_rl/full_reuse_ratio": 0.2,
        "spec_rl/reused_tokens": 10.0,
        "spec_rl/tokens_generated": 21.0,
        "spec_rl/response_tokens": 31.0,
        "spec_rl/draft_tokens": 16.0,
        "spec_rl/reused_token_ratio": 10 / 31,
        "spec_rl/accepted_draft_ratio": 10 / 16,
        "spec_rl/mean_verified_prefix": 2.5,
        "spec_rl/resamples": 4.0,
        "spec_rl/draw_fallbacks": 1.0,
    }


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
