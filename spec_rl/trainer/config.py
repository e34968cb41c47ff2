"""Settings of the small GRPO trainer."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

import torch

from ..acceptance.adaptive import DEFAULT_TARGET_DRIFT
from ..acceptance.reference import LENIENCE_DEFAULTS, REJECTION_DRAWS

MODES = ("vanilla", "spec", "random", "random-ref")
GENERATION_BACKENDS = ("auto", "transformers", "paged", "vllm")
ACCEPTANCE_RULES = ("lenient", "exact")

#: Integer fields that count something and must be >= 1.
_COUNTS = (
    "epochs", "group_size", "prompts_per_step", "ppo_mini_batches", "micro_batch_size", "max_response_len", "eval_samples",
    "eval_every",
)  # fmt: skip


def log_lenience_of(lenience) -> float | str:
    """log l for the records ("auto" stays "auto"; l = 0 is -inf)."""
    if lenience == "auto":
        return "auto"
    return math.log(lenience) if lenience > 0 else float("-inf")


class ConfigError(ValueError):
    """A bad setting: ``field`` names it and ``requirement`` says what it must be and what it got.

    ``str(err)`` reads "<field> <requirement>"; the CLI prints the flag instead of the field.
    """

    def __init__(self, field: str, requirement: str):
        super().__init__(f"{field} {requirement}")
        self.field, self.requirement = field, requirement


def check_int(name: str, value, low: int, high: int | None = None, hint: str = "", span: str = "") -> int:
    """Raise :class:`ConfigError` unless ``value`` is an int (not a bool, not a float) in [low, high].

    ``span`` replaces the range in the message (e.g. "in [0, 2**64 - 1]").
    """
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    ok = ok and low <= value and (high is None or value <= high)
    if not ok:
        span = span or (f">= {low}" if high is None else f"in [{low}, {high}]")
        raise ConfigError(name, f"must be an integer {span}{f' ({hint})' if hint else ''}, got {value!r}")
    return int(value)


def check_float(
    name: str,
    value,
    low: float,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    allow_inf: bool = False,
    hint: str = "",
) -> float:
    """Raise :class:`ConfigError` unless ``value`` is a real number (not NaN; inf only if allowed) in range.

    The range is [low, high] with ``low_open``/``high_open`` making that end exclusive; no ``high``
    means no upper end.
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (allow_inf or math.isfinite(value))
    ok = ok and (value > low if low_open else value >= low)
    ok = ok and (high is None or (value < high if high_open else value <= high))
    if not ok:
        if high is None:
            span = f"{'>' if low_open else '>='} {low:g}"
        else:
            span = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        kind = "a number (inf allowed)" if allow_inf else "a finite number"
        raise ConfigError(name, f"must be {kind} {span}{f' ({hint})' if hint else ''}, got {value!r}")
    return float(value)


def parse_device(name: str) -> torch.device | None:
    """The torch device ``name`` names (None for "auto"); :class:`ConfigError` for a string torch cannot parse."""
    if name == "auto":
        return None
    try:
        return torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError("device", f"must be auto, cpu, cuda, cuda:<index> or mps, got {name!r}") from None


def resolve_device(name: str) -> torch.device:
    """The device to train on: "auto" picks CUDA when present, else CPU.

    Raises:
        ConfigError: ``name`` is not a device string, or names a device this machine does not have.
    """
    device = parse_device(name)
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError("device", f"is {name!r} but this machine has no CUDA device; use auto or cpu")
        if device.index is not None and device.index >= count:
            last = f"cuda:{count - 1}"
            raise ConfigError("device", f"is {name!r} but this machine has {count} CUDA device(s): cuda:0..{last}")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError("device", f"is {name!r} but MPS is not available on this machine; use auto or cpu")
    elif device.type != "cpu":
        raise ConfigError("device", f"must be auto, cpu, cuda, cuda:<index> or mps, got {name!r}")
    return device


#: Run labels of ``run_modes``/``--modes`` and the config fields each one sets. Plain "vanilla"
#: is the reference of every ratio; "histspec" is vanilla decoding with history speculation only
#: (the HistoSpec-style baseline), "exact" is SPEC-RL with lossless acceptance.
MODE_PRESETS = {
    "vanilla": dict(mode="vanilla", history_spec=False, rejection_draw="policy"),
    "histspec": dict(mode="vanilla", history_spec=True, rejection_draw="policy"),
    "spec": dict(mode="spec"),
    "exact": dict(mode="spec", acceptance="exact", rejection_draw="policy"),
    "random": dict(mode="random", rejection_draw="policy"),
    "random-ref": dict(mode="random-ref", rejection_draw="policy"),
    "auto": dict(mode="spec", lenience="auto"),
}
#: Labels whose responses are vanilla's token for token (exact acceptance, tail speculation verified
#: exactly). Beside a vanilla run they are evaluated at the warm start and after the last epoch only
#: (the parity check), which keeps `make run` within its time with a 640-problem held-out set.
LOSSLESS_MODES = ("exact", "histspec")


@dataclass
class GRPOConfig:
    """GRPO with optional speculative rollouts.

    Attributes:
        mode: "vanilla" (plain GRPO, no draft reuse), "spec" (SPEC-RL), "random" (random-reuse
            ablation, paper Table 2: n uniform over 0..L) or "random-ref" (the reference
            implementation's variant: n uniform over 0..L-1, never a full reuse).
        lenience: SPEC-RL lenience l (paper defaults, App. A.1: GRPO e^0.5, PPO e^0.3, DAPO e^0.15;
            :data:`spec_rl.acceptance.reference.LENIENCE_DEFAULTS`), or "auto": chosen every step so that the
            reused tokens drift by at most ``target_drift`` nats (:mod:`spec_rl.acceptance.adaptive`).
            None (default): the paper's value for ``algorithm``; ``lenience_source`` then records it.
        algorithm: "grpo", "ppo" or "dapo" (DAPO's clip-higher): which paper default lenience applies.
        lenience_source: how the lenience was chosen (set by the config; "" means given explicitly).
        target_drift: the bound of ``lenience="auto"`` (mean |lp_new - lp_old| of accepted tokens).
        acceptance: "lenient" (the paper's rule) or "exact" (lossless: accept y_i with
            probability pi_t(y_i), residual draw at the rejection; lenience unused).
        rejection_draw: the token at a lenient rejection index: "policy" (the paper: from pi_t) or
            "without-draft" (from pi_t without the rejected draft token); mode "spec" with lenient acceptance only.
        history_spec: verify history-drafted tokens in every decode step (tail speculation;
            changes no token, only decode steps). None: on for "spec" and "random", off for "vanilla".
        spec_tokens: most history-drafted tokens per decode step (0 disables tail speculation).
        sibling_drafts: with tail speculation, also draft from the tokens the other samples of the
            same prompt emit in the same rollout (so the first epoch speculates too; lossless). Off by
            default: on the CPU demo they cut decode steps but cost more time than they save
            (benchmarks/RESULTS.md, "Speculating where it pays").
        epochs: passes over the training prompts.
        group_size: G samples per prompt.
        prompts_per_step: prompts per rollout/update step.
        ppo_mini_batches: optimizer steps per rollout batch (1 = fully on-policy).
        micro_batch_size: samples per forward/backward (gradient accumulation).
        lr, weight_decay, max_grad_norm: AdamW and gradient clipping.
        clip_low, clip_high: PPO ratio clip range [1 - low, 1 + high];
            DAPO's clip-higher sets clip_high = 0.28.
        kl_coef: weight of the k3 KL to the frozen initial policy (0 = off).
        scale_adv_by_std: GRPO's std normalisation of group advantages.
        temperature, top_k, top_p, max_response_len: sampling settings.
        max_model_len: context limit (prompt + response); None = the model's
            max_position_embeddings.
        seed: seeds data order, sampling and acceptance uniforms (and the held-out evaluation's,
            :func:`spec_rl.trainer.heldout.heldout_seed`).
        eval_samples: fresh samples per held-out prompt at each evaluation (epoch 0 and after
            every epoch), drawn with the training sampling settings; used when the trainer gets
            held-out examples.
        eval_every: evaluate after every ``eval_every``-th epoch (and always after the last, and at the warm
            start); 1 = after every epoch.
        save_checkpoint: write a transformers checkpoint (and the rollout
            cache) after every epoch so a run can resume.
        generation_backend: "paged" (:class:`spec_rl.engine.PagedEngine`: paged
            KV cache, drafts spliced without re-prefill), "transformers"
            (:class:`spec_rl.backends.transformers_backend.TransformersBackend`), or "auto": paged
            on CUDA, transformers on CPU (measured: the paged engine decodes
            17-30% slower than the transformers loop for the CPU demo policy,
            whose cost is per-layer Python overhead, not attention), or "vllm"
            (:class:`spec_rl.backends.vllm_backend.VLLMBackend`: continuations on an offline vLLM engine,
            weights pushed after every update; needs vLLM).
    """

    mode: str = "spec"
    lenience: float | str | None = None
    algorithm: str = "grpo"
    lenience_source: str = ""
    target_drift: float = DEFAULT_TARGET_DRIFT
    acceptance: str = "lenient"
    rejection_draw: str = "policy"
    history_spec: bool | None = None
    spec_tokens: int = 8
    sibling_drafts: bool = False
    epochs: int = 5
    group_size: int = 4
    prompts_per_step: int = 64
    ppo_mini_batches: int = 2
    micro_batch_size: int = 64
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    scale_adv_by_std: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_response_len: int = 256
    max_model_len: int | None = None
    seed: int = 0
    eval_samples: int = 4
    eval_every: int = 1
    save_checkpoint: bool = True
    device: str = "auto"
    generation_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.algorithm not in LENIENCE_DEFAULTS:
            raise ConfigError("algorithm", f"must be one of {tuple(LENIENCE_DEFAULTS)}, got {self.algorithm!r}")
        if self.lenience is None:
            self.lenience = LENIENCE_DEFAULTS[self.algorithm]
            self.lenience_source = f"paper default for {self.algorithm.upper()} (App. A.1)"
        choice_fields = (("generation_backend", GENERATION_BACKENDS), ("mode", MODES), ("acceptance", ACCEPTANCE_RULES),
                         ("rejection_draw", REJECTION_DRAWS))  # fmt: skip
        for name, choices in choice_fields:
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in choices:  # arrays compare element-wise
                raise ConfigError(name, f"must be one of {choices}, got {getattr(self, name)!r}")
        if self.mode.startswith("random") and self.acceptance == "exact":
            raise ConfigError("acceptance", f"'exact' does not apply to the random-reuse ablation (mode {self.mode!r} ignores the scores)")
        if self.rejection_draw != "policy" and (self.mode != "spec" or self.acceptance != "lenient"):
            raise ConfigError("rejection_draw", f"{self.rejection_draw!r} applies to lenient SPEC-RL (mode 'spec', acceptance "
                              f"'lenient'), not mode {self.mode!r} with acceptance {self.acceptance!r}; drop it")  # fmt: skip
        for name in _COUNTS:
            check_int(name, getattr(self, name), low=1)
        # GRPO's advantage is a reward minus its group's mean: one sample per group always gets 0, and nothing is learned.
        check_int("group_size", self.group_size, low=2, hint="GRPO compares the G samples of a prompt; use G >= 2")
        check_int("spec_tokens", self.spec_tokens, low=0, hint="0 disables tail speculation")
        check_int("top_k", self.top_k, low=0, hint="0 disables top-k")
        check_int("seed", self.seed, low=-(2**63), high=2**64 - 1, span="in [-2**63, 2**64 - 1]")
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, low=2, hint="None: the model's max_position_embeddings")
        if self.lenience != "auto":
            check_float("lenience", self.lenience, low=0.0, allow_inf=True,
                        hint="0 means vanilla GRPO, inf accepts every draft, 'auto' adapts it")  # fmt: skip
        check_float("target_drift", self.target_drift, low=0.0, low_open=True, hint="nats")
        if self.rejection_draw != "policy" and self.lenience != "auto" and self.lenience < 1:  # a checked number now
            raise ConfigError("rejection_draw", f"{self.rejection_draw!r} needs lenience >= 1 (or 'auto'), got "
                              f"{self.lenience!r}: below 1 the residual keeps the rejected token; drop it")  # fmt: skip
        if self.lenience != "auto" and self.target_drift != DEFAULT_TARGET_DRIFT:
            raise ConfigError("target_drift", f"only applies with lenience='auto' (lenience is {self.lenience!r}); "
                              "drop it or set lenience='auto'")  # fmt: skip
        check_float("lr", self.lr, low=0.0, low_open=True)
        check_float("weight_decay", self.weight_decay, low=0.0)
        check_float("max_grad_norm", self.max_grad_norm, low=0.0, low_open=True, allow_inf=True)
        check_float("clip_low", self.clip_low, low=0.0, high=1.0, high_open=True)
        check_float("clip_high", self.clip_high, low=0.0)
        check_float("kl_coef", self.kl_coef, low=0.0, hint="0 turns the KL term off")
        check_float("temperature", self.temperature, low=0.0, low_open=True)
        check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True, hint="1 disables nucleus sampling")
        for name in ("history_spec", "sibling_drafts", "scale_adv_by_std", "save_checkpoint"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (value is None and name == "history_spec")):
                raise ConfigError(name, f"must be True or False, got {value!r}")
        parse_device(self.device)

    @property
    def rollout_strategy(self) -> str:
        """The rollout strategy this mode uses ("off" for vanilla and for lenience 0)."""
        if self.mode == "vanilla" or (self.mode == "spec" and self.lenience == 0):
            return "off"
        return self.mode

    @property
    def uses_history(self) -> bool:
        """Whether rollouts verify history-drafted tokens (tail speculation)."""
        on = self.mode != "vanilla" if self.history_spec is None else bool(self.history_spec)
        return on and self.spec_tokens > 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["log_lenience"] = log_lenience_of(self.lenience)
        d["lenience_source"] = self.lenience_source or "given"
        return d


#: What the demo compares by default: plain vanilla (the reference), SPEC-RL (lenient, with tail
#: speculation), SPEC-RL with exact acceptance, and vanilla with history speculation alone.
DEMO_MODES = ("vanilla", "spec", "exact", "histspec")

# Demo defaults, tuned so both modes finish in a few minutes on 2 CPU cores.
DEMO_DEFAULTS = dict(
    epochs=5,
    group_size=4,
    prompts_per_step=64,
    lr=1e-4,  # 3e-4 raised the sampled reward but cut greedy accuracy (docs/design.md "The demo recipe")
    max_response_len=160,
    ppo_mini_batches=2,
    micro_batch_size=128,
    # 640 held-out problems x 1 sample: a standard error <= 0.02 on the sampled reward and on greedy accuracy
    eval_samples=1,
)
#: The demo's SPEC-RL rule: l = 1 with the token at a rejection drawn without the rejected draft token,
#: not the paper's e^0.5 with a redraw from pi_t. On the demo task lenient reuse costs learning (spec-rl
#: sweep, 6 seeds, 4 epochs, 2026-12-02, benchmarks/RESULTS.md "Learning"; paired gap to vanilla +- s.e.):
#: held-out reward -0.049 +- 0.005 at e^0.5, -0.025 +- 0.003 at e^0.2, -0.028 +- 0.003 at l = 1 and
#: -0.022 +- 0.003 at l = 1 without-draft, whose greedy gap is the smallest (-0.017 vs -0.039 to -0.072)
#: at the same rollout time (2.86x vs 2.65x-3.17x). A user's own model keeps the paper's rule and default.
DEMO_LENIENCE = 1.0
DEMO_REJECTION_DRAW = "without-draft"
DEMO_LENIENCE_SOURCE = ("demo default (6 seeds, benchmarks/RESULTS.md: l = 1 with the without-draft draw costs the "
                        "least held-out reward, -0.022 +- 0.003; e^0.5: -0.049 +- 0.005)")  # fmt: skip
# Defaults for a user's own model and data (paper-like settings, Sec. 4).
MODEL_DEFAULTS = dict(
    epochs=3,
    group_size=8,
    prompts_per_step=32,
    lr=1e-6,
    max_response_len=1024,
    ppo_mini_batches=1,
    micro_batch_size=8,
    eval_samples=4,
)
