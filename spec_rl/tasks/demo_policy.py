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

from ..util.validation import check_type
from .arithmetic import TASK_VERSION, generate_problems
from .demo_data import DEMO_MAX_NEW_TOKENS, DEMO_TASK_OPTIONS, demo_eval_set, demo_response, demo_train_set
from .demo_sft import RECIPE_VERSION, DemoConfig, make_demo_model
from .demo_sft import run_sft as _sft  # module-level name, so tests can replace the SFT step
from .demo_tokenizer import EOS_TOKEN, PAD_TOKEN, build_demo_tokenizer

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
]

# A checkpoint directory holding all of these is complete; demo_info.json is written last.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "demo_info.json")


def default_cache_dir() -> Path:
    """``$SPEC_RL_CACHE`` if set, else ``~/.cache/spec-rl``."""
    env = os.environ.get("SPEC_RL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "spec-rl"


def _is_complete(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in _REQUIRED_FILES)


#: The default demo policy as it ships (its SFT run once; a float32 SFT gives other weights on another CPU's
#: kernels, and the demo's numbers would follow): file -> sha256, checked whenever it is installed.
WARM_START = Path(__file__).resolve().parent / "demo_warm_start"
WARM_START_SHA256 = {
    "config.json": "b960d45f7a37338be48a3dc8fb01735fa75ede2240bbe9363df095a3a050e14b",
    "demo_info.json": "958c341b5c060a94fa7b33995996bdbf891bee0fc3507d89d3e1cfd3485501b3",
    "generation_config.json": "2737a6f88dd41def454aa6dcdde105b4700fda9b61eda847e2b3d1d24e256d97",
    "model.safetensors": "d42a1efa3ef60b15489b2b3f446854f4718688013ff2b963086a131b2eb5de06",
    "tokenizer.json": "110992f5ff90c91883402ff12aa5980ad55a7dde206a514d1e9b4857b9388209",
    "tokenizer_config.json": "2fc8dcd7eed8f302db9545a6a041815896ac46c6179f5b4a5d952ff7125cadb9",
}


def build_demo_policy(
    cache_dir: str | Path | None = None, force: bool = False, progress: bool = True, config: DemoConfig | None = None
) -> Path:
    """The demo policy's directory ``<cache_dir>/demo-policy-<DemoConfig.cache_key()>``: the default config's is the
    shipped warm start (:data:`WARM_START`, its files checked against :data:`WARM_START_SHA256`; the folder name ends
    with the weights' sha256 prefix), another config's (or any with ``force``) is trained by the SFT. A complete
    directory is returned as it is unless ``force``. A build writes a temporary directory and renames it into place,
    so an interrupted build never looks complete and concurrent builds are safe (the first rename wins). The global
    RNG state is restored; the thread count is the caller's. ``cache_dir`` defaults to :func:`default_cache_dir`.
    Besides the transformers files the directory holds ``demo_info.json``, the build record. Raises TypeError when
    ``config`` is not a DemoConfig, OSError when the cache cannot be written, ValueError when a shipped file does not
    match its sha256."""
    cfg = check_type("config", config if config is not None else DemoConfig(), DemoConfig)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    shipped = cfg == DemoConfig() and not force
    # the shipped policy in its own folder: an earlier SFT build on this machine (other weights) is never taken for it
    name = f"demo-policy-{cfg.cache_key()}" + (f"-{WARM_START_SHA256['model.safetensors'][:8]}" if shipped else "")
    final = root / name
    if _is_complete(final) and not force:
        return final
    root.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        if shipped:
            _install_warm_start(tmp)
        else:
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


def _install_warm_start(out: Path) -> None:
    """Copy the shipped warm-start files into ``out``, each checked against its sha256 (``demo_info.json`` last)."""
    import hashlib

    for name in sorted(WARM_START_SHA256, key=lambda n: n == "demo_info.json"):
        data = (WARM_START / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != WARM_START_SHA256[name]:
            raise ValueError(
                f"the shipped demo policy file {WARM_START / name} does not match its sha256: the installed package "
                "is damaged; reinstall spec-rl, or rebuild the policy by its SFT (build_demo_policy(force=True))"
            )
        (out / name).write_bytes(data)


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
