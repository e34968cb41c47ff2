"""The scoring pass: one forward of the current policy over [prompt, draft].

Token y_i of the draft is scored by the policy's output at the position
*before* it (the first response token by the last prompt position; paper
Sec. 3, docs/design.md "The rule", step 1). The scorer returns, for every draft token, the final hidden
state at that position, so ``verify`` can apply the LM head itself (the fused
kernel path never materialises [N, V] logits). Models whose logits are not a
plain linear map of the last hidden state (logit soft-capping or scaling) are
detected once and scored from full logits instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..acceptance.scores import DraftScores, response_positions
from ..sampling.distribution import SamplingSettings, token_logprobs
from ..sampling.groups import TreeKV, chunk_groups, gather_scores, pack_groups, supports_tree_attention, tree_inputs


def right_padded(seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids [B, L] int64 and attention_mask [B, L] int64 (positions 0..len-1 per row)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        attn[row, : len(s)] = 1
    return ids, attn


class ScoringHead:
    """How a causal LM's final hidden states become logits, checked once per model.

    ``uses_hidden_states`` is True when ``logits == lm_head(decoder(...).last_hidden_state)``
    (checked on a 4-token input), so scoring can return hidden states and let
    ``verify`` apply the LM head (the fused path). Models with logit
    soft-capping or scaling fail the check and are scored from full logits.

    Attributes:
        model: the transformers causal LM.
        decoder: its base model (``model.<base_model_prefix>``) or None.
        lm_head: ``model.get_output_embeddings()``.
    """

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
        """One forward: final hidden states (``hidden``, default :attr:`uses_hidden_states`) or logits [.., L, d|V]."""
        if self.uses_hidden_states if hidden is None else hidden:
            return self.decoder(**forward_kwargs).last_hidden_state
        return self.model(**forward_kwargs).logits

    def draft_scores(self, values: torch.Tensor, same_as: torch.Tensor | None = None) -> DraftScores:
        """Wrap per-draft-token outputs [B, R, d|V] of :meth:`states` (and ``same_as``) as :class:`DraftScores`."""
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
    """THE scoring forward: outputs [B, R, d|V] that score each response token (R = max length, >= 1).

    Sequences [prompt, response] are right-padded; response token i of row b is
    scored by the output at position ``len(prompt_b) - 1 + i``. With ``head``
    the outputs are whatever ``head.states`` returns (hidden states on the fused
    path), else the model's logits. Gradients flow unless the caller disables them.
    """
    device = next(model.parameters()).device
    max_r = max([len(r) for r in responses] + [1])
    ids, attn = right_padded([list(p) + list(r) for p, r in zip(prompts, responses)], pad_id, device)
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
    """Sampling log-probs [B, R] float32 of each response token under ``model`` (padding: meaningless, mask it)."""
    logits = response_states(model, prompts, responses, pad_id)
    max_r = logits.shape[1]
    targets = torch.zeros((len(responses), max_r), dtype=torch.long, device=logits.device)
    for b, r in enumerate(responses):
        targets[b, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    return token_logprobs(logits, targets, settings.temperature, settings.top_k, settings.top_p)


class PolicyScorer:
    """Runs the scoring forward of a transformers causal LM.

    Two layouts: **tree** (default where the model's attention takes custom 4-D masks): the rows
    of each group (identical prompts) are packed into one sequence, the prompt once and then the
    trie of the group's drafts (:mod:`spec_rl.sampling.groups`), so shared prefixes are computed
    once; **rows**: one right-padded row per [prompt, draft]. Both give the same scores up to
    floating-point summation order.

    Args:
        model: transformers ``PreTrainedModel`` with ``get_output_embeddings()``.
        pad_id: id used for padding (masked out).
        max_tokens_per_forward: bound on padded rows x length per forward call; larger batches are
            split after sorting by length. Default: 2048 on CPU (small chunks waste little padding
            and stay in cache; measured on the demo's scoring pass, 2 cores: tree layout 157 ms at
            2048 vs 182 ms at 4096 and 268 ms at 16384), 65536 on GPU.
        tree: use the tree layout (None: whenever the model supports it).
    """

    def __init__(self, model, pad_id: int, max_tokens_per_forward: int | None = None, tree: bool | None = None):
        self.model = model
        self.pad_id = int(pad_id)
        self.head = ScoringHead(model)
        if max_tokens_per_forward is None:
            max_tokens_per_forward = 65536 if self.device.type == "cuda" else 2048
        self.max_tokens_per_forward = int(max_tokens_per_forward)
        self.tree = supports_tree_attention(model) if tree is None else bool(tree)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _chunks(self, lengths: Sequence[int]) -> list[list[int]]:
        """Rows sorted by length, greedily packed so each chunk's padded size fits max_tokens_per_forward."""
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        chunks: list[list[int]] = []
        for i in order:
            if chunks and lengths[i] * (len(chunks[-1]) + 1) <= self.max_tokens_per_forward:
                chunks[-1].append(i)
            else:
                chunks.append([i])
        return chunks

    def score(self, prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]) -> DraftScores:
        """Score every draft token under the current policy.

        Args:
            prompts: B prompt id lists (each non-empty).
            drafts: B draft id lists (may be empty).

        Returns:
            :class:`DraftScores` with R = max draft length (at least 1).

        Raises:
            ValueError: ``prompts`` and ``drafts`` differ in length.
        """
        return self.score_with_kv(prompts, drafts, keep_kv=False)[0]

    @torch.inference_mode()
    def score_with_kv(self, prompts, drafts, keep_kv: bool = True) -> tuple[DraftScores, TreeKV | None]:
        """:meth:`score`, also returning the forward's keys and values (tree layout only) for a continuation.

        Runs under ``torch.inference_mode()`` (about 7% faster than ``no_grad`` on the demo's scoring pass,
        2 CPU cores): the returned tensors are inference tensors, to be read (verification, sampling,
        index_select into a decode cache); ``.clone()`` one before using it in an autograd graph.
        """
        if len(prompts) != len(drafts):
            raise ValueError(f"prompts ({len(prompts)}) and drafts ({len(drafts)}) must have the same length")
        max_r = max([len(d) for d in drafts] + [1])
        out = torch.zeros((len(prompts), max_r, self.head.width), dtype=self._dtype(), device=self.device)
        if self.tree:
            same_as = torch.arange(out.shape[0] * max_r, device=self.device).view(out.shape[0], max_r)
            kv = self._score_tree(prompts, drafts, out, same_as, keep_kv)
            return self.head.draft_scores(out, same_as), kv
        for chunk in self._chunks([len(p) + len(d) for p, d in zip(prompts, drafts)]):
            values = response_states(
                self.model, [prompts[i] for i in chunk], [drafts[i] for i in chunk], self.pad_id, self.head
            )
            out[torch.tensor(chunk, device=values.device), : values.shape[1]] = values.to(out.dtype)
        return self.head.draft_scores(out), None

    def _dtype(self) -> torch.dtype:
        return self.head.lm_head.weight.dtype

    def _score_tree(self, prompts, drafts, out: torch.Tensor, same_as: torch.Tensor, keep_kv: bool) -> TreeKV | None:
        from .hf_decode import cache_argument

        impl = getattr(self.model.config, "_attn_implementation", "sdpa")
        additive = self.head.lm_head.weight.dtype if impl == "eager" else None
        kv = TreeKV() if keep_kv else None
        for groups in chunk_groups(pack_groups(prompts, drafts), self.max_tokens_per_forward):
            ids, pos, mask = tree_inputs(groups, self.pad_id, self.device, additive)
            if keep_kv:
                hidden = self.head.uses_hidden_states
                target = self.head.decoder if hidden else self.model
                res = target(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True)
                states = res.last_hidden_state if hidden else res.logits
                cache = getattr(res, cache_argument(self.model), None) or getattr(res, "past_key_values", None)
                kv.add(groups, [(layer.keys, layer.values) for layer in cache.layers])
            else:
                states = self.head.states(input_ids=ids, position_ids=pos, attention_mask=mask)
            gather_scores(states, groups, out, same_as)
        return kv
