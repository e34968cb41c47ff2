"""The embedded demo policy: a small transformers model warm-started on arithmetic problems, trained once and cached.

:func:`build_demo_policy` trains the tokenizer (:mod:`.demo_tokenizer`) and the SFT warm start (:mod:`.demo_sft`)
offline, on problems disjoint from the demo sets, into a plain transformers checkpoint named by
:meth:`DemoConfig.cache_key`. This module re-exports the demo's public names."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .arithmetic import TASK_VERSION, generate_problems
from .demo_data import DEMO_MAX_NEW_TOKENS, DEMO_TASK_OPTIONS, demo_eval_set, demo_response, demo_train_set
from .demo_sft import RECIPE_VERSION, DemoConfig, make_demo_model
from .demo_sft import run_sft as _sft  # module-level name, so tests can replace the SFT step
from .demo_tokenizer import EOS_TOKEN, PAD_TOKEN, build_demo_tokenizer
from .evaluation import evaluate_policy

__all__ = [
    "DemoConfig",
    "DEMO_MAX_NEW_TOKENS",
    "DEMO_TASK_OPTIONS",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "build_demo_policy",
    "build_demo_tokenizer",
    "default_cache_dir",
    "demo_eval_set",
    "demo_response",
    "demo_train_set",
    "evaluate_policy",
]

# A checkpoint directory holding all of these is complete; demo_info.json is written last.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "demo_info.json")


def default_cache_dir() -> Path:
    """``$SPEC_RL_CACHE`` if set, else ``~/.cache/spec-rl``."""
    env = os.environ.get("SPEC_RL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "spec-rl"


def _is_complete(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in _REQUIRED_FILES)


def build_demo_policy(
    cache_dir: str | Path | None = None, force: bool = False, progress: bool = True, config: DemoConfig | None = None
) -> Path:
    """Train (or reuse) the demo policy; returns its directory ``<cache_dir>/demo-policy-<DemoConfig.cache_key()>``. A
    complete directory is returned as it is unless ``force``. A build trains into a temporary directory and renames it
    into place, so an interrupted build never looks complete and concurrent builds are safe (the first rename wins). The
    global RNG state is restored; the thread count is the caller's. ``cache_dir`` defaults to :func:`default_cache_dir`.
    Besides the transformers files the directory holds ``demo_info.json``, the build record. Raises TypeError when
    ``config`` is not a DemoConfig, OSError when the cache cannot be written."""
    cfg = config if config is not None else DemoConfig()
    if not isinstance(cfg, DemoConfig):
        raise TypeError(f"config must be a DemoConfig, got {type(cfg).__name__}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    name = f"demo-policy-{cfg.cache_key()}"
    final = root / name
    if _is_complete(final) and not force:
        return final
    root.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        with torch.random.fork_rng(devices=[]):
            _train_into(tmp, cfg, progress)
        if final.exists():
            if _is_complete(final) and not force:  # another process finished first
                return final
            old = Path(tempfile.mkdtemp(prefix=f".old-{name}-", dir=root))
            os.replace(final, old / "ckpt")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if _is_complete(final):  # lost a race to a concurrent build
                return final
            raise
        tmp = None
        return final
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _train_into(out: Path, cfg: DemoConfig, progress: bool) -> None:
    """Build tokenizer and model, run the SFT and save the checkpoint into ``out``."""
    import transformers

    held_out = {e.question for e in demo_train_set() + demo_eval_set()}
    corpus = generate_problems(cfg.tokenizer_corpus, seed=cfg.sft_seed + 1, **DEMO_TASK_OPTIONS)
    texts = [e.prompt + demo_response(e) for e in corpus]
    tokenizer = build_demo_tokenizer(texts, cfg.vocab_size, cfg.max_position_embeddings)
    sft_set = generate_problems(
        cfg.sft_examples,
        seed=cfg.sft_seed,
        exclude=held_out,
        slip_prob=cfg.slip_prob,
        misconception_prob=cfg.misconception_prob,
        **DEMO_TASK_OPTIONS,
    )
    model = make_demo_model(cfg, tokenizer)
    record = _sft(model, tokenizer, cfg, sft_set, progress)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {
        "cache_key": cfg.cache_key(),
        "config": dataclasses.asdict(cfg),
        "task_options": dict(DEMO_TASK_OPTIONS),
        "task_version": TASK_VERSION,
        "recipe_version": RECIPE_VERSION,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "torch_threads": torch.get_num_threads(),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        **record,
    }
    # Written last: its presence marks a complete checkpoint.
    (out / "demo_info.json").write_text(json.dumps(info, indent=2) + "\n")
