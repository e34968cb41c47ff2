"""The scoring pass: one forward of the current policy over [prompt, draft] (SPEC-RL Sec. 3; docs/design.md "The rule").
Where the logits are a plain linear map of the hidden states it returns those, and ``verify`` applies the LM head."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..acceptance.scores import DraftScores, response_positions
from ..sampling.distribution import SamplingSettings, token_logprobs
from ..sampling.groups import TreeKV, chunk_rows, gather_scores, pack_groups, supports_tree_attention, tree_inputs
from ..util.validation import check_int
from .hf_decode import padded_ids, returned_cache


class ScoringHead:
    """How final hidden states become logits; ``uses_hidden_states`` iff they equal ``lm_head(last_hidden_state)``."""

    def __init__(self, model):
        self.model = model
        base = getattr(model, "base_model_prefix", None)
        decoder = getattr(model, base, None) if base else None
        self.decoder = decoder if isinstance(decoder, torch.nn.Module) and decoder is not model else None
        self.lm_head = model.get_output_embeddings()
        self._uses_hidden: bool | None = None

    @property
    def uses_hidden_states(self) -> bool:
        if self._uses_hidden is None:
            self._uses_hidden = self._check()
        return self._uses_hidden

    @property
    def width(self) -> int:
        """Last dimension of :meth:`states`: d for hidden states, V for logits."""
        return self.lm_head.weight.shape[1] if self.uses_hidden_states else self.lm_head.weight.shape[0]

    @torch.no_grad()
    def _check(self) -> bool:
        head = self.lm_head
        if self.decoder is None or not isinstance(head, torch.nn.Linear):
            return False
        ids = torch.arange(4, device=head.weight.device).unsqueeze(0) % head.weight.shape[0]
        full = self.model(input_ids=ids).logits.float()
        mine = head(self.decoder(input_ids=ids).last_hidden_state).float()
        return bool(torch.allclose(full, mine, rtol=1e-3, atol=1e-3))

    def states(self, hidden: bool | None = None, **forward_kwargs) -> torch.Tensor:
        if self.uses_hidden_states if hidden is None else hidden:
            return self.decoder(**forward_kwargs).last_hidden_state
        return self.model(**forward_kwargs).logits

    def draft_scores(self, values: torch.Tensor, same_as: torch.Tensor | None = None) -> DraftScores:
        if self.uses_hidden_states:
            weight, bias = self.lm_head.weight, getattr(self.lm_head, "bias", None)
            return DraftScores(hidden_states=values, lm_head_weight=weight, lm_head_bias=bias, same_as=same_as)
        return DraftScores(logits=values, same_as=same_as)


def response_states(
    model,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    head: ScoringHead | None = None,
) -> torch.Tensor:
    """Outputs [B, R, d|V] scoring each response token (R = max length, >= 1); token i at ``len(prompt) - 1 + i``."""
    device = next(model.parameters()).device
    max_r = max([len(r) for r in responses] + [1])
    ids, attn = padded_ids([list(p) + list(r) for p, r in zip(prompts, responses)], pad_id, device)
    states = (
        head.states(input_ids=ids, attention_mask=attn)
        if head is not None
        else model(input_ids=ids, attention_mask=attn).logits
    )
    plen = torch.tensor([len(p) for p in prompts], device=device)
    pos = response_positions(plen, max_r, ids.shape[1])
    return states.gather(1, pos.unsqueeze(-1).expand(-1, -1, states.shape[-1]))


def response_logprobs(
    model,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    settings: SamplingSettings = SamplingSettings(),
) -> torch.Tensor:
    """Sampling log-probs [B, R] float32 of each response token under ``model`` (padding: meaningless)."""
    logits = response_states(model, prompts, responses, pad_id)
    max_r = logits.shape[1]
    targets = torch.zeros((len(responses), max_r), dtype=torch.long, device=logits.device)
    for b, r in enumerate(responses):
        targets[b, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    return token_logprobs(logits, targets, settings.temperature, settings.top_k, settings.top_p)


class PolicyScorer:
    """The scoring forward: a group's prompt and draft trie in one row where the attention takes 4-D masks
    (docs/design.md "Scoring the group once"), else a padded row per draft; ``max_tokens_per_forward`` bounds rows x
    length (2048 CPU, 65536 GPU); ``max_kv_tokens`` bounds the tokens whose K/V progressive scoring holds for one
    chunk of groups (None: a forward batch's groups, whatever their tries)."""

    def __init__(
        self,
        model,
        pad_id: int,
        max_tokens_per_forward: int | None = None,
        tree: bool | None = None,
        max_kv_tokens: int | None = None,
    ):
        self.model = model
        self.pad_id = int(pad_id)
        self.head = ScoringHead(model)
        if max_tokens_per_forward is None:
            max_tokens_per_forward = 65536 if self.device.type == "cuda" else 2048
        self.max_tokens_per_forward = check_int("max_tokens_per_forward", max_tokens_per_forward, low=1)
        self.tree = supports_tree_attention(model) if tree is None else bool(tree)
        self.max_kv_tokens = None if max_kv_tokens is None else check_int("max_kv_tokens", max_kv_tokens, low=1)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def kv_positions(self, prompts, drafts) -> int:
        """Token positions of the K/V that :meth:`score_with_kv` keeps (tree layout: rows x longest per chunk)."""
        return _padded_positions(self._chunks(prompts, drafts))

    def _chunks(self, prompts, drafts) -> list:
        groups = pack_groups(prompts, drafts)
        return [
            [groups[i] for i in c] for c in chunk_rows([len(g.tokens) for g in groups], self.max_tokens_per_forward)
        ]

    def score(self, prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]) -> DraftScores:
        """:class:`DraftScores` [B, R] (R = max draft length, >= 1); ValueError when the counts differ."""
        return self.score_with_kv(prompts, drafts, keep_kv=False)[0]

    @torch.inference_mode()
    def score_with_kv(self, prompts, drafts, keep_kv=True) -> tuple[DraftScores, TreeKV | None]:
        """:meth:`score` and the kept K/V (tree layout; ``keep_kv``: a bool, or a predicate of :meth:`kv_positions`);
        results are inference tensors (``.clone()`` for autograd)."""
        assert len(prompts) == len(drafts)
        max_r = max([len(d) for d in drafts] + [1])
        dtype = self.head.lm_head.weight.dtype
        out = torch.zeros((len(prompts), max_r, self.head.width), dtype=dtype, device=self.device)
        if self.tree:
            same_as = torch.arange(out.shape[0] * max_r, device=self.device).view(out.shape[0], max_r)
            kv = self._score_tree(prompts, drafts, out, same_as, keep_kv)
            return self.head.draft_scores(out, same_as), kv
        for chunk in chunk_rows([len(p) + len(d) for p, d in zip(prompts, drafts)], self.max_tokens_per_forward):
            values = response_states(
                self.model, [prompts[i] for i in chunk], [drafts[i] for i in chunk], self.pad_id, self.head
            )
            out[torch.tensor(chunk, device=values.device), : values.shape[1]] = values.to(out.dtype)
        return self.head.draft_scores(out), None

    def _score_tree(self, prompts, drafts, out: torch.Tensor, same_as: torch.Tensor, keep_kv) -> TreeKV | None:
        impl = getattr(self.model.config, "_attn_implementation", "sdpa")
        additive = self.head.lm_head.weight.dtype if impl == "eager" else None
        chunks = self._chunks(prompts, drafts)  # packed once: the keeping decision reads the same chunks
        if callable(keep_kv):
            keep_kv = bool(keep_kv(_padded_positions(chunks)))
        kv = TreeKV() if keep_kv else None
        for groups in chunks:
            ids, pos, mask = tree_inputs(groups, self.pad_id, self.device, additive)
            if keep_kv:
                hidden = self.head.uses_hidden_states
                target = self.head.decoder if hidden else self.model
                res = target(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True)
                states = res.last_hidden_state if hidden else res.logits
                cache = returned_cache(self.model, res)
                kv.add(groups, [(layer.keys, layer.values) for layer in cache.layers])
            else:
                states = self.head.states(input_ids=ids, position_ids=pos, attention_mask=mask)
            gather_scores(states, groups, out, same_as)
        return kv


def _padded_positions(chunks) -> int:
    """K/V token positions of packed chunks, each padded to its longest row."""
    return sum(len(c) * max(len(g.tokens) for g in c) for c in chunks)
