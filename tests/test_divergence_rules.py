"""The divergence classifier's judgement on figures written out here, without the model: the verdict and its
explanation from a margin, the band and the later gaps (`judge`), the gaps themselves, which sequence stopped where
the other went on, and the token-id check. The expected strings and verdicts are written out by hand."""

import pytest

from spectie.tools.divergence import Verdict, check_tokens, gaps, judge, stop_where_other_goes_on, trailing
from spectie.records.errors import UsageError

EOS = 248044


def test_a_margin_wider_than_the_band_is_a_bug_whichever_token_leads():
    verdict, explanation = judge(2, "x", "y", -0.5, 0.1, [], [], None, None)
    assert verdict is Verdict.BUG
    assert explanation == ("at output token 3, 'x' and 'y' are 0.500 logits apart in fp32 (outside the 0.100 noise "
                           "band): a correct computation would not pick 'x' there; look for a bug")
    verdict, explanation = judge(0, "x", "y", 0.25, 0.1, [], [], None, None)
    assert verdict is Verdict.BUG and explanation.endswith("would not pick 'y' there; look for a bug")


def test_a_margin_of_exactly_the_band_with_no_later_stray_is_a_near_tie():
    verdict, explanation = judge(4, "1", "2", -0.125, 0.125, [], [], None, None)
    assert verdict is Verdict.NEAR_TIE
    assert explanation == ("at output token 5, '1' and '2' are 0.125 logits apart in fp32 (within the 0.125 noise "
                           "band), and every token of both sequences is within the band of fp32's own choice: either "
                           "is what some correct computation order picks")
    assert judge(4, "1", "2", 0.1251, 0.125, [], [], None, None)[0] is Verdict.BUG


def test_a_near_tie_followed_by_a_stray_token_is_a_bug_naming_the_first_stray():
    strays_a = [{"position": 6, "token": "q", "gap": 0.3}, {"position": 9, "token": "r", "gap": 0.5}]
    verdict, explanation = judge(1, "x", "y", 0.01, 0.1, strays_a, [], None, None)
    assert verdict is Verdict.BUG
    assert explanation == ("at output token 2, 'x' and 'y' are 0.010 logits apart in fp32 (a near-tie), but sequence "
                           "a later picks, from its own context, tokens that the fp32 reference ranks more than the "
                           "0.100 noise band below its top-1 (first at output token 7, 0.300 logits): look for a bug")
    verdict, explanation = judge(1, "x", "y", 0.01, 0.1, [], [{"position": 3, "token": "s", "gap": 0.25}], None, None)
    assert verdict is Verdict.BUG
    assert "sequence b later picks" in explanation and "(first at output token 4, 0.250 logits)" in explanation


def test_a_stop_at_the_divergence_is_said_as_stop_against_continue():
    verdict, explanation = judge(2, "<|endoftext|>", "DATA", 0.05, 0.1, [], [], "a", 2)
    assert verdict is Verdict.NEAR_TIE
    assert explanation.startswith("sequence a stops at output token 3 where the other goes on (end-of-text against "
                                  "'DATA', stop against continue); at output token 3, '<|endoftext|>' and 'DATA' are "
                                  "0.050 logits apart in fp32 (within the 0.100 noise band)")
    assert "later stops" not in explanation
    _, explanation = judge(2, "DATA", "<|endoftext|>", 0.05, 0.1, [], [], "b", 2)
    assert explanation.startswith("sequence b stops at output token 3 where the other goes on (end-of-text against "
                                  "'DATA', stop against continue)")


def test_a_later_stop_is_said_to_follow_from_the_first_divergence():
    _, explanation = judge(2, "x", "y", 0.05, 0.1, [], [], "b", 7)
    assert explanation.startswith("at output token 3, 'x' and 'y' are 0.050 logits apart in fp32 (within the 0.100 ")
    assert explanation.endswith("; sequence b later stops (end-of-text at output token 8) where the other goes on: "
                                "that stop follows from this first divergence, not from a tie of its own")
    _, explanation = judge(2, "x", "y", 0.05, 0.1, [], [], None, None)
    assert "stops" not in explanation


def test_the_gaps_are_how_far_each_chosen_token_trails_its_rows_top1():
    import torch

    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, 0.0, 0.25]])
    assert gaps(logits, [2, 0]) == [1.0, 0.0]


def test_trailing_lists_the_first_ten_tokens_beyond_the_band_rounded():
    decode = lambda token: f"t{token}"  # noqa: E731
    found = trailing([0.0, 0.2, 0.1, 0.300049], [5, 6, 7, 8], 0.1, decode)
    assert found == [{"position": 1, "token": "t6", "gap": 0.2}, {"position": 3, "token": "t8", "gap": 0.3}]
    many = trailing([1.0] * 12, list(range(12)), 0.1, decode)
    assert [row["position"] for row in many] == list(range(10))


def test_the_sequence_that_writes_end_of_text_where_the_other_goes_on_is_named():
    assert stop_where_other_goes_on([1, 2, EOS], [1, 2, 3, 4], [EOS]) == ("a", 2)
    assert stop_where_other_goes_on([1, 2, 3], [1, EOS], [EOS]) == ("b", 1)
    assert stop_where_other_goes_on([EOS], [5], [EOS]) == ("a", 0)
    assert stop_where_other_goes_on([1, EOS], [1, EOS], [EOS]) == (None, None)  # both stop there
    assert stop_where_other_goes_on([1, 2, EOS], [1, 2], [EOS]) == (None, None)  # the other has nothing there
    assert stop_where_other_goes_on([1, 2, 3], [1, 2, 4], [EOS]) == (None, None)  # neither stops


def test_only_the_first_end_of_text_of_a_sequence_is_weighed():
    # a's first end-of-text (9) meets b's own end-of-text there: no stop against continue, whatever follows.
    assert stop_where_other_goes_on([1, 9, EOS], [1, 9, 5], [EOS, 9]) == (None, None)


def test_token_ids_must_be_integers_within_the_vocabulary():
    assert check_tokens("tokens_a", [0, 9], 10) == [0, 9]
    for bad in ([1, True], (1, 2), [1, 2.0], "12"):
        with pytest.raises(UsageError) as refused:
            check_tokens("tokens_a", bad, 10)
        assert str(refused.value) == "tokens_a must be a list of token ids (integers)"
    with pytest.raises(UsageError) as refused:
        check_tokens("tokens_b", [3, 10, -1, 11, 12, 13, 14, 15], 10)
    assert str(refused.value) == ("tokens_b: token id(s) [10, -1, 11, 12, 13] are outside the model's vocabulary "
                                  "(0..9); were they produced by another tokenizer?")
