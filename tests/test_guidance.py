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


def test_the_computed_sentences_say_what_the_records_say():
    limit = {"finish_reason": "length", "output_tokens": 96}
    stop = {"finish_reason": "stop", "output_tokens": 12}
    assert guidance.ends_text(limit, {"mtp-k1": limit}) == (
        "Every changed completion ended where plain greedy's did (the 96-token limit (length)): speculation changed "
        "tokens, not where the completion stops")
    assert guidance.ends_text(limit, {"mtp-k1": limit, "mtp-k8": stop}).startswith(
        "Where the completion ends moved for mtp-k8:")
    assert guidance.ends_text(limit, {}).startswith("No speculative completion differs")
    assert guidance.stops_text([], 0, 0.1).startswith("No recorded run stopped")
    assert guidance.stops_text([0.0, 0.5], 1, 0.1) == \
        "The recorded stops won by 0.00 to 0.50 logits: 1 of 2 are inside the 0.100-logit band"
    assert guidance.upstream_text({"mtp-k1": limit}, limit, "58").endswith("the classifier is the tool that finds the tie")
    assert "not at the stop" in guidance.upstream_text({"mtp-k1": stop}, limit, "9")
    assert guidance.upstream_text({}, limit, "—").startswith("Speculation left every completion")
    counts = {"ordinary_stops": 0, "ordinary_flagged": 0, "moved_tie_at_divergence": 3}
    assert guidance.survey_verdict(counts).startswith("No completion of the survey ended with an ordinary stop")
    assert guidance.survey_verdict(dict(counts, ordinary_stops=12)).startswith(
        "On this model the detector flagged none of the 12 ordinary stops; it is blind")
    assert guidance.survey_verdict(dict(counts, ordinary_stops=12, ordinary_flagged=2,
                                        moved_tie_at_divergence=0)) == \
        "On this model the detector flagged 2 of the 12 ordinary stops"
    assert guidance.survey_verdict(dict(counts, ordinary_stops=1, moved_tie_at_divergence=0)) == \
        "On this model the detector flagged none of the 1 ordinary stop (fewer than 10: too few to estimate a rate)"
    assert guidance.rate_text(3, 40) == "3 of 40 (8%)" and guidance.rate_text(0, 1) == "0 of 1 (too few for a rate)"
    assert guidance.class_counts([{"class": "designed tie"}, {"class": "digit tie"}, {"class": "designed tie"}]) == \
        "designed tie: 2, digit tie: 1"
    assert guidance.survey_verdict({}) == "No survey is recorded for this model"


def test_the_classifier_scores_and_real_verdicts_are_told_from_their_rows():
    from spectie import guidance

    rows = [{"case": "tie 0", "truth": "near-tie", "class": "designed tie", "verdict": "near-tie", "right": True,
             "fp32 margin": 0.01},
            {"case": "tie 1", "truth": "near-tie", "class": "designed tie", "verdict": "bug", "right": False,
             "fp32 margin": 0.5},
            {"case": "gate", "truth": "bug", "class": "gate-shift", "verdict": "bug", "right": True, "fp32 margin": -6.0},
            {"case": "lost", "truth": "bug", "class": "lost-state", "verdict": "near-tie", "right": False,
             "fp32 margin": -0.07}]
    text = guidance.classifier_score_text(rows)
    assert text.startswith("it called 1 of 2 near-ties near-ties and caught 1 of 2 planted bugs; it missed "
                           "lost-state (1): in each, the planted bug first changed a token where fp32's top two were "
                           "at most 0.070 logits apart")
    assert text.endswith("; it called 1 near-tie(s) suspected bugs (tie 1)")
    real = [{"class": "ngram_gpu", "verdict": "bug", "fp32 margin": -25.8}, {"class": "ngram_gpu", "verdict": "bug",
             "fp32 margin": 0.09}, {"class": "mtp", "verdict": "near-tie", "fp32 margin": 0.01}]
    assert guidance.recorded_verdicts_text(real, 0.74) == (
        "ngram_gpu: 2 of 2 called suspected bugs, 1 of them at a first divergence whose two tokens fp32 puts 25.8 "
        "to 25.8 logits apart, beyond the widest band recorded (0.74); mtp: 0 of 1 called suspected bugs")
    assert guidance.recorded_verdicts_text([], 0.74) == "no speculative run of this host parted from plain greedy"
