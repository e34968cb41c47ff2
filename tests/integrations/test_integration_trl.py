"""spec_rl.integrations.trl against the real trl.GRPOTrainer (CPU, tiny random Qwen2 model).

The end-to-end test trains 3 epochs with a near-zero learning rate and checks,
at every rollout: the output shapes; that the verified prefix equals the draft
that was in the cache before the call; that the returned log-probs equal the
trainer's own per-token log-probs (TRL's ``_get_per_token_logps_and_entropies``
on the same model) for the same tokens; and that from epoch 2 on every sample
finds its draft and almost every draft token is accepted.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'spec-rl[trl]')")
datasets = pytest.importorskip("datasets", reason="datasets is not installed (a dependency of trl)")

from tiny_models import tiny_model

from spec_rl.acceptance.mode import ADAPTER_MODE, MODES, RolloutMode
from spec_rl.acceptance.rules import Lenient
from spec_rl.drafts.cache import CacheKey, RolloutCache
from spec_rl.drafts.history import SEPARATOR, HistoryIndex
from spec_rl.integrations.trl import (
    CACHE_FILENAME,
    HISTORY_FILENAME,
    SpecRLRollout,
    UnsupportedTrainerConfig,
    check_trainer_args,
)
from spec_rl.rollout.reward_split import ORIGINS
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.tasks.demo_policy import build_demo_tokenizer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

PROMPTS = [
    "Question: Tom has 3 apples and buys 4 more. How many now? Answer:",
    "Question: Ann has 9 apples and sells 2. How many now? Answer:",
    "Question: 7 + 5 = ? Answer:",
    "Question: Tom buys 12 apples, Ann buys 3. How many? Answer:",
]
NUM_GEN = 4
MAX_COMPLETION = 10


def _tokenizer():
    texts = PROMPTS * 3 + ["How many apples does Tom have now? He has 7 apples. #### 7"] * 3
    return build_demo_tokenizer(texts, vocab_size=300, model_max_length=128)


def _model(tok, seed=0, **kw):
    # A biased EOS makes completions end at varied lengths (~15% EOS per token), some truncated.
    return tiny_model(vocab_size=len(tok), eos=(tok.eos_token_id,), seed=seed, bias_eos=4.0, **kw)


def _config(tmp_path, **overrides):
    from trl import GRPOConfig

    kw = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "bf16": False,
        "per_device_train_batch_size": 2 * NUM_GEN,
        "num_generations": NUM_GEN,
        "max_completion_length": MAX_COMPLETION,
        "num_train_epochs": 3,
        "learning_rate": 1e-9,
        "temperature": 1.0,
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "seed": 0,
        "disable_dropout": True,
        "dataloader_num_workers": 0,
    }
    kw.update(overrides)
    return GRPOConfig(**kw)


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _dataset():
    return datasets.Dataset.from_dict({"prompt": PROMPTS, "id": [f"toy:{i}" for i in range(len(PROMPTS))]})


class RecordingRollout(SpecRLRollout):
    """Checks each call against the cache state before it and against TRL's own log-probs."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.records = []

    def __call__(self, prompts, trainer):
        training = trainer.model.training
        drafts = {}
        if self.trainer is trainer and training:
            for i, req in enumerate(self.requests_for(prompts, trainer)):
                key = CacheKey.make(req.prompt_ids, req.slot, req.dataset_id)
                d = self.cache.lookup(key, self.settings)
                if d is not None:
                    drafts[i] = (d.token_ids.tolist(), d.logprobs.clone())
        out = super().__call__(prompts, trainer)
        res = self.last_result
        # The trainer's own per-token log-probs of the returned tokens, padded exactly like TRL does.
        from trl.trainer.utils import pad

        p = pad([torch.tensor(x) for x in out["prompt_ids"]], padding_value=0, padding_side="left")
        pm = pad(
            [torch.ones(len(x), dtype=torch.long) for x in out["prompt_ids"]], padding_value=0, padding_side="left"
        )
        c = pad([torch.tensor(x) for x in out["completion_ids"]], padding_value=0, padding_side="right")
        cm = pad(
            [torch.ones(len(x), dtype=torch.long) for x in out["completion_ids"]], padding_value=0, padding_side="right"
        )
        with torch.no_grad():
            trl_lp = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([p, c], 1), torch.cat([pm, cm], 1), c.shape[1], batch_size=len(prompts)
            )[0]
        # TRL receives the behaviour log-probs; the current ones are the trainer's own
        assert out["logprobs"] == [[float(x) for x in b] for b in res.behaviour_logprobs]
        mine = pad([torch.tensor(x) for x in res.logprobs], padding_value=0.0, padding_side="right")
        self.records.append(
            {
                "training": training,
                "step": trainer.state.global_step,
                "prompts": list(prompts),
                "out": copy.deepcopy(out),
                "drafts": drafts,
                "prefix": list(res.verified_prefix_len),
                "found": list(res.draft_found),
                "stats": res.stats.to_dict(),
                "lp_err": float(((trl_lp.double() - mine.double()) * cm).abs().max()),
            }
        )
        return out


def _indexed(index, key) -> list[list[int]]:
    """The responses a history index holds for one prompt key."""
    automaton = index.automaton(key)
    if automaton is None:
        return []
    out, cur = [], []
    for t in automaton.text + [SEPARATOR]:
        if t == SEPARATOR:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    return out


def _trainer(tmp_path, spec, args=None, model=None, tok=None, eval_dataset=None):
    from trl import GRPOTrainer

    tok = tok or _tokenizer()
    model = model or _model(tok)
    return GRPOTrainer(
        model=model,
        reward_funcs=_reward,
        args=args or _config(tmp_path),
        train_dataset=_dataset(),
        eval_dataset=eval_dataset,
        processing_class=tok,
        rollout_func=spec,
    )


def _run_three_epochs(tmp_path, lenience, eval_dataset=None, spec_kw=None, model=None, **config):
    tok = _tokenizer()
    spec_kw = dict(spec_kw or {})
    if "mode" not in spec_kw:
        spec_kw["mode"] = RolloutMode(Lenient(lenience, spec_kw.pop("rejection_draw", "policy")))
    spec = RecordingRollout(dataset_id_column="id", cache_path=tmp_path / "cache.safetensors", **spec_kw)
    trainer = _trainer(
        tmp_path,
        spec,
        args=_config(tmp_path, **config),
        tok=tok,
        eval_dataset=eval_dataset,
        model=model(tok) if model is not None else None,
    )
    spec.attach(trainer)
    trainer.train()
    recs = [r for r in spec.records if r["training"]]
    steps_per_epoch = len(PROMPTS) * NUM_GEN // (2 * NUM_GEN)
    assert len(recs) == 3 * steps_per_epoch
    for r in recs:
        prompts, out = r["prompts"], r["out"]
        # TRL's contract: each prompt arrives num_generations times in a row.
        assert len(prompts) == 2 * NUM_GEN
        for g in range(0, len(prompts), NUM_GEN):
            assert prompts[g : g + NUM_GEN] == [prompts[g]] * NUM_GEN
        assert len(out["prompt_ids"]) == len(out["completion_ids"]) == len(out["logprobs"]) == len(prompts)
        for p, ids, c, lp in zip(prompts, out["prompt_ids"], out["completion_ids"], out["logprobs"]):
            assert ids == tok(p)["input_ids"]
            assert 1 <= len(c) <= MAX_COMPLETION
            assert len(lp) == len(c)
            assert all(x <= 0.0 for x in lp)
            # EOS ends a completion; nothing follows it, and only a full budget ends without it.
            assert tok.eos_token_id not in c[:-1]
            assert c[-1] == tok.eos_token_id or len(c) == MAX_COMPLETION
        # The rollout's current log-probs are the trainer's own per-token log-probs for the same tokens.
        assert r["lp_err"] < 1e-4, r["lp_err"]
        # The verified prefix is the cached draft's prefix, token for token (with exact acceptance a
        # sample may follow the draft of another slot of its group: docs/design.md "Exact acceptance").
        for i, (draft_ids, _) in r["drafts"].items():
            n = r["prefix"][i]
            assert r["found"][i]
            group = [r["drafts"][j][0] for j in r["drafts"] if j // NUM_GEN == i // NUM_GEN]
            candidates = group if spec.mode.rule.keyed_walk else [draft_ids]
            assert any(0 <= n <= len(d) and out["completion_ids"][i][:n] == d[:n] for d in candidates)
            if n == len(draft_ids) and not spec.mode.rule.keyed_walk:
                assert out["completion_ids"][i] == draft_ids
    return spec, trainer, tok, recs[:steps_per_epoch], recs[steps_per_epoch:]


@pytest.mark.slow
def test_grpo_trainer_three_epochs_reuses_drafts(tmp_path):
    spec, trainer, tok, first, later = _run_three_epochs(tmp_path, math.exp(0.5), save_strategy="epoch")
    steps_per_epoch = len(first)
    assert all(r["stats"]["drafts_found"] == 0 for r in first)
    for r in later:
        s = r["stats"]
        assert s["drafts_found"] == s["num_samples"] == 2 * NUM_GEN
        assert s["accepted_tokens"] >= 0.95 * s["draft_tokens"]
        assert s["full_reuse_count"] >= 0.9 * s["num_samples"]
        assert len(r["drafts"]) == s["num_samples"]
    reused = sum(r["stats"]["accepted_tokens"] for r in later)
    total = sum(r["stats"]["vanilla_tokens"] for r in later)
    assert reused >= 0.95 * total

    # Keys carry the dataset id column; one draft per (prompt, slot).
    assert len(spec.cache) == len(PROMPTS) * NUM_GEN
    for i, prompt in enumerate(PROMPTS):
        ids = tok(prompt)["input_ids"]
        for slot in range(NUM_GEN):
            assert CacheKey.make(ids, slot, f"toy:{i}") in spec.cache
            assert CacheKey.make(ids, slot, None) not in spec.cache

    # Persisted with each checkpoint and at cache_path; the files load back with every draft.
    ckpt = tmp_path / "out" / f"checkpoint-{steps_per_epoch}" / CACHE_FILENAME
    assert ckpt.is_file()
    assert len(RolloutCache.load(ckpt)) == len(PROMPTS) * NUM_GEN
    final = RolloutCache.load(tmp_path / "cache.safetensors")
    assert len(final) == len(spec.cache)
    # Metrics went through TRL's metric log.
    assert any("spec_rl/full_reuse_ratio" in h for h in trainer.state.log_history)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_bad")
    spec = SpecRLRollout()
    trainer = _trainer(tmp, spec)
    return tmp, spec, trainer


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("repetition_penalty", 1.2, "repetition_penalty"),
        ("min_p", 0.1, "min_p"),
        ("generation_kwargs", {"no_repeat_ngram_size": 2}, "generation_kwargs"),
        ("max_completion_length", None, "max_completion_length"),
    ],
)
def test_attach_rejects_sampling_the_verifier_cannot_honour(built, monkeypatch, field, value, match):
    _, spec, trainer = built
    monkeypatch.setattr(trainer.args, field, value)
    with pytest.raises(UnsupportedTrainerConfig, match=match):
        spec.attach(trainer)


def test_vllm_server_sleep_and_tensor_parallel_are_refused_with_a_reason(tmp_path):
    from trl import GRPOConfig

    cases = (
        (dict(vllm_mode="server"), "per-request budget"),
        (dict(vllm_mode="colocate", vllm_enable_sleep_mode=True), "vllm_enable_sleep_mode=False"),
        (dict(vllm_mode="colocate", vllm_tensor_parallel_size=2), "vllm_tensor_parallel_size=1"),
        (dict(vllm_mode="colocate", vllm_structured_outputs_regex=r"\d+"), "unset vllm_structured_outputs_regex"),
    )
    for extra, why in cases:
        args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, max_completion_length=8, **extra)
        with pytest.raises(UnsupportedTrainerConfig, match=why):
            check_trainer_args(args)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, max_completion_length=8)
    args.vllm_mode = "colocated"  # a typo set after construction
    with pytest.raises(UnsupportedTrainerConfig, match="'colocate' \\(supported\\) and 'server'"):
        check_trainer_args(args)
    # plain colocate mode passes where vLLM is installed (tests/integrations/test_vllm_trl.py runs it on a real engine)
    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, use_vllm=True, vllm_mode="colocate", max_completion_length=8
    )
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(UnsupportedTrainerConfig, match="vLLM is not installed"):
            check_trainer_args(args)
    else:
        assert check_trainer_args(args).max_tokens == 8


def test_plain_config_maps_to_sampling_settings(tmp_path):
    args = _config(tmp_path, temperature=0.7, top_k=5, top_p=0.9)
    assert check_trainer_args(args) == SamplingSettings(temperature=0.7, top_p=0.9, top_k=5, max_tokens=MAX_COMPLETION)


def test_cached_drafts_with_other_settings_fail_at_start(tmp_path):
    # Drafts recorded without top-k; the trainer now samples with top_k=5.
    cache = RolloutCache()
    old = SamplingSettings(temperature=1.0, top_k=0, max_tokens=MAX_COMPLETION)
    cache.store(CacheKey.make([5, 6], 0), [7, 8], [-1.0, -2.0], "length", 3, old)
    spec = SpecRLRollout(cache=cache)
    trainer = _trainer(tmp_path, spec, args=_config(tmp_path, top_k=5))
    with pytest.raises(UnsupportedTrainerConfig, match="top_k=0"):
        spec.attach(trainer)


def test_cached_drafts_under_another_budget_are_accepted_at_start(tmp_path):
    # Recorded under max_completion_length=3: same distribution, so not refused (drafts are cut to today's
    # budget and EOS set; ones a smaller budget cut are continued, see test_draft_validity.py).
    cache = RolloutCache()
    old = SamplingSettings(temperature=1.0, max_tokens=3)
    cache.store(CacheKey.make([5, 6], 0), [7, 8, 9], [-1.0, -2.0, -0.5], "length", 3, old)
    spec = SpecRLRollout(cache=cache)
    trainer = _trainer(tmp_path, spec, args=_config(tmp_path))
    spec.attach(trainer)


def test_length_curriculum_continues_drafts_the_shorter_budget_cut(tmp_path):
    # One epoch at max_completion_length=3, then the same adapter (and cache) at 10, same weights (lr 1e-9):
    # the drafts cut at 3 are accepted whole and continued, never returned as finished at 3 tokens.
    tok = _tokenizer()
    model = _model(tok)
    spec = SpecRLRollout("spec")
    short = _trainer(
        tmp_path, spec, args=_config(tmp_path, num_train_epochs=1, max_completion_length=3), model=model, tok=tok
    )
    spec.attach(short)
    short.train()
    cut = [d for d in spec.cache.drafts() if len(d) == 3 and d.token_ids[-1].item() != tok.eos_token_id]
    assert cut
    spec2 = SpecRLRollout("spec", cache=spec.cache)
    longer = _trainer(tmp_path, spec2, args=_config(tmp_path, num_train_epochs=1), model=model, tok=tok)
    spec2.attach(longer)
    longer.train()
    train = [h for h in spec2.history if h["call"] == "train"]
    assert all(h["drafts_found"] == h["num_samples"] for h in train)
    for d in spec2.cache.drafts():  # the responses of the second epoch
        ids = d.token_ids.tolist()
        assert tok.eos_token_id not in ids[:-1] and (ids[-1] == tok.eos_token_id or len(ids) == MAX_COMPLETION)
    assert sum(len(d) > 3 for d in spec2.cache.drafts()) >= len(cut)


def test_logprobs_without_temperature_fail_at_start(tmp_path):
    tok = _tokenizer()
    model = _model(tok)
    with torch.no_grad():  # peaked logits, so the temperature matters
        model.lm_head.weight.mul_(40.0)
    spec = SpecRLRollout()
    trainer = _trainer(tmp_path, spec, args=_config(tmp_path, temperature=0.5), model=model, tok=tok)
    spec.attach(trainer)  # consistent: TRL divides by 0.5 as well
    # Make the trainer's log-probs ignore the temperature (T = 1) while it still samples at 0.5.
    try:  # trl >= 1.16 bakes the temperature into a fused LM head: re-patch it
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(trainer.model, temperature=1.0)
    except ImportError:  # earlier releases divide by trainer.temperature in _get_per_token_logps_and_entropies
        trainer.temperature = 1.0
    with pytest.raises(UnsupportedTrainerConfig, match="temperature=0.5"):
        spec.attach(trainer)


def test_dropout_in_training_fails_at_start(tmp_path):
    tok = _tokenizer()
    model = _model(tok)
    for module in model.modules():  # attention layers copy the config's dropout at construction
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    spec = SpecRLRollout()
    trainer = _trainer(tmp_path, spec, args=_config(tmp_path, disable_dropout=False), model=model, tok=tok)
    trainer.model.train()
    with pytest.raises(UnsupportedTrainerConfig, match="dropout"):
        spec.attach(trainer)


def test_attach_requires_being_the_rollout_func(built):
    _, _, trainer = built
    with pytest.raises(UnsupportedTrainerConfig, match="rollout_func"):
        SpecRLRollout().attach(trainer)


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mode must be one of"):
        SpecRLRollout(mode="l=-1")
    with pytest.raises(ValueError, match="mode must be one of"):
        SpecRLRollout(mode="greedy")
    with pytest.raises(ValueError, match="not both"):
        SpecRLRollout(dataset_id_column="id", dataset_id_fn=str)


@pytest.mark.slow
def test_grpo_trainer_partial_reuse_continues_from_the_verified_prefix(tmp_path):
    # l = 0.5 < 1: each token of an unchanged policy's draft is kept with probability 0.5, so
    # drafts are cut and the rest is generated: prefix + continuation, with TRL-matching log-probs
    # (checked per call in _run_three_epochs).
    spec, trainer, tok, first, later = _run_three_epochs(
        tmp_path, 0.5, eval_dataset=_dataset(), eval_strategy="epoch", per_device_eval_batch_size=2 * NUM_GEN
    )
    # The reward split by response origin: counts per call, and weighted by them it is TRL's reward.
    logged = [h for h in trainer.state.log_history if "spec_rl/count_fresh" in h]
    assert len(logged) == len(first) + len(later) and all("reward" in h for h in logged)
    for h in logged:
        counts = {o: h[f"spec_rl/count_{o}"] for o in ORIGINS}
        assert sum(counts.values()) == 2 * NUM_GEN
        assert all((f"spec_rl/reward_{o}" in h) == (counts[o] > 0) for o in ORIGINS)
        mean = sum(counts[o] * h[f"spec_rl/reward_{o}"] for o in ORIGINS if counts[o]) / (2 * NUM_GEN)
        assert mean == pytest.approx(h["reward"], rel=1e-5)
    assert all(h["spec_rl/count_fresh"] == 2 * NUM_GEN for h in logged[: len(first)])
    assert sum(h["spec_rl/count_partly_reused"] for h in logged) > 0
    # One history entry per call: the call, its step and mode, its statistics.
    assert {h["call"] for h in spec.history} == {"train", "eval"}
    for h in spec.history:
        assert {"step", "wall_seconds", "num_samples", *RolloutMode(None).to_dict()} <= set(h)
        assert not {"mode", "strategy", "history_spec"} & set(h)
        assert (h["acceptance"], h.get("lenience"), h["tail"]) == (
            ("lenient", 0.5, 8) if h["call"] == "train" else (None, None, 8)
        )
    # Evaluation rollouts sample without drafts and leave the training cache alone.
    evals = [r for r in spec.records if not r["training"]]
    assert len(evals) >= 3
    assert all(r["stats"]["drafts_found"] == 0 and r["lp_err"] < 1e-4 for r in evals)
    # ... and the history index: it holds training completions only.
    trained = {tuple(c) for r in spec.records if r["training"] for c in r["out"]["completion_ids"]}
    indexed = [
        tuple(x)
        for i, p in enumerate(PROMPTS)
        for x in _indexed(spec.history_index, CacheKey.make(tok(p)["input_ids"], 0, f"toy:{i}").digest)
    ]
    assert indexed and set(indexed) <= trained
    assert any(tuple(c) not in trained for r in evals for c in r["out"]["completion_ids"])
    assert len(spec.cache) == len(PROMPTS) * NUM_GEN
    # Every draft was last written by an epoch-3 training step (steps 4, 5), not by the final evaluation (step 6).
    versions = {d.version for d in spec.cache.drafts()}
    assert versions == {2 * len(first), 3 * len(first) - 1}
    assert all(r["stats"]["drafts_found"] == 0 for r in first)
    assert all(r["stats"]["drafts_found"] == r["stats"]["num_samples"] for r in later)
    accepted = sum(r["stats"]["accepted_tokens"] for r in later)
    drafted = sum(r["stats"]["draft_tokens"] for r in later)
    generated = sum(r["stats"]["tokens_generated"] for r in later)
    assert 0 < accepted < drafted
    assert generated > 0
    cut = [(r, i) for r in later for i in r["drafts"] if r["prefix"][i] < len(r["drafts"][i][0])]
    assert cut  # some drafts were rejected part-way


@pytest.mark.slow
def test_resume_reloads_the_cache_from_the_checkpoint(tmp_path):
    tok = _tokenizer()
    spec = SpecRLRollout("spec")
    trainer = _trainer(tmp_path, spec, args=_config(tmp_path, num_train_epochs=1, save_strategy="epoch"), tok=tok)
    spec.attach(trainer)
    trainer.train()
    steps = trainer.state.global_step
    ckpt = tmp_path / "out" / f"checkpoint-{steps}"
    assert len(RolloutCache.load(ckpt / CACHE_FILENAME)) == len(PROMPTS) * NUM_GEN
    # The history index is saved beside the cache: every prompt's responses (the group's drafts).
    saved = HistoryIndex.load(ckpt / HISTORY_FILENAME)
    assert len(saved) == len(PROMPTS)
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        for slot in range(NUM_GEN):
            draft = spec.cache.lookup(CacheKey.make(ids, slot), spec.settings)
            assert draft.token_ids.tolist() in _indexed(saved, CacheKey.make(ids, 0).digest)

    # A fresh process: new adapter with an empty cache, same model, resumed for a second epoch.
    fresh = SpecRLRollout("spec")
    resumed = _trainer(tmp_path, fresh, args=_config(tmp_path, num_train_epochs=2), model=trainer.model, tok=tok)
    fresh.attach(resumed)
    loaded, load = [], fresh.load_history
    fresh.load_history = lambda path: (loaded.append(path), load(path))
    resumed.train(resume_from_checkpoint=str(ckpt))
    train_calls = [h for h in fresh.history if h["call"] == "train"]
    assert len(train_calls) == steps
    assert all(h["drafts_found"] == h["num_samples"] for h in train_calls)
    assert loaded == [ckpt / HISTORY_FILENAME]
    for prompt in PROMPTS:  # the restored responses are still indexed (next to the new epoch's)
        key = CacheKey.make(tok(prompt)["input_ids"], 0).digest
        assert all(r in _indexed(fresh.history_index, key) for r in _indexed(saved, key))


def _peaked_model(tok):
    # Sharper logits: an unchanged policy then samples its own drafts again with high probability,
    # which is what exact acceptance (accept y_i with probability pi_t(y_i)) reuses.
    model = _model(tok)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


@pytest.mark.slow
def test_exact_acceptance_reuses_drafts_and_records_the_mode(tmp_path):
    spec, trainer, _, first, later = _run_three_epochs(
        tmp_path, None, spec_kw={"mode": "exact"}, model=_peaked_model, temperature=0.2
    )
    assert spec.history and all(h["call"] == "train" for h in spec.history)  # no evaluation in this run
    assert all(h["acceptance"] == "exact" and h["tail"] == 8 and "lenience" not in h for h in spec.history)
    assert all(r["stats"]["drafts_found"] == 0 for r in first)
    accepted = sum(r["stats"]["accepted_tokens"] for r in later)
    drafted = sum(r["stats"]["draft_tokens"] for r in later)
    assert all(r["stats"]["drafts_found"] == r["stats"]["num_samples"] for r in later)
    assert accepted >= 0.5 * drafted
    assert any("spec_rl/decode_steps" in h and "spec_rl/tail_accepted" in h for h in trainer.state.log_history)


def test_the_mode_option_takes_a_mode_or_its_name():
    with pytest.raises(ValueError, match="mode must be one of"):
        SpecRLRollout(mode="strict")
    with pytest.raises(TypeError, match="acceptance"):  # one option: the mode
        SpecRLRollout(acceptance="exact")
    exact = SpecRLRollout(mode="exact")
    assert exact.mode == MODES["exact"] and isinstance(exact.history_index, HistoryIndex)
    assert SpecRLRollout().mode == RolloutMode(Lenient(math.exp(0.5)), tail=8) == RolloutMode.parse(ADAPTER_MODE)
    assert SpecRLRollout(mode="random").mode == MODES["random"]
    assert SpecRLRollout(mode="vanilla").mode == MODES["vanilla"]
    spec = SpecRLRollout(mode=RolloutMode(Lenient(1.0, "without-draft"), tail=0))
    assert spec.history_index is None and spec._options.mode == spec.mode
    with pytest.raises(ValueError, match="needs lenience >= 1"):  # below 1 the residual keeps the rejected token
        SpecRLRollout(mode="l=0.5-excl")


@pytest.mark.slow
def test_without_draft_never_redraws_the_rejected_draft_token(tmp_path):
    spec, _, _, first, later = _run_three_epochs(
        tmp_path, 1.0, spec_kw={"rejection_draw": "without-draft"}, learning_rate=0.05
    )  # a policy that moves: at l = 1 an unchanged policy keeps every draft
    assert all(h.get("rejection_draw") == ("without-draft" if h["call"] == "train" else None) for h in spec.history)
    rejected = 0
    for r in later:
        for i, (draft_ids, _) in r["drafts"].items():
            n = r["prefix"][i]
            if n < len(draft_ids):  # rejected at n: the token there is drawn without draft_ids[n]
                rejected += 1
                assert r["out"]["completion_ids"][i][n] != draft_ids[n]
    assert rejected > 0
