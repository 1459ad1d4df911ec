"""The guidance chapter's wording helpers, on hand-made rows (the chapter itself is tested in test_book)."""

from spectie import guidance


def _rows(**counts):
    return [{"configuration": name.replace("_", "-"), "[DATA] rows written": n} for name, n in counts.items()]


def test_rows_text_says_which_runs_wrote_fewer_and_which_more():
    assert guidance.rows_text(_rows(plain=3, mtp_k1=8, ngram=7), "plain") == \
        "plain greedy wrote 3 rows; mtp-k1, ngram more (7–8)"
    assert guidance.rows_text(_rows(plain=5, mtp_k1=2, mtp_k8=2, ngram=9), "plain") == \
        "plain greedy wrote 5 rows; mtp-k1, mtp-k8 fewer (2); ngram more (9)"
    assert guidance.rows_text(_rows(plain=4, mtp_k1=4), "plain") == \
        "plain greedy wrote 4 rows; every speculative run as many"
    assert guidance.rows_text(_rows(mtp_k1=4), "plain") == "no plain greedy run is recorded to compare with"
    assert guidance.rows_text(_rows(mtp_k1=4), None) == "no plain greedy run is recorded to compare with"


def test_outcomes_are_grouped_by_how_they_ended():
    stop = {"finish_reason": "stop", "output_tokens": 41}
    limit = {"finish_reason": "length", "output_tokens": 96}
    assert guidance.grouped_outcomes({"K = 1": limit, "K = 3": stop, "K = 8": limit}) == \
        "K = 1, K = 8: the 96-token limit (length); K = 3: stop after 41 tokens"
