"""The embedded demo policy: a small (~0.6M-parameter) transformers model,
warm-started on arithmetic word problems, trained once and cached.

What :func:`build_demo_policy` makes (all in-process, offline):

1. A byte-level BPE tokenizer with every digit its own token
   (:mod:`spec_rl.tasks.demo_tokenizer`).
2. A small Qwen2-architecture causal LM, warm-started by SFT on worked
   solutions with injected arithmetic slips and one systematic error
   (:mod:`spec_rl.tasks.demo_sft`),
   on problems disjoint from the demo train/eval sets
   (:mod:`spec_rl.tasks.demo_data`).

Everything that shapes the checkpoint is in :class:`DemoConfig`; its
:meth:`~DemoConfig.cache_key` names the cache folder. The checkpoint is a
normal transformers directory (``config.json``, ``generation_config.json``,
``model.safetensors``, tokenizer files, plus ``demo_info.json`` with the
build record), loadable with ``AutoModelForCausalLM.from_pretrained(path)`` /
``AutoTokenizer.from_pretrained(path)``.

The default configuration (measured on a 2-core CPU, about 2 minutes of SFT)
gives a warm-started policy that, sampling at temperature 1 without
top-k/top-p, earns a mean :func:`~spec_rl.tasks.arithmetic.arithmetic_reward`
of about 0.24 on :func:`demo_eval_set` (greedy decoding: about 0.44; 0.06 on
the problems with a "boxes" line, 0.70 on the others) with responses of about
82 tokens (EOS included; all well under 160).

This module also re-exports the demo's public names from those modules, so
``spec_rl.tasks.demo_policy`` is the one import a caller needs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .arithmetic import TASK_VERSION, generate_problems
from .demo_config import RECIPE_VERSION, DemoConfig
from .demo_data import DEMO_MAX_NEW_TOKENS, DEMO_TASK_OPTIONS, demo_eval_set, demo_response, demo_train_set
from .demo_sft import make_demo_model
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
    """Train (or reuse) the demo policy and return its checkpoint directory.

    The checkpoint lives in ``<cache_dir>/demo-policy-<hash>`` where hash is
    :meth:`DemoConfig.cache_key`; if that directory is complete it is returned
    without training. A build trains into a temporary directory next to it
    and renames it into place (atomic on POSIX), so an interrupted build never
    leaves a directory that would be taken as a valid checkpoint; concurrent
    builds of the same config are safe (the first rename wins). Thread count is
    left to the caller (``torch.set_num_threads``). Global RNG state is
    restored afterwards.

    Parameters
    ----------
    cache_dir : str or Path, optional
        Parent folder; default :func:`default_cache_dir` (``$SPEC_RL_CACHE``
        or ``~/.cache/spec-rl``).
    force : bool
        Retrain and replace an existing checkpoint.
    progress : bool
        Show a tqdm bar during SFT.
    config : DemoConfig, optional
        Model/SFT settings (default :class:`DemoConfig`; tests pass a tiny one).

    Returns
    -------
    Path
        The checkpoint directory (``config.json``, ``generation_config.json``,
        ``model.safetensors``, tokenizer files, ``demo_info.json`` with the SFT
        record: seconds, losses, parameter count, vocab size).

    Raises
    ------
    TypeError
        ``config`` is not a DemoConfig.
    OSError
        The cache directory cannot be created or written.

    Example
    -------
    >>> path = build_demo_policy(progress=False)  # doctest: +SKIP
    >>> path.name  # doctest: +SKIP
    'demo-policy-10b0ca1c3559'
    """
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

    train = demo_train_set()
    evals = demo_eval_set()
    held_out = {e.question for e in train} | {e.question for e in evals}
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
