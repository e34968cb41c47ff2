"""Several verl rollout workers, one draft directory: verl's real AgentLoopManager on a local Ray cluster.

``SpecRLAgentLoopManager`` (verl's ``AgentLoopManager`` plus the step metrics) starts two
``AgentLoopWorker`` Ray actors, as ``RayPPOTrainer`` does; they run ``spec_rl_agent`` (tagged with
the worker that ran each sample, tests/verl_workers.py) against one fake rollout server actor and
share one ``DirectoryDraftStore``. The manager splits each batch in order between the workers, so
rotating the prompts by half a batch between epochs sends every prompt to the other worker. Checked:
every draft is found by a worker other than the one that wrote it; the same key written by 16
samples at once on both workers leaves one complete draft, one of theirs; and the DataProto verl
assembles has the shapes, masks and log-probs its trainer expects, with our columns and metrics.

Needs verl and Ray (``make test-vllm``, .venv-vllm); skipped elsewhere unless SPEC_RL_REQUIRE=1.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from optional import require

pytestmark = [pytest.mark.engines]
require("ray", "verl.experimental.agent_loop.agent_loop")

import ray  # noqa: E402
import torch  # noqa: E402
from repo_paths import TESTS  # noqa: E402
from tiny_models import tiny_demo_config  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from verl.protocol import DataProto  # noqa: E402

from spec_rl.drafts.cache import CacheKey  # noqa: E402
from spec_rl.drafts.directory import DirectoryDraftStore  # noqa: E402
from spec_rl.integrations.verl import settings_from_rollout_config  # noqa: E402
from spec_rl.integrations.verl_metrics import SpecRLAgentLoopManager  # noqa: E402
from spec_rl.tasks import build_demo_policy  # noqa: E402

PROMPT_LEN, RESPONSE_LEN, N, WORKERS = 32, 8, 2, 2
PROMPTS = [
    "Question: Tom has 3 apples.\nAnswer:",
    "Question: Ann buys 4 more pears.\nAnswer:",
    "Question: How many apples now?\nAnswer:",
    "Question: Tom sells 2 apples.\nAnswer:",
]
EOS = 0  # the demo tokenizer's
TAGGED = "spec_rl_agent_tagged"


def verl_config(model_dir: Path, loops_yaml: Path):
    """verl's own ppo_trainer config (hydra compose) with the rollout settings of this test."""
    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        cfg = compose(
            config_name="ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.rollout.name=vllm",
                f"actor_rollout_ref.rollout.prompt_length={PROMPT_LEN}",
                f"actor_rollout_ref.rollout.response_length={RESPONSE_LEN}",
                f"actor_rollout_ref.rollout.n={N}",
                "actor_rollout_ref.rollout.calculate_log_probs=True",
                f"actor_rollout_ref.rollout.agent.num_workers={WORKERS}",
                f"actor_rollout_ref.rollout.agent.default_agent_loop={TAGGED}",
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops_yaml}",
            ],
        )
    return cfg


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Ray (tests/ importable in its workers), a saved tiny policy, the fake server and the manager."""
    from verl_workers import FakeLLMClient, FakeRolloutServer

    root = tmp_path_factory.mktemp("verl-workers")
    model_dir, drafts = root / "policy", root / "drafts"
    # a seconds-to-build demo policy (BPE tokenizer: verl's Qwen2 token builder needs a real newline token)
    tok = AutoTokenizer.from_pretrained(build_demo_policy(root / "cache", progress=False, config=tiny_demo_config()))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(model_dir)
    AutoModelForCausalLM.from_pretrained(tok.name_or_path).save_pretrained(model_dir)
    loops = root / "loops.yaml"
    loops.write_text(f"- name: {TAGGED}\n  _target_: verl_workers.WorkerTaggedLoop\n  cache_dir: {drafts}\n")
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), old_path) if p)  # Ray workers inherit it
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        server = FakeRolloutServer.remote(str(model_dir), EOS, PROMPT_LEN + RESPONSE_LEN, RESPONSE_LEN, 0.2)
        cfg = verl_config(model_dir, loops)
        manager = SpecRLAgentLoopManager.create(config=cfg, llm_client=FakeLLMClient(server))
        yield dict(manager=manager, server=server, cfg=cfg, drafts=drafts, tok=tok)
    finally:
        ray.shutdown()
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path


def batch(prompt_numbers, slots=None) -> DataProto:
    """Rows as RayPPOTrainer hands them to the manager: each prompt repeated N times, interleaved."""
    rows = dict(raw_prompt=[], data_source=[], index=[], extra_info=[])
    for p in prompt_numbers:
        for _ in range(N):
            rows["raw_prompt"].append(np.array([{"role": "user", "content": PROMPTS[p % len(PROMPTS)]}], dtype=object))
            rows["data_source"].append("toy")
            rows["index"].append(p)
            rows["extra_info"].append({"index": p})
    cols = {k: np.array(v, dtype=object) if k != "index" else np.array(v) for k, v in rows.items()}
    if slots is not None:
        cols["spec_rl_slot"] = np.array(slots)
    return DataProto(non_tensor_batch=cols, meta_info={"global_steps": 1, "validate": False})


def responses(out: DataProto) -> list[list[int]]:
    mask = out.batch["response_mask"].bool()
    return [out.batch["responses"][i][mask[i]].tolist() for i in range(len(out))]


def check_assembled_batch(out: DataProto, rows: int) -> None:
    """The DataProto verl's trainer receives: shapes, masks, lengths and rollout log-probs agree."""
    b = out.batch
    assert len(out) == rows
    assert tuple(b["prompts"].shape) == (rows, PROMPT_LEN) and tuple(b["responses"].shape) == (rows, RESPONSE_LEN)
    for name in ("input_ids", "attention_mask", "position_ids"):
        assert tuple(b[name].shape) == (rows, PROMPT_LEN + RESPONSE_LEN), name
    assert tuple(b["response_mask"].shape) == tuple(b["rollout_log_probs"].shape) == (rows, RESPONSE_LEN)
    mask = b["response_mask"].bool()
    assert torch.equal(b["attention_mask"][:, PROMPT_LEN:].bool(), mask)  # single turn: no tool tokens
    lens = mask.sum(1)
    assert torch.equal(lens, torch.as_tensor(out.non_tensor_batch["spec_rl/response_len"].astype(np.int64)))
    for i, ids in enumerate(responses(out)):
        assert mask[i, : lens[i]].all() and not mask[i, lens[i] :].any()  # right-padded, no holes
        assert ids[-1] == EOS or len(ids) == RESPONSE_LEN, (i, ids)  # ends at EOS or at the budget
        assert EOS not in ids[:-1]
    lp = b["rollout_log_probs"]
    assert torch.isfinite(lp[mask]).all() and (lp[mask] <= 0).all() and (lp[~mask] == 0).all()
    gen = out.non_tensor_batch["spec_rl/tokens_generated"].astype(np.int64)
    reused = out.non_tensor_batch["spec_rl/verified_prefix_len"].astype(np.int64)
    assert np.array_equal(gen + reused, lens.numpy())


def test_drafts_found_across_workers_and_batch_shapes(cluster):
    manager, server = cluster["manager"], cluster["server"]
    first = manager.generate_sequences(batch([0, 1, 2, 3]))
    check_assembled_batch(first, 4 * N)
    assert len(set(first.non_tensor_batch["worker"])) == WORKERS
    assert not any(first.non_tensor_batch["spec_rl/draft_found"])
    timing = first.meta_info["timing"]
    assert timing["spec_rl/draft_found_ratio"] == 0.0 and timing["spec_rl/samples"] == 4 * N
    assert timing["spec_rl/tokens_generated"] == int(first.batch["response_mask"].sum())
    assert len(DirectoryDraftStore(cluster["drafts"])) == 4 * N  # no draft lost

    ray.get(server.set_step.remote(2))
    second = manager.generate_sequences(batch([2, 3, 0, 1]))  # half a batch rotated: other worker
    check_assembled_batch(second, 4 * N)
    written = {(int(first.non_tensor_batch["index"][i]), i % N): i for i in range(len(first))}
    for j in range(len(second)):
        i = written[(int(second.non_tensor_batch["index"][j]), j % N)]
        assert second.non_tensor_batch["worker"][j] != first.non_tensor_batch["worker"][i], "not a cross-worker hit"
        assert second.non_tensor_batch["spec_rl/draft_found"][j] is True
        # the same weights and l = e^0.5 keep every draft whole: the other worker's response, token for token
        assert second.non_tensor_batch["spec_rl/full_reuse"][j] is True
        assert responses(second)[j] == responses(first)[i]
        torch.testing.assert_close(
            second.batch["rollout_log_probs"][j], first.batch["rollout_log_probs"][i], atol=1e-5, rtol=0
        )
    timing = second.meta_info["timing"]
    assert timing["spec_rl/draft_found_ratio"] == 1.0 and timing["spec_rl/full_reuse_ratio"] == 1.0
    assert timing["spec_rl/tokens_generated"] == 0 and timing["spec_rl/reused_tokens"] == int(
        second.batch["response_mask"].sum()
    )


def test_one_key_written_by_many_samples_at_once(cluster):
    manager, drafts = cluster["manager"], cluster["drafts"]
    store = DirectoryDraftStore(drafts)
    before = len(store)
    rows = 8  # 8 prompts x N samples, all of one key (same prompt, index and slot): 16 concurrent writers
    out = manager.generate_sequences(batch([len(PROMPTS)] * rows, slots=[0] * rows * N))
    check_assembled_batch(out, rows * N)
    assert len(set(out.non_tensor_batch["worker"])) == WORKERS
    assert len(store) == before + 1
    assert not list(Path(drafts).rglob("*.tmp*")), "a temporary file was left behind"
    prompt_ids = out.batch["prompts"][0][out.batch["attention_mask"][0, :PROMPT_LEN].bool()].tolist()
    key = CacheKey.make(prompt_ids, 0, f"toy:{len(PROMPTS)}")
    draft = store.lookup(key, settings_from_rollout_config(cluster["cfg"].actor_rollout_ref.rollout))
    assert draft is not None, "the draft of the key was lost"
    candidates = [(ids, out.batch["rollout_log_probs"][i][: len(ids)]) for i, ids in enumerate(responses(out))]
    assert any(
        draft.token_ids.tolist() == ids and torch.allclose(draft.logprobs, lps, atol=1e-6, rtol=0)
        for ids, lps in candidates
    ), "the stored draft is none of the responses written (torn or mixed)"
