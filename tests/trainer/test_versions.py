"""The residual draw's weight copies: counted exactly before a run, refused past the budget, freed when no draft names
them, kept once for tied weights, and held on disk when asked (spec_rl.rollout.old_policy, spec_rl.trainer.versions)."""

import random

import pytest
import torch
from test_trainer import EXAMPLES, _config, _reward
from tiny_models import tiny_model, tiny_tokenizer

from spec_rl.rollout.old_policy import PolicyVersions, copy_bytes, peak_copies
from spec_rl.trainer.grpo import GRPOTrainer
from spec_rl.trainer.run import run_modes
from spec_rl.trainer.versions import check_version_budget, epoch_order


def _naive_peak(orders, per_step):
    """Copies held per step, walked the slow way: every version some draft names, plus the step's own."""
    drafts, kept, peak, step = {}, set(), 0, 0
    for e, order in enumerate(orders):
        for s in range(0, len(order), per_step):
            if e < len(orders) - 1:
                kept.add(step)
            peak = max(peak, len(kept))
            drafts.update({i: step for i in order[s : s + per_step]})
            kept = {v for v in kept if v in drafts.values()}
            step += 1
    return peak + 1 if peak else 0


@pytest.mark.parametrize("n, per_step, epochs", [(10, 1, 3), (37, 4, 2), (64, 8, 4), (5, 5, 3), (9, 2, 1)])
def test_the_peak_matches_a_walk_of_the_orders(n, per_step, epochs):
    orders = [epoch_order(n, 3, e) for e in range(epochs)]
    assert peak_copies(orders, per_step) == _naive_peak(orders, per_step)
    steps = -(-n // per_step)
    if epochs > 1:  # one epoch of copies at least, two at most, plus the scratch model
        assert steps + 1 <= peak_copies(orders, per_step) <= 2 * steps + 1
    assert peak_copies([list(range(n))], per_step) == 0  # one epoch: no later epoch reads a draft


@pytest.mark.slow
def test_a_run_holds_at_most_the_counted_copies(tmp_path, monkeypatch):
    held = []
    keep = PolicyVersions.keep

    def counting_keep(self, version):
        keep(self, version)
        held.append(len(self))

    monkeypatch.setattr(PolicyVersions, "keep", counting_keep)
    cfg = _config(epochs=3, prompts_per_step=1, mode="l=1-res")
    trainer = GRPOTrainer(tiny_model(seed=1), tiny_tokenizer(), EXAMPLES, _reward, cfg, tmp_path, progress=False)
    trainer.train()
    orders = [epoch_order(len(EXAMPLES), cfg.seed, e) for e in range(3)]
    assert max(held) + 1 == peak_copies(orders, 1) == trainer.old_policies.max_copies
    assert len(trainer.old_policies) <= len(EXAMPLES)  # only the versions drafts still name


def test_a_run_whose_copies_do_not_fit_is_refused_before_anything_is_written(model_dir, tmp_path):
    cfg = _config(epochs=3, prompts_per_step=1, version_budget_gb=1e-6)
    out = tmp_path / "run"
    with pytest.raises(
        ValueError, match=r"holds up to 6 copies at once \(0\.\d+ MB\).*--modes coupled.*--versions-on-disk"
    ):
        run_modes(model_dir, EXAMPLES, _reward, cfg, ["vanilla", "l=1-res"], out, progress=False)
    assert not out.exists()
    with pytest.raises(ValueError, match="free disk"):
        check_version_budget(_config(epochs=2, mode="l=1-res"), 10**6, 10**12, tmp_path / "versions")
    assert check_version_budget(_config(epochs=3, mode="spec"), 10**6, 10**12, None) == 0  # no copies: no check


def test_versions_on_disk_score_as_in_memory_and_are_deleted_when_dropped(tmp_path):
    model = tiny_model(seed=2, tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    assert copy_bytes(model) == sum(unique.values())  # the tied head once
    memory, disk = PolicyVersions(model, 0), PolicyVersions(model, 0, tmp_path / "v", max_copies=2)
    for v in (memory, disk):
        v.keep(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    contexts = [[3, 4, 5], [3, 9]]
    assert torch.equal(memory.next_token_logits([0, 0], contexts), disk.next_token_logits([0, 0], contexts))
    disk.keep(1)
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == ["0.safetensors", "1.safetensors"]
    with pytest.raises(RuntimeError, match="past the bound of 2"):
        disk.keep(2)
    disk.retain([1])
    assert [p.name for p in (tmp_path / "v").iterdir()] == ["1.safetensors"] and 0 not in disk
    PolicyVersions(model, 0, tmp_path / "v")  # a new process: the last one's files name nothing it kept
    assert not any((tmp_path / "v").iterdir())


@pytest.mark.slow
def test_a_run_with_versions_on_disk_trains_like_one_in_memory(tmp_path):
    runs = {}
    for on_disk in (False, True):
        cfg = _config(epochs=2, prompts_per_step=2, mode="l=1-res", versions_on_disk=on_disk)
        out = tmp_path / str(on_disk)
        random.seed(0)
        trainer = GRPOTrainer(tiny_model(seed=1), tiny_tokenizer(), EXAMPLES, _reward, cfg, out, progress=False)
        runs[on_disk] = [(r["generated_tokens"], r["reused_tokens"], r["mean_reward"]) for r in trainer.train()]
    assert runs[True] == runs[False]
