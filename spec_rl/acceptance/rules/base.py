"""What an acceptance rule is (docs/design.md "The rule", "Acceptance rules"): a frozen dataclass whose fields are the
user's settings, with its per-token test (the float64 reference the kernels are tested against), its switch of the
fused kernels."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...sampling.philox import STREAM_ACCEPT, philox_uniform
from ..reference import lengths_mask, rejection_index


@dataclass(frozen=True)
class Rule:
    """An acceptance rule. Subclass it as a frozen dataclass (its fields are the settings a user may change, e.g.
    ``lenience``), set :attr:`name`, and give :meth:`test` (or override :meth:`decide`); register it with
    :func:`spec_rl.acceptance.rules.register_rule`. A rollout verifies with it and draws the token at n from the
    scoring output, keyed like every decoded token (:mod:`spec_rl.acceptance.prefixes`)."""

    name: ClassVar[str]
    #: Every response is distributed as a fresh sample of the current policy, whatever the drafts.
    lossless: ClassVar[bool] = False
    #: The token at a rejection is drawn without the rejected draft token (a server resamples while it begins so).
    excludes_rejected: ClassVar[bool] = False
    #: In a rollout the prefixes are the policy's own keyed samples walking the group's drafts (the exact walk,
    #: :mod:`spec_rl.acceptance.exact_walk`), not the test's decisions: a response is the same with or without
    #: drafts, so a rollout may skip scoring where it does not pay and score progressively.
    keyed_walk: ClassVar[bool] = False
    #: The token at a rejection is drawn from the residual max(0, p - q): the rollout needs q, the draft's own policy
    #: at that position (:class:`spec_rl.rollout.old_policy.PolicyVersions`).
    needs_old_policy: ClassVar[bool] = False
    #: Every response is distributed as a sample of the current policy (exact, the residual draw, the coupled keys):
    #: its behaviour log-probs are the current policy's (docs/design.md "Behaviour log-probs").
    samples_policy: ClassVar[bool] = False
    #: The sampled tokens' keys do not change from step to step (common random numbers): a slot's response is the
    #: current policy's keyed sample under the noise its draft was drawn with (:mod:`.coupled`).
    shared_keys: ClassVar[bool] = False

    @property
    def log_lenience(self) -> float:
        """log l of the lenient test this rule is (recorded with every step; 0 where the rule has none)."""
        return 0.0

    def test(self, lp_new: torch.Tensor, lp_old: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Per-token accept [B, R] bool from float64 log-probs and uniforms u in (0, 1]."""
        raise NotImplementedError(f"rule {self.name!r} defines neither test() nor decide()")

    def decide(
        self, lp_new: torch.Tensor, lp_old: torch.Tensor, lengths: torch.Tensor, seed: int, uids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accept [B, R] bool, rejection index n [B] int64) of drafts scored ``lp_new`` [B, R] with stored ``lp_old``;
        u_i = Philox(seed, uid, i) (docs/design.md "Randomness")."""
        index = torch.arange(lp_new.shape[1], device=lp_new.device, dtype=torch.int64).unsqueeze(0)
        u = philox_uniform(seed, uids.unsqueeze(1), index, stream=STREAM_ACCEPT)
        accept = self.test(lp_new.double(), lp_old.double(), u.double()) & lengths_mask(lengths, lp_new.shape[1])
        return accept, rejection_index(accept, lengths)

    def log_keep(self, lp_new: torch.Tensor, lp_old: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """log P(draft token i is kept | tokens < i were kept) [B, R] float64, from float64 log-probs [B, R] and
        lengths [B]; read only by rules that do not sample the policy (:meth:`kept_behaviour`). A rule that does not
        give it reports its kept tokens with their drafted probability alone (0 here)."""
        return torch.zeros_like(lp_new)

    def kept_behaviour(
        self, lp_new: torch.Tensor, lp_old: torch.Tensor, behaviour: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Behaviour log-probs [B, R] float64 of kept draft tokens: the log-probability of the path that produced
        each one, log P(drafted) + log P(kept), with P(drafted) the draft's own ``behaviour`` log-prob [B, R]; the
        current ``lp_new`` where the rule samples the policy (docs/design.md "Behaviour log-probs")."""
        if self.samples_policy:
            return lp_new.double()
        return behaviour.double() + self.log_keep(lp_new.double(), lp_old.double(), lengths)

    def drawn_behaviour(self, lp: torch.Tensor, lp_excluded: torch.Tensor | None) -> torch.Tensor:
        """Behaviour log-probs [N] float64 of tokens drawn at a rejection with current log-prob ``lp`` [N]; a draw
        without the rejected token (log-prob ``lp_excluded`` [N]) renormalises: lp - log(1 - p(excluded))."""
        if self.samples_policy or lp_excluded is None:
            return lp.double()
        rest = torch.log1p(-lp_excluded.double().exp().clamp(max=1.0))
        return torch.where(rest > -torch.inf, lp.double() - rest, lp.double())  # all mass on it: drawn from p

    def verified_by(self) -> Rule:
        """The rule the verify functions run for this one: itself, or for a rule whose draw only a rollout can make
        (the residual), the rule with its test and another draw (:class:`~spec_rl.acceptance.dispatch.VerifyOptions`
        refuses such a rule from a user)."""
        return self

    def kernel_switch(self) -> tuple[float, bool] | None:
        """(log l, read lp_old) of the fused kernels' test ``log u <= log l + lp_new - lp_old`` (lp_old taken as 0 when
        not read); None: the kernels only score and :meth:`decide` runs in torch."""
        return None

    def settable(self) -> tuple[str, ...]:
        """The fields a user may set (the command line's flag of the same name)."""
        return tuple(f.name for f in dataclasses.fields(self))

    def to_dict(self) -> dict:
        return {"acceptance": self.name, **dataclasses.asdict(self)}

    def describe(self) -> str:
        """The rule in a report line, e.g. "exact acceptance"."""
        fields = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in vars(self).items())
        return f"{self.name} acceptance" + (f" ({fields})" if fields else "")

    def note(self) -> str | None:
        """What a report says of this rule beside its numbers (None: nothing)."""
        return None


#: name -> rule class; filled by :func:`register_rule`.
RULES: dict[str, type[Rule]] = {}


def register_rule(cls: type[Rule]) -> type[Rule]:
    """Make ``cls`` known by its ``name`` (run records, resumed runs and stored modes name rules)."""
    RULES[cls.name] = cls
    return cls


def rule_from_dict(data: dict) -> Rule | None:
    """The rule a :meth:`Rule.to_dict` describes (None for ``acceptance`` None); unknown keys are ignored."""
    name = data.get("acceptance")
    if name is None:
        return None
    cls = RULES[name]
    return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if data.get(f.name) is not None})
