"""History drafts: the suffix automaton against brute force, the proposer, and the bounded index."""

import random

import pytest
import torch

from spec_rl.drafts.history import SEPARATOR, HistoryIndex, SuffixAutomaton, SuffixProposer


def _occurs(text: list[int], pattern: list[int]) -> bool:
    n = len(pattern)
    return any(text[i : i + n] == pattern for i in range(len(text) - n + 1))


def _longest_suffix_in(text: list[int], seq: list[int]) -> int:
    for m in range(len(seq), 0, -1):
        if _occurs(text, seq[-m:]):
            return m
    return 0


@pytest.mark.parametrize("seed", range(6))
def test_match_length_and_continuation_agree_with_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 8])
    sam = SuffixAutomaton()
    for _ in range(rng.randint(1, 5)):
        sam.add_response([rng.randrange(vocab) for _ in range(rng.randint(0, 40))])
    seq, state, matched = [], 0, 0
    for _ in range(60):
        tok = rng.randrange(vocab)
        seq.append(tok)
        state, matched = sam.step(state, matched, tok)
        assert matched == _longest_suffix_in(sam.text, seq)
        if matched:
            # The proposed continuation really follows an occurrence of the matched suffix.
            cont = sam.continuation(state, 5)
            end = sam.endpos[state]
            assert sam.text[end - matched + 1 : end + 1] == seq[-matched:]
            assert cont == [t for t in sam.text[end + 1 : end + 6]][: len(cont)]
            assert SEPARATOR not in cont


def test_proposer_follows_history_and_adapts_k():
    sam = SuffixAutomaton()
    sam.add_response([5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    p = SuffixProposer(sam, prefix=[5, 6], max_k=8)
    assert p.propose(100) == [7, 8, 9, 10]  # k starts at max_k // 2
    p.update([7, 8, 9, 10], [7, 8, 9, 10, 11])  # all accepted (+1 bonus): k doubles
    assert p.k == 8
    assert p.propose(100) == [12, 13, 14]  # the history ends there
    assert p.propose(2) == [12, 13]  # the limit caps the proposal
    p.update([12, 13, 14], [12, 99])  # one accepted, then a different token
    assert p.k == 2 and p.accepted == 5 and p.proposed == 7
    assert p.propose(100) == []  # 99 never occurs: no match, no proposal


def test_proposer_at_response_start_uses_the_latest_response():
    sam = SuffixAutomaton()
    sam.add_response([1, 2, 3])
    sam.add_response([4, 5, 6, 7])
    assert SuffixProposer(sam, prefix=[], max_k=8).propose(3) == [4, 5, 6]
    assert SuffixProposer(SuffixAutomaton(), prefix=[], max_k=8).propose(3) == []


def test_index_bounds_eviction_and_roundtrip(tmp_path):
    idx = HistoryIndex(max_responses=2, max_tokens=100, max_prompts=2)
    idx.add(b"a", [1, 2, 3])
    idx.add(b"a", [4, 5, 6])
    assert idx.automaton(b"a").text == [1, 2, 3, SEPARATOR, 4, 5, 6]
    idx.add(b"a", [7, 8])
    idx.add(b"a", [9])  # 4 responses = twice the bound: still kept (trimming waits for 2x)
    assert idx.automaton(b"a").text == [1, 2, 3, SEPARATOR, 4, 5, 6, SEPARATOR, 7, 8, SEPARATOR, 9]
    idx.add(b"a", [10, 11])  # 5 > 2 x 2: trimmed down to the 2 newest, automaton rebuilt
    assert idx.automaton(b"a").text == [9, SEPARATOR, 10, 11]
    small = HistoryIndex(max_responses=10, max_tokens=3)
    for r in ([1, 2, 3], [4, 5, 6], [7]):
        small.add(b"t", r)  # 7 tokens > 2 x 3: down to the newest that fit in 3 tokens
    assert small.automaton(b"t").text == [7]
    idx.add(b"b", [1])
    idx.add(b"c", [2])  # 3 prompts > 2: the least recently used ("a") goes
    assert idx.automaton(b"a") is None and len(idx) == 2
    path = idx.save(tmp_path / "h.safetensors")
    again = HistoryIndex.load(path, max_responses=2, max_tokens=100, max_prompts=2)
    assert again.automaton(b"b").text == [1] and again.automaton(b"c").text == [2]
    assert again.num_tokens() == idx.num_tokens() == 2


def test_load_rejects_damaged_files(tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "bad.safetensors"
    save_file(
        {"counts": torch.tensor([2]), "lengths": torch.tensor([1]), "tokens": torch.tensor([3])},
        str(bad),
        metadata={"format": "spec-rl-history", "format_version": "1", "keys": '["61"]'},
    )
    with pytest.raises(ValueError, match="damaged"):
        HistoryIndex.load(bad)
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a readable"):
        HistoryIndex.load(tmp_path / "junk.safetensors")
    with pytest.raises(FileNotFoundError):
        HistoryIndex.load(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="max_tokens"):
        HistoryIndex(max_tokens=0)


def test_a_response_already_indexed_is_not_added_again():
    idx = HistoryIndex()
    idx.add(b"p", [1, 2, 3])
    idx.add(b"p", [1, 2, 3])  # a draft reused whole comes back unchanged
    idx.add(b"p", [1, 2])
    assert idx.automaton(b"p").text == [1, 2, 3, SEPARATOR, 1, 2] and idx.num_tokens() == 5


def test_proposals_never_hold_an_id_the_model_cannot_read():
    sam = SuffixAutomaton()
    sam.add_response([5, 6, 7, 900, 8])  # 900: from a history recorded with another tokenizer, say
    p = SuffixProposer(sam, prefix=[5, 6], max_k=8, vocab_size=100)
    assert p.propose(100) == [7]
    assert SuffixProposer(sam, prefix=[5, 6], max_k=8).propose(100) == [7, 900, 8]


@pytest.mark.parametrize(
    "bounds, error, words",
    [
        (dict(max_responses="a"), TypeError, "max_responses must be an integer, got str 'a'"),
        (dict(max_tokens=16.0), TypeError, "max_tokens must be an integer, got float 16.0"),
        (dict(max_prompts=0), ValueError, "max_prompts must be >= 1, got 0"),
    ],
)
def test_history_bounds_are_checked_by_name(bounds, error, words):
    with pytest.raises(error) as info:
        HistoryIndex(**bounds)
    assert words in str(info.value)


def test_built_automata_stay_within_their_token_bound_and_rebuild_the_same():
    idx = HistoryIndex(max_automaton_tokens=10)
    responses = {bytes([k]): [[10 * k + i for i in range(4)], [10 * k + i for i in range(3, 7)]] for k in range(1, 4)}
    for key, rs in responses.items():
        for r in rs:
            idx.add(key, r)
    texts = {key: list(idx.automaton(key).text) for key in responses}  # 9 tokens each: one fits the bound at a time
    assert idx.automaton_tokens() == 9 and len(idx._automata) == 1
    held = idx.automaton(b"\x01")
    proposer = idx.proposer(b"\x02", prefix=[20, 21])  # evicts b"\x01"'s automaton; the proposer keeps its own
    assert list(idx._automata) == [b"\x02"] and held.text == texts[b"\x01"]
    assert proposer.propose(2) == [22, 23]
    idx.add(b"\x02", [25, 26, 27])  # grows the built automaton, counted
    assert idx.automaton_tokens() == 13 and idx.automaton(b"\x01").text == texts[b"\x01"]
    assert idx.automaton_tokens() == 9  # b"\x02"'s dropped to make room
    assert idx.num_tokens() == 27  # responses are all kept: only automata are dropped
    with pytest.raises(ValueError, match="max_automaton_tokens"):
        HistoryIndex(max_automaton_tokens=0)


def test_responses_are_stored_compactly():
    import tracemalloc

    idx = HistoryIndex()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for k in range(20):
        for r in range(4):
            idx.add(bytes([k]), [(k * 1000 + r * 100 + i) % 49152 + 300 for i in range(500)])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert idx.num_tokens() == 40_000 and used / 40_000 < 8  # int32 arrays: 4 bytes a token plus small headers
