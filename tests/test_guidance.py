"""The guidance chapter's wording helpers, on hand-made rows (the chapter itself is tested in test_book)."""

from conftest import typed
from spectie.book import guidance, guidance_classifier, guidance_rows, guidance_survey, incident
from spectie.records.record_types import Record


def _record(kind, record_id="test", parameters=None, results=None, environment="cpu", **fields) -> Record:
    """A record of `kind` with the fields a stored one has, cut down to what the test reads."""
    return typed({"id": record_id, "kind": kind, "chapter": "guidance", "environments": [environment],
                  "parameters": parameters or {}, "results": results or {}, **fields})


def _rows(**counts):
    return [{"configuration": name.replace("_", "-"), "[DATA] rows written": n} for name, n in counts.items()]


def test_rows_text_says_which_runs_wrote_fewer_and_which_more():
    assert guidance_rows.rows_text(_rows(plain=3, mtp_k1=8, ngram=7), "plain") == \
        "plain greedy wrote 3 rows; mtp-k1, ngram more (7–8)"
    assert guidance_rows.rows_text(_rows(plain=5, mtp_k1=2, mtp_k8=2, ngram=9), "plain") == \
        "plain greedy wrote 5 rows; mtp-k1, mtp-k8 fewer (2); ngram more (9)"
    assert guidance_rows.rows_text(_rows(plain=4, mtp_k1=4), "plain") == \
        "plain greedy wrote 4 rows; every speculative run as many"
    assert guidance_rows.rows_text(_rows(mtp_k1=4), "plain") == "no plain greedy run is recorded to compare with"
    assert guidance_rows.rows_text(_rows(mtp_k1=4), None) == "no plain greedy run is recorded to compare with"


def test_outcomes_are_grouped_by_how_they_ended():
    stop = {"finish_reason": "stop", "stop_reason": None, "output_tokens": 41}  # 40 tokens, then end-of-text
    limit = {"finish_reason": "length", "stop_reason": None, "output_tokens": 96}
    assert guidance.grouped_outcomes({"K = 1": limit, "K = 3": stop, "K = 8": limit}) == \
        "K = 1, K = 8: the 96-token limit (length); K = 3: stop after 40 tokens"


def test_the_computed_sentences_say_what_the_records_say():
    limit = {"finish_reason": "length", "output_tokens": 96}
    stop = {"finish_reason": "stop", "output_tokens": 12}
    scope = "the 2 configurations of vLLM 0.32.0 (CPU, host h) on prompt seed 0"
    assert guidance.ends_text(limit, {"mtp-k1": limit}, scope) == (
        f"In {scope}, every changed completion ended where plain greedy's did (the 96-token limit (length)): there, "
        "speculation changed tokens, not where the completion stops")
    assert guidance.ends_text(limit, {"mtp-k1": limit, "mtp-k8": stop}, scope).startswith(
        f"In {scope}, where the completion ends moved for mtp-k8:")
    assert guidance.ends_text(limit, {}, scope).startswith(f"In {scope}, no speculative completion differs")
    assert guidance.stops_text([], 0, 0.1, scope).startswith(f"No run of {scope} stopped")
    assert guidance.stops_text([0.0, 0.5], 1, 0.1) == \
        "The stops of these runs won by 0.00 to 0.50 logits: 1 of 2 are within the detector's threshold of 0.100 logits"
    assert guidance.upstream_text({"mtp-k1": limit}, limit, "58").endswith("the classifier is the tool that finds the tie")
    assert "not at the stop" in guidance.upstream_text({"mtp-k1": stop}, limit, "9")
    assert guidance.upstream_text({"mtp-k1": limit}, limit, "58", suspected=1).endswith(
        "(below), where the classifier calls 1 of the divergences suspected correctness bugs; no run stopped there, so "
        "there is no stop for a tie-stop detector to judge, and the classifier is the tool that finds where they part")
    assert guidance.upstream_text({}, limit, "—").startswith("Speculation left every completion")
    counts = {"ordinary_stops": 0, "ordinary_flagged": 0, "moved_tie_at_divergence": 3}
    assert guidance_survey.survey_verdict(counts).startswith("No completion of the survey ended with an ordinary stop")
    assert guidance_survey.survey_verdict(dict(counts, ordinary_stops=12), "the survey of host h").startswith(
        "In the survey of host h, the detector flagged none of the 12 ordinary stops; it is blind")
    assert guidance_survey.survey_verdict(dict(counts, ordinary_stops=12, ordinary_flagged=2,
                                        moved_tie_at_divergence=0)) == \
        "In the survey, the detector flagged 2 of the 12 ordinary stops"
    assert guidance_survey.survey_verdict(dict(counts, ordinary_stops=1, moved_tie_at_divergence=0)) == \
        "In the survey, the detector flagged none of the 1 ordinary stop (fewer than 10: too few to estimate a rate)"
    assert guidance.rate_text(3, 40) == "3 of 40 (8%)" and guidance.rate_text(0, 1) == "0 of 1 (too few for a rate)"
    assert guidance_classifier.class_counts([{"class": "designed tie"}, {"class": "digit tie"}, {"class": "designed tie"}]) == \
        "designed tie: 2, digit tie: 1"
    assert guidance_survey.survey_verdict({}) == "No survey is recorded for this model"


def test_the_classifier_scores_and_real_verdicts_are_told_from_their_rows():
    rows = [{"case": "tie 0", "truth": "near-tie", "class": "designed tie", "verdict": "near-tie", "right": True,
             "fp32_margin": 0.01},
            {"case": "tie 1", "truth": "near-tie", "class": "designed tie", "verdict": "bug", "right": False,
             "fp32_margin": 0.5},
            {"case": "gate", "truth": "bug", "class": "gate-shift", "verdict": "bug", "right": True, "fp32_margin": -6.0},
            {"case": "lost", "truth": "bug", "class": "lost-state", "verdict": "near-tie", "right": False,
             "fp32_margin": -0.07}]
    text = guidance_classifier.classifier_score_text(rows)
    assert text.startswith("it called 1 of 2 near-ties near-ties and caught 1 of 2 planted bugs; it missed "
                           "lost-state (1): in each, the planted bug first changed a token where fp32's top two were "
                           "at most 0.070 logits apart")
    assert text.endswith("; it called 1 near-tie(s) suspected bugs (tie 1)")
    real = [{"class": "ngram_gpu", "verdict": "bug", "fp32_margin": -25.8}, {"class": "ngram_gpu", "verdict": "bug",
             "fp32_margin": 0.09}, {"class": "mtp", "verdict": "near-tie", "fp32_margin": 0.01}]
    assert guidance_classifier.recorded_verdicts_text(real, 0.74) == (
        "ngram_gpu: 2 of 2 called suspected bugs, 1 of them at a first divergence whose two tokens fp32 puts 25.8 "
        "to 25.8 logits apart, beyond the widest band recorded (0.74); mtp: 0 of 1 called suspected bugs")
    assert guidance_classifier.recorded_verdicts_text([], 0.74) == "no speculative run of this host parted from plain greedy"


# ------------------------------------------------------------------------------ the evidence functions on hand-built runs
def _run(configuration, tokens, method="mtp", k=None, finish="stop", status="ok", first_divergence=None,
         distinct=1, runs_total=3, stop_margin=None, seed=0, environment="cpu", host="host-a", record_id=None,
         weights=None):
    """An engine-outcome record, as the reproduce chapter writes it, cut down to what guidance reads."""
    repeats = [{"token_ids": tokens, "output_tokens": len(tokens), "finish_reason": finish,
                "first_divergence": first_divergence, "stop_margin": stop_margin}] if status == "ok" else []
    return _record("engine-outcome", record_id or f"reproduce-{configuration}-s{seed}", environment=environment,
                   fingerprint={"vllm": "0.19.0", "host_id": host, "gpu": None, "model_sha256": weights},
                   parameters={"configuration": configuration, "baseline": "plain", "method": method,
                               "num_speculative_tokens": k, "prompt_seed": seed, "prompt_token_ids": [1, 2, 3],
                               "model": "organism", "matrix": "cpu"},
                   results={"status": status, "repeats": repeats, "distinct_outputs": distinct if repeats else 0,
                            "runs_total": runs_total})


def _runs():
    """Plain greedy stops after 5 tokens; MTP K = 1 writes the same; MTP K = 8 parts at token 3 and stops after 4;
    ngram parts at token 3 too and runs to the limit; ngram_gpu failed."""
    return [_run("plain", [7, 8, 9, 10, 0], method="none"),
            _run("mtp-k1", [7, 8, 9, 10, 0], k=1),
            _run("mtp-k8", [7, 8, 9, 0], k=8, first_divergence=3, distinct=2),
            _run("ngram", [7, 8, 9, 11, 12, 13], method="ngram", k=3, finish="length", first_divergence=3),
            _run("ngram_gpu", [], method="ngram_gpu", k=3, status="error")]


def _verdict(verdict, position, margin=0.01, outside_a=()):
    from spectie.tools import divergence

    return divergence.Divergence(verdict, position, 0, 1, "a", "b", margin, margin, "a", 1, 2, list(outside_a), [],
                                 0.1, "given", f"{verdict} at {position}")


def test_runs_are_told_apart_from_their_baseline():
    runs = _runs()
    assert guidance.baseline_run(runs).parameters.configuration == "plain"
    assert guidance.baseline_run(runs[1:]) is None
    assert list(guidance.first_repeats(runs)) == ["plain", "mtp-k1", "mtp-k8", "ngram"]
    assert [r.parameters.configuration for r in guidance.speculative_runs(runs)] == ["mtp-k1", "mtp-k8", "ngram"]
    base, changed = guidance.changed_completions(runs)
    assert base["output_tokens"] == 5 and list(changed) == ["mtp-k8", "ngram"]
    assert changed["mtp-k8"]["token_ids"] == [7, 8, 9, 0]
    assert guidance.changed_completions(runs[1:]) == (None, {})


def test_a_stop_on_the_last_allowed_token_is_earlier_than_a_run_to_the_limit():
    # Plain greedy wrote 4 tokens to the limit; MTP K = 1 wrote 3 and its end-of-text took the 4th place: as many
    # output tokens, but it stopped and wrote fewer. K = 2 wrote plain greedy's tokens; a later stop is not earlier.
    runs = [_run("plain", [7, 8, 9, 10], method="none", finish="length"), _run("mtp-k1", [7, 8, 11, 0], k=1),
            _run("mtp-k2", [7, 8, 9, 10], k=2, finish="length")]
    assert guidance.run_facts(runs)["speculative_earlier"] == 1
    later = [_run("plain", [7, 8, 0], method="none"), _run("mtp-k1", [7, 8, 9, 0], k=1)]
    assert guidance.run_facts(later)["speculative_earlier"] == 0


def test_run_facts_say_what_ran_what_changed_and_how_it_ended():
    facts = guidance.run_facts(_runs())
    assert {name: facts[name] for name in ("vllm_version", "speculative_ran", "speculative_changed",
                                           "speculative_earlier", "distinct_max", "repeats_each")} == {
        "vllm_version": "0.19.0", "speculative_ran": 3, "speculative_changed": 2, "speculative_earlier": 1,
        "distinct_max": 2, "repeats_each": 3}
    # the end-of-text token (0) is not counted: plain greedy wrote 7, 8, 9, 10, then stopped
    assert facts["baseline_outcome"] == "stop after 4 tokens"
    assert facts["changed_outcomes"] == "mtp-k8: stop after 3 tokens; ngram: the 6-token limit (length)"
    assert facts["k_outcomes"] == "K = 1: stop after 4 tokens; K = 8: stop after 3 tokens"
    changed = facts["changed_text"]  # a claim naming its runs
    assert changed.text == (f"in {facts['runs_scope']}, 2 of the 3 speculative configurations that ran wrote a "
                            "different completion from plain greedy (plain greedy: stop after 4 tokens; mtp-k8: stop "
                            "after 3 tokens; ngram: the 6-token limit (length)), up to 2 distinct outputs per "
                            "configuration")
    assert changed.holds(_runs()) and changed.facts["changed"] == ["mtp-k8", "ngram"]
    determinism = facts["determinism_text"]  # a claim naming its runs
    assert determinism.text == (f"in {facts['runs_scope']}, at most 2 distinct output(s) over 3 repeats per "
                                "configuration: not deterministic: repeats differ")
    assert determinism.names_its_scope() and determinism.holds(_runs())
    assert facts["failed_names"] == "ngram_gpu (error)"
    assert facts["runs_scope"] == "the 5 configurations of vLLM 0.19.0 (CPU, host host-a) on prompt seed 0"
    claim = facts["ends_text"]  # a claim: the sentence, the runs it covers, and what it states about them
    assert claim.text.startswith(f"In {facts['runs_scope']}, where the completion ends moved for mtp-k8, ngram:")
    assert claim.names_its_scope() and claim.facts == {"changed": ["mtp-k8", "ngram"], "moved": ["mtp-k8", "ngram"]}
    assert claim.holds(_runs()) and claim.scope.hosts == ("host-a",) and claim.scope.prompt_seeds == (0,)
    assert facts["batch_invariant_text"] == "not measured yet: no record of a batch-invariant configuration"

    same = guidance.run_facts(_runs()[:2])
    assert (same["speculative_changed"], same["changed_outcomes"], same["failed_names"]) == (0, "none", "none")
    assert same["changed_text"].text.endswith("(plain greedy: stop after 4 tokens; none), every repeat identical")
    assert same["determinism_text"].text.endswith("configuration: deterministic: every repeat wrote the same output")
    empty = guidance.run_facts([])
    assert (empty["vllm_version"], empty["baseline_outcome"], empty["k_outcomes"], empty["repeats_each"]) == \
        ("—", "—", "no MTP run recorded", 0)


def test_detector_facts_count_the_stops_inside_the_band():
    rows = [{"finish": "stop", "margin": 0.05, "flagged": True}, {"finish": "stop", "margin": 1.5, "flagged": False},
            {"finish": "stop", "margin": None, "flagged": None}, {"finish": "length", "margin": None, "flagged": None}]
    assert guidance.detector_facts(rows, 0.1, "the 2 runs here") == {
        "stops_total": 3, "stops_flagged": 1,
        "stops_text": "The stops of the 2 runs here won by 0.05 to 1.50 logits: 1 of 2 are within the detector's "
                      "threshold of 0.100 logits"}
    assert guidance.detector_facts([], 0.1)["stops_total"] == 0
    assert guidance.detector_facts([], 0.1, "the 2 runs here")["stops_text"] == (
        "No run of the 2 runs here stopped before its token limit, so the detector had no stop of theirs to judge")
    stop = {"stop_token": "<eos>", "margin": 0.04, "runner_up": "x"}
    detector = guidance.detector_rows([_run("plain", [1, 0], method="none", stop_margin=stop)], 0.1)
    assert guidance.detector_facts(detector, 0.1)["stops_flagged"] == 1


def _fake_classify(monkeypatch):
    """divergence.classify replaced by a fake that records each call: near-tie unless b is longer than a."""
    from spectie.tools import divergence

    calls = []

    def classify(model, prompt_ids, tokens_a, tokens_b, threshold=None):
        calls.append((model, list(tokens_a), list(tokens_b), threshold))
        at = next(i for i, (x, y) in enumerate(zip(tokens_a + [None], tokens_b + [None])) if x != y)
        return _verdict(divergence.Verdict.BUG if len(tokens_a) > len(tokens_b) else divergence.Verdict.NEAR_TIE, at)

    monkeypatch.setattr(divergence, "classify", classify)
    return calls


def test_each_divergence_is_classified_once_and_feeds_the_tables_and_the_verdict_records(monkeypatch):
    from spectie.tools import divergence_cases

    calls = _fake_classify(monkeypatch)
    runs = _runs()
    classify = guidance_classifier.cached_classifier("organism", 0.1)
    results = guidance_classifier.classify_runs(runs, classify)
    assert [(r.parameters.configuration, result.position) for r, result in results] == \
        [("mtp-k8", 3), ("ngram", 3)]
    assert [c[1] for c in calls] == [[7, 8, 9, 0], [7, 8, 9, 11, 12, 13]]
    assert all(c[0] == "organism" and c[3] == 0.1 for c in calls)

    # The verdict records' rows: what divergence_cases.classify_cases gives, with no classification made again.
    pairs = divergence_cases.recorded_pairs(runs)
    rows = divergence_cases.classify_cases(pairs, classifier=classify, progress=False)
    assert len(calls) == 2
    assert rows == divergence_cases.classify_cases(pairs, "organism", 0.1, progress=False)  # the same as classifying anew
    assert len(calls) == 3
    assert [(r["case"], r["class"], r["verdict"], r["output_token"]) for r in rows] == \
        [("mtp-k8 vs plain, seed 0", "mtp", "near-tie", 4)]  # ngram parts at the same position: counted once
    assert rows[0]["truth"] is None and rows[0]["right"] is None
    labelled = divergence_cases.classify_cases([dict(pairs[0], label="bug")], classifier=classify, progress=False)
    assert (labelled[0]["truth"], labelled[0]["right"]) == ("bug", False)


def test_classifier_rows_and_facts_are_told_from_the_verdicts():
    from spectie.tools import divergence

    runs = _runs()
    by_name = {r.parameters.configuration: r for r in runs}
    results = [(by_name["mtp-k8"], _verdict(divergence.Verdict.NEAR_TIE, 3)),
               (by_name["ngram"], _verdict(divergence.Verdict.BUG, 11, outside_a=[{"position": 4, "gap": 6.5}]))]
    planted = _verdict(divergence.Verdict.BUG, 0, margin=-7.0)
    rows = guidance_classifier.classifier_rows(results, planted)
    assert [(r["pair"], r["first divergence (output token)"]) for r in rows] == [
        ("mtp-k8 vs plain (vLLM)", 4), ("ngram vs plain (vLLM)", 12),
        ("planted lost GDN state vs plain (transformers)", 1)]
    assert guidance_classifier.divergence_positions(results) == "4, 12"
    assert guidance_classifier.divergence_positions([]) == "—"
    facts = guidance_classifier.classifier_facts(runs, results, planted)
    assert (facts["vllm_near_ties"], facts["vllm_divergences"], facts["vllm_divergence_at"]) == (1, 2, "4, 12")
    assert facts["suspected_note"] == "; it calls ngram a suspected correctness bug (below)"
    assert facts["vllm_suspected"].startswith("the classifier calls ngram (1 tokens outside the band, up to 6.5 logits")
    assert facts["upstream_text"].startswith("Where speculation changed the organism's completion in these runs, "
                                             "speculative and plain decoding first part at output token 4, 12 (below)")
    assert (facts["planted_verdict"], facts["planted_explanation"]) == \
        (divergence.Verdict.BUG, "suspected correctness bug at 0")
    none = guidance_classifier.classifier_facts(runs, results[:1], planted)
    assert none["suspected_note"] == "; none is a suspected bug"


def _logits(fp32, bf16):
    return _record("logit-comparison", "hf-reference-logits-1854",
                   results={"rows": [dict(fp32, dtype="fp32"), dict(bf16, dtype="bf16")]})


def test_the_incident_is_read_from_its_reported_logits():
    reported = [_record("engine-outcome", "b200-k7"),
                _logits({"margin": 0.67, "winner": "EOS", "logits": {"DATA": 15.8, "EOS": 16.47}},
                        {"margin": 0.69, "winner": "DATA", "logits": {"DATA": 16.5, "EOS": 15.81}})]
    assert incident.fp32_row(reported)["margin"] == 0.67
    assert guidance.incident_flag_text(reported) == (
        "inside the incident's own fp32-to-bf16 swing of 1.36 logits, the threshold the detector uses when no band is "
        "recorded for a model: it would flag it")
    wide = [_logits({"margin": 2.0, "winner": "EOS", "logits": {"DATA": 16.0, "EOS": 18.0}},
                    {"margin": 1.9, "winner": "EOS", "logits": {"DATA": 16.0, "EOS": 17.9}})]
    assert guidance.incident_flag_text(wide) == \
        "outside the incident's own fp32-to-bf16 swing of 0.10 logits: the detector would not flag it"


def test_the_noise_band_is_the_given_one_else_the_recorded_one(monkeypatch):
    from spectie.lab import model as model_module

    assert guidance.noise_band("organism", 0.25) == (0.25, "given as a parameter")
    monkeypatch.setattr(model_module, "resolve_model", lambda name: f"/models/{name}")
    monkeypatch.setattr(guidance.thresholds, "threshold_for_model", lambda path: (0.08, f"recorded for {path}"))
    assert guidance.noise_band("organism", None) == (0.08, "recorded for /models/organism")


def test_the_decisive_margin_and_the_b200_runs_by_k():
    record = _record("logit-comparison", results={"rows": [{"dtype": "bf16", "margin": 0.2, "winner": "DATA"},
                                                           {"dtype": "fp32", "margin": 0.031, "winner": "EOS"}]})
    assert guidance.decisive_facts([record]) == {"decisive_fp32": 0.031, "decisive_winner": "EOS"}
    empty = guidance.decisive_facts([])
    assert empty["decisive_winner"] == "—" and empty["decisive_fp32"] != empty["decisive_fp32"]  # nan

    def b200(k, stopped):
        return _record("engine-outcome", f"b200-k{k}", {"num_speculative_tokens": k}, {"stopped_early": stopped},
                       provenance="reported")

    reported = [b200(8, False), b200(7, True), _record("engine-outcome", "b200-plain-greedy", provenance="reported")]
    facts = incident.b200_facts(reported)
    assert {name: facts[name] for name in ("b200_k_stops", "b200_k_continues", "k_threshold_text")} == {
        "b200_k_stops": "7", "b200_k_continues": "8",
        "k_threshold_text": "a wider K did not stop where a narrower one did, so no K threshold holds"}
    claim = facts["b200_k_text"]  # a claim naming the incident's B200 runs
    assert claim.text == ("the incident's B200 stopped at K = 7 and not at K = 8 (reported): a wider K did not stop "
                          "where a narrower one did, so no K threshold holds")
    assert claim.holds(reported) and not claim.holds(reported + [b200(9, True)])
    assert incident.b200_facts([b200(3, False), b200(7, True)])["k_threshold_text"] == \
        "these runs alone do not contradict a K threshold"
    assert incident.b200_facts([])["b200_k_stops"] == "—"


def test_recorded_runs_are_one_run_of_these_weights_in_this_environment(monkeypatch):
    from spectie.records import store as records

    other_weights = _run("plain", [1], method="none", record_id="other", weights="other")
    stored = [_run("plain", [1], method="none"), _run("mtp-k1", [1], k=1), _run("plain", [1], method="none", seed=1),
              _run("plain", [1], method="none", environment="v0.26.0-h200"), other_weights]
    monkeypatch.setattr(records, "load_records", lambda **match: [r for r in stored if match.get("kind") == r.kind])
    monkeypatch.setattr(records, "same_weights", lambda r, model: r.fingerprint.model_sha256 != "other")
    assert len(guidance.model_records("organism", kind="engine-outcome")) == 4
    runs = guidance.recorded_runs("organism", "cpu")
    assert [(r.parameters.configuration, r.parameters.prompt_seed) for r in runs] == \
        [("plain", 0), ("mtp-k1", 0)]
