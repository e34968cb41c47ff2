"""Every in-process path on a real pretrained instruct model: SmolLM2-135M-Instruct (vocabulary 49152, tied LM head,
chat template, EOS = pad = <|im_end|>), built offline by benchmarks/real_model.py (the ``real_model_path`` fixture)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from modes import rule_mode

from spec_rl.acceptance.dispatch import VerifyOptions, verify_hidden, verify_logits
from spec_rl.acceptance.mode import MODES
from spec_rl.backends.scoring import response_logprobs
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.drafts.cache import RolloutCache
from spec_rl.drafts.history import HistoryIndex
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.tasks.data import PromptFormat
from spec_rl.tasks.demo_data import demo_train_set
from spec_rl.trainer import clipped_policy_loss
from spec_rl.trainer.run import load_policy

pytestmark = [pytest.mark.real_model]

VOCAB, EOS = 49152, 2


@pytest.fixture(scope="module")
def policy(real_model_path):
    torch.manual_seed(0)
    model, tokenizer = load_policy(real_model_path)
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts(policy):
    """Chat-template prompts of the demo's word problems, as the trainer encodes them."""
    _, tokenizer = policy
    return PromptFormat().encode(tokenizer, demo_train_set()[:16])


def test_the_checkpoint_is_an_instruct_model_with_a_tied_head(policy, prompts):
    model, tokenizer = policy
    assert model.config.vocab_size == VOCAB and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.eos_token_id == EOS and tokenizer.pad_token_id == EOS
    text = tokenizer.decode(prompts[0])
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert "#### <answer>" in text and demo_train_set()[0].question in text


def test_scoring_matches_a_float64_forward(policy, prompts):
    model, _ = policy
    settings = SamplingSettings(temperature=0.7, max_tokens=24)
    backend = TransformersBackend(model, {EOS}, EOS)
    requests = [RolloutRequest(p, 0, dataset_id=f"q{i}") for i, p in enumerate(prompts[:3])]
    out = SpeculativeRollout(backend, RolloutCache(), settings, [EOS], 2048, MODES["vanilla"], seed=3).run(requests, 0)
    got = response_logprobs(model, out.prompt_ids, out.response_ids, EOS, settings)
    ref64 = copy.deepcopy(model).double()
    want = response_logprobs(ref64, out.prompt_ids, out.response_ids, EOS, settings).float()
    for b, resp in enumerate(out.response_ids):
        n = len(resp)
        torch.testing.assert_close(got[b, :n], want[b, :n], atol=2e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(out.logprobs[b]), want[b, :n], atol=2e-4, rtol=0)


@pytest.mark.parametrize("rule, lenience", [("lenient", 1.0), ("lenient", 1.6487), ("exact", 1.0)])
def test_verify_from_logits_and_from_hidden_states_with_the_tied_head(policy, prompts, rule, lenience):
    """Reference and Triton kernels (interpreter on CPU) take identical decisions at V = 49152."""
    model, tokenizer = policy
    texts = ["Anna has 3 apples, so she", "Tom has 9 cards."]
    drafts = torch.full((2, 6), EOS)
    lengths = torch.tensor([6, 5])
    hidden = torch.zeros(2, 6, model.config.hidden_size)
    with torch.no_grad():
        for b, (text, n) in enumerate(zip(texts, lengths.tolist())):
            draft = tokenizer(text)["input_ids"][:n]
            drafts[b, :n] = torch.tensor(draft)
            seq = prompts[b] + draft
            states = model.model(input_ids=torch.tensor([seq])).last_hidden_state[0]
            hidden[b, :n] = states[len(prompts[b]) - 1 : len(seq) - 1]  # the states that predict the draft tokens
        logits = model.lm_head(hidden)
    old = torch.full((2, 6), -0.7)
    decisions = []
    for backend in ("reference", "triton"):
        options = VerifyOptions(mode=rule_mode(rule, lenience), backend=backend, return_accept_mask=True)
        for result in (
            verify_logits(drafts, old, logits, lengths, seed=11, options=options),
            verify_hidden(drafts, old, hidden, model.get_output_embeddings(), lengths, seed=11, options=options),
        ):
            decisions.append((result.accepted_len.tolist(), result.accept_mask.tolist()))
            want = torch.log_softmax(logits.double(), -1).gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
            mask = torch.arange(6) < lengths.unsqueeze(1)
            torch.testing.assert_close(result.new_logprobs[mask].double(), want[mask], atol=1e-4, rtol=0)
    assert all(d == decisions[0] for d in decisions), decisions


def one_grpo_step(model, result, lr: float, rows: int = 8) -> None:
    """One AdamW step of the clipped policy loss on ``rows`` responses of ``result`` with advantages +-1 (the size of
    the step, not the batch, sets how far the policy moves: Adam's first step moves every weight by about lr)."""
    responses = result.response_ids[:rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    logprobs = response_logprobs(model, result.prompt_ids[:rows], responses, EOS, SamplingSettings())
    old = torch.zeros_like(logprobs)
    mask = torch.zeros_like(logprobs, dtype=torch.bool)
    for b, lp in enumerate(result.logprobs[:rows]):
        old[b, : len(lp)], mask[b, : len(lp)] = torch.tensor(lp), True
    advantages = torch.tensor([1.0, -1.0] * (rows // 2))
    clipped_policy_loss(logprobs, old, advantages, mask)[0].backward()
    optimizer.step()
    model.eval()


def narrow(mode):
    """``mode`` with two tail tokens per decode step."""
    return dataclasses.replace(mode, tail=min(mode.tail, 2))


def _matching(a, b) -> int:
    return sum(x == y for x, y in zip(a.response_ids, b.response_ids))


def test_lossless_modes_and_the_paged_engine_reproduce_vanilla_token_for_token(policy, prompts, capsys):
    """64 sequences x 128 tokens at T = 1 after one optimizer step (lr 1e-5): exact, histspec and the paged engine
    reproduce vanilla except at true near-ties (keyed Gumbel-max sampling)."""
    from spec_rl.backends.paged import PagedEngine

    model = copy.deepcopy(policy[0])
    settings = SamplingSettings(temperature=1.0, max_tokens=128)
    requests = [RolloutRequest(p, s, dataset_id=f"q{i}") for i, p in enumerate(prompts) for s in range(4)]
    cache, history = RolloutCache(), HistoryIndex()

    def rollout(mode, step, backend=None, cache=None, history=None):
        # two tail tokens per decode step: each costs about a third of a decode step on a CPU and is rarely
        # accepted at T = 1 here, while the parity checked is the same at any width
        backend = backend or TransformersBackend(model, {EOS}, EOS)
        store = cache if cache is not None else RolloutCache()
        return SpeculativeRollout(backend, store, settings, [EOS], 2048, narrow(mode), seed=5, history=history).run(
            requests, step
        )

    first = rollout(MODES["exact"], 0, cache=cache, history=history)  # the drafts and the history
    one_grpo_step(model, first, lr=1e-5)
    vanilla = rollout(MODES["vanilla"], 1)
    exact = rollout(MODES["exact"], 1, cache=copy.deepcopy(cache), history=copy.deepcopy(history))
    histspec = rollout(MODES["histspec"], 1, history=history)
    paged = rollout(MODES["vanilla"], 1, backend=PagedEngine(model, {EOS}, EOS))
    counts = {"exact": _matching(exact, vanilla), "histspec": _matching(histspec, vanilla)}
    counts["paged"] = _matching(paged, vanilla)
    with capsys.disabled():
        print(f"\nreal model, 64 x 128 at T=1 after one step: matching vanilla {counts} / 64")
    assert sum(len(r) for r in vanilla.response_ids) > 64 * 40  # long responses: the test means something
    assert exact.stats.accepted_tokens > 0 and histspec.stats.tail_accepted > 0
    assert all(n >= 63 for n in counts.values()), counts


def test_trl_rollout_func_with_the_chat_template_and_a_foreign_cache(policy, tmp_path):
    """TRL's GRPOTrainer on conversational prompts: SpecRLRollout tokenizes them with the chat template, responses
    end at <|im_end|>, epoch 2 reuses the drafts; a cache recorded under another tokenizer is refused."""
    pytest.importorskip("trl", reason="trl is not installed (pip install 'spec-rl[trl]')")
    import datasets
    from tiny_models import tiny_tokenizer
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from spec_rl.drafts.owner import DraftOwnerError, policy_owner
    from spec_rl.integrations.trl import SpecRLRollout

    model, tokenizer = policy
    model = copy.deepcopy(model)
    questions = [e.question for e in demo_train_set()[:2]]
    data = datasets.Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": q}] for q in questions], "id": ["a", "b"]}
    )
    args = TRLConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=12,
        num_train_epochs=2,
        learning_rate=1e-9,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_dropout=True,
    )

    def build(spec):
        trainer = TRLTrainer(
            model=model,
            reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
            rollout_func=spec,
        )
        return spec.attach(trainer), trainer

    spec, trainer = build(SpecRLRollout("spec", dataset_id_column="id"))
    trainer.train()
    calls = [h for h in spec.history if h["call"] == "train"]
    assert len(calls) == 2 and calls[0]["drafts_found"] == 0 and calls[1]["drafts_found"] == 4
    assert calls[1]["accepted_tokens"] >= 0.9 * calls[1]["draft_tokens"]  # lr 1e-9: the policy barely moved
    want = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in data["prompt"]]
    want = [list(w["input_ids"] if hasattr(w, "keys") else w) for w in want]
    for ids, completion in zip(spec.last_result.prompt_ids, spec.last_result.response_ids):
        assert list(ids) in want
        assert EOS not in completion[:-1] and len(completion) <= 12
    assert spec.cache.owner == policy_owner(tokenizer, model.config)

    # drafts recorded under another tokenizer: refused when the trainer binds, before any rollout
    foreign = RolloutCache()
    foreign.claim(policy_owner(tiny_tokenizer()))
    path = foreign.save(tmp_path / "foreign.safetensors")
    with pytest.raises(DraftOwnerError, match="holds drafts of another policy"):
        build(SpecRLRollout(cache_path=path))
