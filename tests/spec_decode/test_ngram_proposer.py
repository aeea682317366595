"""NgramProposer: the longest suffix n-gram in [prompt_lookup_min, prompt_lookup_max] that occurs
earlier, its earliest occurrence, up to k tokens after it; checked against a brute-force search
over every position and on hand-made cases."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from attnserve.spec_decode.ngram_proposer import NgramProposer


def reference(
    tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int, max_tokens: int | None
) -> list[int]:
    """Every n from the largest down, every start left to right: the first hit wins."""
    if max_tokens is not None:
        k = min(k, max_tokens)
    if k <= 0:
        return []
    tokens = list(tokens)
    total = len(tokens)
    for n in range(lookup_max, lookup_min - 1, -1):
        suffix = tokens[total - n :] if n <= total else None
        if suffix is None:
            continue
        # An occurrence starting at `start` ends at start + n - 1, which must be <= total - 2.
        for start in range(total - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_random_sequences_match_the_brute_force_search() -> None:
    rng = random.Random(1234)
    dtypes = [np.int64, np.int32, np.uint16]
    hits = 0
    for trial in range(4000):
        vocab = rng.randint(1, 5)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        lookup_min = rng.randint(1, 4)
        lookup_max = rng.randint(lookup_min, 6)
        k = rng.randint(1, 6)
        max_tokens = rng.choice([None, None, 0, 1, 2, 3, 10])
        proposer = NgramProposer(k, lookup_min, lookup_max)
        expected = reference(tokens, k, lookup_min, lookup_max, max_tokens)
        hits += bool(expected)
        history: list[int] | np.ndarray = (
            tokens if trial % 2 else np.array(tokens, dtype=dtypes[trial % 3])
        )
        got = proposer.propose(history, max_tokens)
        assert got == expected, (tokens, k, lookup_min, lookup_max, max_tokens)
        assert all(type(token) is int for token in got)
    assert hits > 1000  # the tiny vocabularies make matches common


def test_long_sequences_match_the_brute_force_search() -> None:
    rng = np.random.default_rng(7)
    for vocab in (2, 8, 50):
        tokens = rng.integers(0, vocab, size=1500).tolist()
        for lookup_min, lookup_max in ((1, 1), (1, 4), (2, 5), (3, 8)):
            proposer = NgramProposer(4, lookup_min, lookup_max)
            expected = reference(tokens, 4, lookup_min, lookup_max, None)
            assert proposer.propose(np.array(tokens)) == expected


def test_no_match() -> None:
    assert NgramProposer(3, 1, 3).propose([1, 2, 3, 4]) == []
    assert NgramProposer(3, 2, 3).propose([1, 2, 3, 1, 4, 2]) == []  # only 1-grams recur


def test_match_at_the_very_start() -> None:
    assert NgramProposer(3, 2, 2).propose([5, 6, 7, 8, 5, 6]) == [7, 8, 5]


def test_the_earliest_occurrence_wins() -> None:
    tokens = [1, 2, 9, 1, 2, 8, 1, 2]
    assert NgramProposer(1, 2, 2).propose(tokens) == [9]
    assert NgramProposer(3, 1, 2).propose(tokens) == [9, 1, 2]


def test_the_longest_ngram_wins_over_an_earlier_shorter_one() -> None:
    tokens = [4, 5, 0, 3, 4, 5, 1, 3, 4, 5]
    assert NgramProposer(2, 2, 3).propose(tokens) == [1, 3]  # [3, 4, 5] at 3, not [4, 5] at 0
    assert NgramProposer(2, 2, 2).propose(tokens) == [0, 3]  # 2-grams only: the earliest


def test_a_longer_match_past_the_maximum_does_not_count() -> None:
    # The suffix [2, 3] first occurs at 0; the occurrence at 5 matches the suffix [1, 2, 3] as
    # well, but with prompt_lookup_max 2 both are 2-gram matches and the earliest wins.
    tokens = [2, 3, 7, 0, 1, 2, 3, 8, 1, 2, 3]
    assert NgramProposer(1, 1, 2).propose(tokens) == [7]
    assert NgramProposer(1, 1, 3).propose(tokens) == [8]


def test_max_tokens_truncates_k() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    proposer = NgramProposer(5, 1, 2)
    assert proposer.propose(tokens) == [3, 4, 5, 6, 1]
    assert proposer.propose(tokens, max_tokens=2) == [3, 4]
    assert proposer.propose(tokens, max_tokens=9) == [3, 4, 5, 6, 1]
    assert proposer.propose(tokens, max_tokens=0) == []
    assert proposer.propose(tokens, max_tokens=-3) == []


def test_min_equal_to_max() -> None:
    tokens = [9, 1, 2, 3, 0, 2, 3, 5, 1, 2, 3]
    assert NgramProposer(2, 3, 3).propose(tokens) == [0, 2]
    assert NgramProposer(2, 2, 2).propose(tokens) == [0, 2]  # [2, 3] first at 2 as well
    assert NgramProposer(2, 4, 4).propose(tokens) == []


def test_continuation_runs_into_the_end() -> None:
    # vLLM's docstring example: [4, 2, 3] is all that follows [2, 3] at position 1.
    assert NgramProposer(4, 2, 3).propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]
    # The occurrence may overlap the suffix; what follows it runs into the suffix.
    assert NgramProposer(3, 2, 2).propose([7, 7, 7]) == [7]
    assert NgramProposer(5, 1, 3).propose([7, 7, 7, 7, 7]) == [7, 7]


def test_too_short_histories() -> None:
    proposer = NgramProposer(3, 1, 3)
    assert proposer.propose([]) == []
    assert proposer.propose(np.array([], dtype=np.int64)) == []
    assert proposer.propose([4]) == []
    assert proposer.propose([4, 4]) == [4]
    assert NgramProposer(3, 3, 3).propose([4, 4, 4]) == []  # a 3-gram needs 4 tokens


def test_bad_histories_are_value_errors() -> None:
    proposer = NgramProposer(3, 1, 3)
    with pytest.raises(ValueError, match="1-D"):
        proposer.propose(np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="integers"):
        proposer.propose(np.array([1.0, 2.0, 1.0]))


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((0, 1, 3), "num_speculative_tokens"),
        ((3, 0, 3), "prompt_lookup_min"),
        ((3, 4, 3), "prompt_lookup_max"),
    ],
)
def test_bad_settings_are_value_errors(args: tuple[int, int, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        NgramProposer(*args)
