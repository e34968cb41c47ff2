"""Draft age (docs/design.md "Draft age"): a slot whose response came from its draft max_draft_age epochs in a row
samples fresh the next epoch; ages live with the drafts, on disk too. The residual draw reads the weights of each
draft's own step."""

import math

import pytest
import torch
from test_rollout import PROMPTS, _requests, _rollout
from tiny_models import tiny_model

from spec_rl.acceptance.mode import RolloutMode
from spec_rl.acceptance.rules import Lenient
from spec_rl.drafts.cache import CacheKey, RolloutCache
from spec_rl.rollout.old_policy import PolicyVersions
from spec_rl.rollout.speculative import RolloutRequest
from spec_rl.sampling.distribution import SamplingSettings


def test_a_slot_reused_max_draft_age_epochs_in_a_row_samples_fresh(tmp_path):
    cache = RolloutCache()
    mode = RolloutMode(Lenient(math.inf), tail=0, max_draft_age=2)  # l = inf: every draft is reused whole
    ro = _rollout(tiny_model(seed=3), cache=cache, mode=mode, seed=5)
    requests = _requests()
    ages, generated, dropped = [], [], []
    for step in range(6):
        out = ro.run(requests, step=step)
        ages.append(sorted({d.age for d in cache.drafts()}))
        generated.append(out.stats.tokens_generated > 0)
        dropped.append(out.stats.drafts_dropped)
    # fresh (age 0), reused twice (ages 1, 2), fresh again: every slot on the same schedule
    assert ages == [[0], [1], [2], [0], [1], [2]]
    assert generated == [True, False, False, True, False, False]
    assert dropped == [0, 0, 0, len(requests), 0, 0]
    saved = RolloutCache.load(cache.save(tmp_path / "cache.safetensors"))
    assert [d.age for d in saved.drafts()] == [d.age for d in cache.drafts()]


def test_caches_written_before_ages_load_as_fresh_samples(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    cache = RolloutCache()
    cache.store(CacheKey.make([3, 4], 0), [5, 1], [-0.1, -0.2], "eos", 0, SamplingSettings(), age=3)
    path = cache.save(tmp_path / "c.safetensors")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = {k: v for k, v in load_file(str(path)).items() if k != "ages"}
    save_file(tensors, str(path), metadata=meta)
    assert [d.age for d in RolloutCache.load(path).drafts()] == [0]


def test_the_residual_draw_reads_each_drafts_own_weights_and_skips_unknown_ones():
    model = tiny_model(seed=4)
    versions = PolicyVersions(model, pad_id=0)
    ro = _rollout(model, mode=RolloutMode(Lenient(1.0, "residual"), tail=0), seed=2, old_policies=versions)
    requests = [RolloutRequest(p, s) for p in PROMPTS for s in range(6)]
    ro.run(requests, step=0)
    versions.keep(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    contexts = [PROMPTS[0], PROMPTS[1] + [5]]
    old = versions.next_token_logits([0, 0], contexts)
    model.load_state_dict(before)
    ref = torch.stack([model(input_ids=torch.tensor([c])).logits[0, -1] for c in contexts])
    assert torch.allclose(old, ref, atol=1e-5)  # q: the step-0 weights, not the moved ones
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    second = ro.run(requests, step=1)
    assert second.stats.drafts_found == len(requests) and 0 < second.stats.accepted_tokens < second.stats.draft_tokens
    versions.keep(1)
    versions.retain({1})
    assert 0 not in versions and len(versions) == 1
    third = ro.run(requests, step=2)  # drafts of step 1: kept; a lost version (a resumed run) is sampled fresh
    assert third.stats.drafts_dropped == 0
    versions.retain(set())
    fourth = ro.run(requests, step=3)
    assert fourth.stats.drafts_dropped == len(requests) and fourth.stats.drafts_found == 0


def test_the_residual_draw_needs_the_old_weights_and_the_adapters_refuse_it():
    from spec_rl.integrations.requests import adapter_mode, server_mode

    with pytest.raises(ValueError, match="needs q: pass old_policies=PolicyVersions"):
        _rollout(tiny_model(), mode=RolloutMode(Lenient(1.0, "residual")))
    for build in (adapter_mode, server_mode):
        with pytest.raises(ValueError, match="the trainer adapters do not keep; use it with spec-rl's own trainer"):
            build("l=1-res")
    assert server_mode("spec-age2").max_draft_age == 2 and server_mode("spec-age2").tail == 0
