"""Settings of the small GRPO trainer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..acceptance.mode import TRAINER_MODE, RolloutMode
from ..backends import BACKENDS
from ..sampling.distribution import SamplingSettings, check_settings
from ..tasks.data import PromptFormat
from ..util.validation import check_choice, check_int, check_real, check_type
from .correction import RolloutCorrection


def parse_device(name: str) -> torch.device | None:
    """The torch device ``name`` names (None for "auto"); ValueError unless it is a cpu, cuda or mps device."""
    if name == "auto":
        return None
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device must be auto, cpu, cuda, cuda:<index> or mps, got {name!r}")
    return device


def resolve_device(name: str) -> torch.device:
    """The device to train on ("auto": CUDA when present, else CPU); ValueError for a bad or absent device."""
    device = parse_device(name)
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and count <= (device.index or 0):
        why = f"has {count} CUDA device(s): cuda:0..cuda:{count - 1}" if count else "has no CUDA device"
    elif device.type == "mps" and not torch.backends.mps.is_available():
        why = "has no MPS device"
    else:
        return device
    raise ValueError(f"device is {name!r} but this machine {why}; use auto or cpu")


#: GRPO's usual learning rate on a pretrained model (the paper's recipe, Sec. 4).
LR = 1e-6
#: GRPOConfig fields that count something, each >= 1.
_COUNTS = ("epochs", "prompts_per_step", "ppo_mini_batches", "micro_batch_size", "eval_samples", "eval_every")


@dataclass
class GRPOConfig:
    """Options of the GRPO trainer with speculative rollouts (the fields: docs/api.md "Trainer"); the defaults are for a
    user's pretrained model, :func:`preset` names other recipes. ``mode``: how rollouts reuse drafts (its ``tail`` is
    the tail-speculation width). ``max_model_len``: prompt + response limit in tokens (None: the model's
    max_position_embeddings). ``seed`` keys data order, sampling, acceptance and the held-out evaluation.
    ``eval_every``: evaluate every N-th epoch and the last. ``rollout_correction``: importance weights of reused tokens
    (:mod:`.correction`; a RolloutCorrection, its name such as "tis" or "mis:5", or None: off). The residual draw's
    weight copies (:mod:`spec_rl.rollout.old_policy`) may take ``version_budget_gb`` GB (None: half of the available
    memory, or of the free disk with ``versions_on_disk``: safetensors files under the run directory). A field out of
    range or of the wrong type raises ValueError or TypeError naming it."""

    mode: RolloutMode = RolloutMode.parse(TRAINER_MODE)
    sampling: SamplingSettings = field(default_factory=lambda: SamplingSettings(max_tokens=1024))
    prompt_format: PromptFormat = field(default_factory=PromptFormat)
    epochs: int = 3
    group_size: int = 8
    prompts_per_step: int = 32
    ppo_mini_batches: int = 1
    micro_batch_size: int = 8
    lr: float = LR
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    scale_adv_by_std: bool = True
    max_model_len: int | None = None
    seed: int = 0
    eval_samples: int = 4
    eval_every: int = 1
    save_checkpoint: bool = True
    device: str = "auto"
    generation_backend: str = "auto"
    rollout_correction: RolloutCorrection | None = None
    version_budget_gb: float | None = None
    versions_on_disk: bool = False

    def __post_init__(self) -> None:
        self.mode = RolloutMode.parse(self.mode)
        self.rollout_correction = RolloutCorrection.parse(self.rollout_correction)
        check_settings(self.sampling, "sampling")
        check_type("prompt_format", self.prompt_format, PromptFormat)
        check_choice("generation_backend", self.generation_backend, ("auto", *BACKENDS))
        for name in _COUNTS:
            check_int(name, getattr(self, name), low=1)
        check_int("group_size", self.group_size, low=2, hint=" (GRPO compares the G samples of a prompt)")
        check_int("seed", self.seed, low=-(2**63), high=2**64 - 1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, low=2, hint=" (None: the model's max_position_embeddings)")
        check_real("lr", self.lr, low=0.0, low_open=True, high=1.0, hint=" (AdamW moves a weight by about lr a step)")
        check_real("weight_decay", self.weight_decay, low=0.0)
        check_real("max_grad_norm", self.max_grad_norm, low=0.0, low_open=True, finite=False)
        check_real("clip_low", self.clip_low, low=0.0, high=1.0, high_open=True)
        check_real("clip_high", self.clip_high, low=0.0)
        check_real("kl_coef", self.kl_coef, low=0.0, hint=" (0 turns the KL term off)")
        if self.version_budget_gb is not None:
            check_real("version_budget_gb", self.version_budget_gb, low=0.0, low_open=True, hint=" (None: automatic)")
        for name in ("scale_adv_by_std", "save_checkpoint", "versions_on_disk"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        parse_device(self.device)

    def context_limit(self, positions: int | None) -> int:
        """The prompt + response limit of a model with ``positions`` (its max_position_embeddings, None: unknown):
        ``max_model_len``, or the positions. ValueError when ``max_model_len`` passes the positions, none is known, or
        the response budget leaves no room for a prompt (responses would be cut to fit, silently)."""
        if self.max_model_len is None and not positions:
            raise ValueError("cannot infer max_model_len from the model config; set GRPOConfig.max_model_len")
        if positions and self.max_model_len is not None and self.max_model_len > positions:
            raise ValueError(
                f"max_model_len must be <= the model's max_position_embeddings ({positions}), got {self.max_model_len}"
            )
        limit = self.max_model_len or positions
        if self.sampling.max_tokens >= limit:
            what = "max_model_len" if self.max_model_len else "context (max_position_embeddings)"
            raise ValueError(
                f"max_tokens must be < the {what} of {limit} tokens (a prompt and its response share it), got "
                f"{self.sampling.max_tokens}: responses would be cut to fit silently"
            )
        return int(limit)

    def to_dict(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["rollout_correction"] = getattr(self.rollout_correction, "name", None)
        return {k: v.to_dict() if k in ("mode", "sampling", "prompt_format") else v for k, v in values.items()}


@dataclass(frozen=True)
class Preset:
    """A named recipe: the runs it compares by default (mode names, each meaning what it means everywhere) and the
    config fields it changes (``max_tokens``: the response budget)."""

    runs: tuple[str, ...]
    fields: dict


#: The demo (docs/design.md "The demo recipe"): the embedded toy policy, lr 1e-4, 5 epochs of 256 prompts x G = 4;
#: its lenient run is l = 1 with the without-draft draw (the paper's rule that costs this task the least learning).
PRESETS = {
    "demo": Preset(
        runs=("vanilla", "l=1-excl", "exact", "histspec"),
        fields=dict(
            epochs=5,
            group_size=4,
            prompts_per_step=64,
            lr=1e-4,
            max_tokens=160,
            ppo_mini_batches=2,
            micro_batch_size=128,
            eval_samples=1,
        ),
    ),
    "model": Preset(runs=(TRAINER_MODE,), fields={}),
}


def preset(name: str, sampling: SamplingSettings | None = None, **overrides) -> GRPOConfig:
    """The config of preset ``name`` with ``overrides`` (None values are ignored; ``max_tokens`` sets the budget);
    ``sampling`` sets temperature, top-k and top-p."""
    fields = {**PRESETS[name].fields, **{k: v for k, v in overrides.items() if v is not None}}
    sampling = sampling or SamplingSettings()
    budget = fields.pop("max_tokens", GRPOConfig.__dataclass_fields__["sampling"].default_factory().max_tokens)
    return GRPOConfig(sampling=dataclasses.replace(sampling, max_tokens=budget), **fields)


@dataclass(frozen=True)
class RunSetting:
    """One run of the trainer: its rollout mode and its rollout correction (None: the config's)."""

    mode: RolloutMode
    correction: RolloutCorrection | None = None

    @classmethod
    def parse(cls, name) -> RunSetting:
        """``<mode>[+<correction>]``: a mode name :meth:`RolloutMode.parse` reads, then optionally ``+tis``, ``+mis``
        or either with ``:<threshold>`` (e.g. ``spec+tis``, ``l=1+mis:5``); a RunSetting or RolloutMode is taken as
        it is. ValueError naming the part at fault."""
        if isinstance(name, RunSetting):
            return name
        if not isinstance(name, str):
            return cls(RolloutMode.parse(name))
        mode, plus, correction = name.partition("+")
        setting = cls(RolloutMode.parse(mode), RolloutCorrection.parse(correction) if plus else None)
        if plus and setting.correction is None:
            raise ValueError(f"{name!r}: +none names no correction; drop the suffix")
        if setting.correction is not None and setting.mode.rule is None:
            raise ValueError(f"{name!r}: {mode} reuses no drafts, so there is nothing to correct; drop +{correction}")
        return setting


def run_settings(names, what: str = "modes") -> dict[str, RunSetting]:
    """``names`` (each a name :meth:`RunSetting.parse` reads) as {name: RunSetting}, in order; ValueError naming
    ``what`` (the argument) for a name that names no run, a name twice or none."""
    names = list(names)
    if not names:
        raise ValueError(f"{what} is empty: name at least one run (e.g. vanilla,spec)")
    if len(set(names)) != len(names):
        raise ValueError(f"{what} names a run twice: {names} (each run has one folder)")
    runs = {}
    for name in names:
        try:
            runs[name] = RunSetting.parse(name)
        except ValueError as err:
            raise ValueError(f"{what}: {name}: {err}") from None
    return runs
