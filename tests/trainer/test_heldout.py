"""Held-out evaluation in the trainer and the rollout reward split by response origin.

Evaluations run at epochs 0..E with seeds derived from (run seed, epoch), give the same warm-start
numbers in every mode, land in the epoch records, survive a resume without being redone; the reward
split of every epoch adds back up to the rollout reward; the demo's held-out set and the
--eval-fraction split are disjoint from the training prompts.
"""

import math
from types import SimpleNamespace

import pytest
from tiny_models import tiny_model, tiny_tokenizer

from spec_rl.acceptance.mode import MODES
from spec_rl.rollout.reward_split import ORIGINS, origin_means, origin_sums, response_origins
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.tasks.data import Example
from spec_rl.tasks.evaluation import evaluate_heldout, heldout_split
from spec_rl.trainer import GRPOConfig, GRPOTrainer
from spec_rl.trainer import heldout as heldout_mod
from spec_rl.trainer.checkpoint import latest_checkpoint
from spec_rl.trainer.heldout import FIELDS, START, heldout_curve, heldout_seed
from spec_rl.trainer.run import load_policy


def _examples(pairs, tag):
    return [
        Example(
            f"Question: Tom has {a} apples . Ann buys {b} more . how many now ? Answer:",
            str(a + b),
            f"{tag}:{a}:{b}",
            "test",
        )
        for a, b in pairs
    ]


TRAIN = _examples([(1, 2), (3, 4), (2, 2), (5, 1)], "t")
HELDOUT = _examples([(1, 1), (4, 3)], "e")


def _parity(text: str, gold: str) -> float:
    return float(len(text) % 2)  # a reward the tiny random policy earns about half of the time


def _config(mode="spec", lenience=0.5, **kw):
    """A small config; ``mode`` names a run of MODES, whose lenience (where it has one) is ``lenience``."""
    base = dict(
        epochs=2,
        group_size=4,
        prompts_per_step=2,
        sampling=SamplingSettings(max_tokens=10),
        lr=1e-2,
        seed=5,
        eval_samples=3,
        save_checkpoint=False,
    )
    base.update(kw)
    mode = MODES[mode].with_overrides(lenience=lenience) if "lenience" in MODES[mode].settable() else MODES[mode]
    return GRPOConfig(mode=mode, **base)


def _trainer(tmp_path, model=None, **kw):
    return GRPOTrainer(
        model or tiny_model(seed=0),
        tiny_tokenizer(),
        TRAIN,
        _parity,
        _config(**kw),
        tmp_path,
        progress=False,
        eval_examples=HELDOUT,
    )


@pytest.fixture()
def seen_seeds(monkeypatch):
    """Record the seed of every held-out evaluation the trainer runs (the evaluation itself still runs)."""
    seeds = []

    def recording(*args, **kwargs):
        seeds.append(args[5])
        return evaluate_heldout(*args, **kwargs)

    monkeypatch.setattr(heldout_mod, "evaluate_heldout", recording)
    return seeds


def test_evaluations_run_at_epochs_0_to_E_with_keyed_seeds_and_land_in_the_records(tmp_path, seen_seeds):
    records = _trainer(tmp_path).train()
    assert seen_seeds == [heldout_seed(5, e) for e in range(3)]
    assert len(set(seen_seeds)) == 3 and heldout_seed(5, 0) != heldout_seed(6, 0)
    for rec in records:
        assert set(FIELDS) <= set(rec) and rec["heldout_prompts"] == len(HELDOUT)
        assert 0 <= rec["heldout_reward"] <= 1 and 0 <= rec["heldout_greedy_accuracy"] <= 1
        assert 1 <= rec["heldout_response_tokens"] <= 10
    assert all(START + k in records[0] for k in FIELDS) and not any(START + k in records[1] for k in FIELDS)
    assert records[0]["start_heldout_seed"] == heldout_seed(5, 0) and records[1]["heldout_seed"] == heldout_seed(5, 2)
    assert [p["epoch"] for p in heldout_curve(records)] == [0, 1, 2]


def test_eval_every_skips_epochs_but_always_evaluates_the_warm_start_and_the_last(tmp_path, seen_seeds):
    records = _trainer(tmp_path, epochs=5, eval_every=2).train()
    assert seen_seeds == [heldout_seed(5, e) for e in (0, 2, 4, 5)]
    assert [p["epoch"] for p in heldout_curve(records)] == [0, 2, 4, 5]
    assert "heldout_reward" not in records[0] and START + "heldout_reward" in records[0]
    with pytest.raises(ValueError, match="eval_every"):
        _config(eval_every=0)


def test_lossless_modes_beside_vanilla_are_evaluated_after_the_last_epoch_only():
    from spec_rl.trainer.run import run_configs

    base = _config(epochs=4)
    together = run_configs(base, {m: MODES[m] for m in ("vanilla", "spec", "exact", "histspec")})
    assert {m: c.eval_every for m, c in together.items()} == {"vanilla": 1, "spec": 1, "exact": 4, "histspec": 4}
    assert {m: c.mode for m, c in together.items()} == {m: MODES[m] for m in together}
    assert all(c.lr == base.lr and c.sampling == base.sampling for c in together.values())
    alone = run_configs(base, {m: MODES[m] for m in ("exact", "histspec")})  # nothing to repeat: every epoch
    assert {c.eval_every for c in alone.values()} == {1}


def test_the_warm_start_evaluation_is_the_same_in_every_mode(tmp_path):
    starts = {}
    for mode in ("vanilla", "spec", "random"):
        records = _trainer(tmp_path / mode, mode=mode, epochs=1).train()
        starts[mode] = {k: records[0][START + k] for k in FIELDS if k != "heldout_seconds"}
    assert starts["vanilla"] == starts["spec"] == starts["random"]


def test_a_known_warm_start_evaluation_is_not_redone(tmp_path, seen_seeds):
    first = _trainer(tmp_path / "spec", epochs=1)
    assert first.initial_heldout is None
    first.train()
    assert set(FIELDS) <= set(first.initial_heldout) and len(seen_seeds) == 2
    second = _trainer(tmp_path / "vanilla", mode="vanilla", epochs=1)
    second.initial_heldout = first.initial_heldout  # another run from the same weights, seed and held-out set
    (rec,) = second.train()
    assert seen_seeds[2:] == [heldout_seed(5, 1)]  # after its epoch only
    assert all(rec[START + k] == first.initial_heldout[k] for k in FIELDS)


def test_evaluation_uses_fresh_samples_whatever_the_cache(tmp_path):
    tok, model = tiny_tokenizer(), tiny_model(seed=0)
    settings = SamplingSettings(max_tokens=10)
    first = evaluate_heldout(model, tok, HELDOUT, settings, 3, seed=9, reward_fn=_parity, batch_size=2)
    trainer = _trainer(tmp_path, model=model, epochs=1)
    trainer.train_step(range(4), epoch=0)  # fills the rollout cache; the weights move
    trainer.model.load_state_dict(tiny_model(seed=0).state_dict())
    again = evaluate_heldout(trainer.model, tok, HELDOUT, settings, 3, seed=9, reward_fn=_parity, batch_size=5)
    assert again == first  # same weights, same seed: the same samples (batch size does not matter either)
    with pytest.raises(ValueError, match="leaves no room"):
        evaluate_heldout(model, tok, HELDOUT, settings, 1, max_model_len=5)


def test_resume_keeps_the_evaluations_and_does_not_redo_them(tmp_path, seen_seeds):
    first = _trainer(tmp_path, epochs=1, save_checkpoint=True).train()
    assert len(seen_seeds) == 2
    model = load_policy(latest_checkpoint(tmp_path).path)[0]
    resumed = _trainer(tmp_path, model=model, epochs=2, save_checkpoint=True)
    assert resumed.resume() and resumed.records == first
    records = resumed.train()
    assert seen_seeds[2:] == [heldout_seed(5, 2)]  # only the new epoch is evaluated
    assert records[0] == first[0] and records[1]["heldout_seed"] == heldout_seed(5, 2)
    assert latest_checkpoint(tmp_path).state["records"] == records


def test_no_eval_examples_means_no_heldout_fields(tmp_path):
    trainer = GRPOTrainer(
        tiny_model(seed=0), tiny_tokenizer(), TRAIN, _parity, _config(epochs=1), tmp_path, progress=False
    )
    (rec,) = trainer.train()
    assert not any(k.startswith(("heldout_", START)) for k in rec)
    with pytest.raises(ValueError, match="held-out prompt"):
        GRPOTrainer(
            tiny_model(),
            tiny_tokenizer(),
            TRAIN,
            _parity,
            _config(max_model_len=20),
            tmp_path,
            eval_examples=_examples([(1, 1)], "e") + [Example("Question: " + "Tom has 1 . " * 10, "1", "long", "t")],
        )


def test_reward_split_adds_up_to_the_rollout_reward(tmp_path):
    records = _trainer(tmp_path, epochs=3, lr=1e-4, lenience=1.0).train()  # l = 1: whole, partial and fresh ones
    for rec in records:
        counts = [rec[f"count_{o}"] for o in ORIGINS]
        assert sum(counts) == rec["samples"]
        weighted = sum(rec[f"reward_{o}"] * rec[f"count_{o}"] for o in ORIGINS if rec[f"count_{o}"])
        assert weighted / rec["samples"] == pytest.approx(rec["mean_reward"], abs=1e-12)
        assert all((rec[f"reward_{o}"] is None) == (rec[f"count_{o}"] == 0) for o in ORIGINS)
    assert records[0]["count_fresh"] == records[0]["samples"]  # epoch 1 has no drafts
    later = records[1:]
    assert sum(r["count_partly_reused"] for r in later) > 0 and sum(r["count_reused_whole"] for r in later) > 0
    assert all(r["count_reused_whole"] == round(r["full_reuse_ratio"] * r["samples"]) for r in records)


def test_response_origins_and_means():
    result = SimpleNamespace(
        draft_found=[False, True, True, True],
        verified_prefix_len=[0, 0, 2, 3],
        response_ids=[[1, 2], [4, 5], [1, 2, 7], [1, 2, 3]],
    )
    origins = response_origins(result)
    assert origins == ["fresh", "fresh", "partly_reused", "reused_whole"]
    sums = origin_sums(origins, [1.0, 0.0, 1.0, float("nan")])
    assert origin_means(sums) == {
        "reward_reused_whole": None,
        "count_reused_whole": 0,
        "reward_partly_reused": 1.0,
        "count_partly_reused": 1,
        "reward_fresh": 0.5,
        "count_fresh": 2,
    }
    with pytest.raises(ValueError, match="origins"):
        origin_sums(origins, [1.0])
    with pytest.raises(ValueError, match="unknown origin"):
        origin_sums(["reused"], [1.0])


def test_demo_heldout_set_is_disjoint_from_the_train_set():
    from spec_rl.tasks.demo_data import demo_eval_set, demo_train_set

    train, evals = demo_train_set(), demo_eval_set()
    assert len(evals) == 640 and evals == demo_eval_set()
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    assert not {e.uid for e in train} & {e.uid for e in evals}


def test_heldout_split_is_seeded_disjoint_and_keeps_repeated_prompts_together():
    data = TRAIN + _examples([(1, 2)], "dup") + _examples([(6, 1), (2, 5), (3, 3)], "t")
    train, held = heldout_split(data, 0.25, seed=1)
    assert (train, held) == heldout_split(data, 0.25, seed=1)
    assert len({e.prompt for e in held}) == 2 and len(train) + len(held) == len(data)
    assert not {e.prompt for e in train} & {e.prompt for e in held}
    assert heldout_split(data, 0.25, seed=2) != (train, held) or heldout_split(data, 0.25, seed=3) != (train, held)
    assert len(heldout_split(data, 0.01, seed=0)[1]) >= 1 and len(heldout_split(data, 0.99, seed=0)[0]) >= 1
    for bad in (0.0, 1.0, math.nan, True):
        with pytest.raises(ValueError, match=r"in \(0, 1\)"):
            heldout_split(data, bad, seed=0)
    with pytest.raises(ValueError, match="cannot be split"):
        heldout_split(TRAIN[:1] * 3, 0.5, seed=0)
