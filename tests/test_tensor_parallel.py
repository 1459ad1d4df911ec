"""One device against a split engine: the comparison turns with the records."""

from conftest import typed
from spectie.book import tensor_parallel


def run(configuration, seed, tokens, finish="length", tp=None, margins=None):
    """A first repeat of `configuration` on prompt `seed` that wrote `tokens` (the last one the stop when `finish`
    is "stop"), with tensor_parallel_size `tp` (None: a record from before the size was stated)."""
    repeat = {"token_ids": tokens, "output_tokens": len(tokens), "finish_reason": finish, "stop_reason": None,
              "top2_margins": margins or [1.0] * len(tokens)}
    return typed({"fingerprint": {"host_id": "h"},
                  "parameters": {"configuration": configuration, "baseline": "plain", "matrix": "cpu",
                                 "model": "organism", "prompt_seed": seed, "prompt_seeds": 2,
                                 "tensor_parallel_size": tp},
                  "results": {"status": "ok", "repeats": [repeat]}})


def test_the_same_tokens_split_and_unsplit_say_so():
    records = [run(c, s, [1, 2, 3], tp=tp) for c in ("plain", "mtp-k1") for s in (0, 1) for tp in (None, 2)]
    table = tensor_parallel.rows(records)
    assert [(r["configuration"], r["prompt seed"], r["same tokens"]) for r in table] == [
        ("plain", 0, "yes"), ("plain", 1, "yes"), ("mtp-k1", 0, "yes"), ("mtp-k1", 1, "yes")]
    assert tensor_parallel.summary_text(table, decision=2) == (
        "split over 2 ranks, the engine wrote the same tokens as on one in 4 of 4 runs (2 configurations × 2 prompts, "
        "first repeats); on prompt 0 (the incident's layout) every configuration wrote the same tokens split and "
        "unsplit through the designed decision (output token 2): the designed tie did not move; no stop moved; "
        "speculation stopped earlier than plain greedy in 0 runs on one device and 0 split")


def test_a_split_that_moves_a_near_tie_stop_is_named_with_its_margins():
    eos = 99
    records = [run("plain", 0, [1, 2, 3, 4], tp=1), run("plain", 0, [1, 2, 3, 4], tp=2),
               run("mtp-k1", 0, [1, 2, eos], "stop", tp=1, margins=[1.0, 1.0, 0.125]),
               run("mtp-k1", 0, [1, 2, 3, 4], tp=2, margins=[1.0, 1.0, 0.0625, 1.0]),
               run("mtp-k3", 0, [1, 2, 3, 4], tp=1)]  # no split run: not compared
    table = tensor_parallel.rows(records)
    assert len(table) == 2
    mtp = table[1]
    assert (mtp["same tokens"], mtp["first parting (output token)"], mtp["top-2 margin there, 1"],
            mtp["top-2 margin there, split"]) == ("no", 3, 0.125, 0.0625)
    assert (mtp["ending (1 / split)"], mtp["stop moved"]) == ("stop after 2 / limit after 4", "yes")
    assert mtp["stopped earlier than plain (1 / split)"] == "yes / no"
    text = tensor_parallel.summary_text(table, decision=3)
    assert "the same tokens as on one in 1 of 2 runs" in text
    assert ("the other 1 first part at output tokens 3 to 3, where vLLM's top-2 logprob margin was at most 0.062 "
            "logits on one side (0 of them exactly 0) and at most 0.125 on either") in text
    assert "mtp-k1 part at or before the designed decision (output token 3)" in text
    assert "the stop moved in 1 of the 2 runs (mtp-k1 on prompt 0: stop after 2 / limit after 4)" in text
    assert text.endswith("in 1 runs on one device and 0 split (only on one device: mtp-k1 on prompt 0; only "
                         "split: none)")
    tie = [run("plain", 1, [1, 2, 3], tp=1, margins=[1.0, 0.0, 1.0]), run("plain", 1, [1, 5, 3], tp=2)]
    assert ("first part at output tokens 2 to 2, each at an exact tie in vLLM's logprobs on one side (top-2 margin 0), "
            "the other side's margin at most 1.000 logits") in tensor_parallel.summary_text(tensor_parallel.rows(tie))


def test_without_a_split_run_the_page_says_how_to_run_one():
    text = tensor_parallel.summary_text(tensor_parallel.rows([run("plain", 0, [1], tp=1)]))
    assert text.startswith("not run yet") and "PARAMS=environments/runs/cpu-reproduce-tp2.yaml ENV=cpu" in text


def test_the_splits_margin_shifts_are_read_where_both_wrote_the_same_tokens():
    records = [run("plain", 0, [1, 2, 3, 4], tp=1, margins=[1.0, 0.5, 0.0, 2.0]),
               run("plain", 0, [1, 2, 5, 4], tp=2, margins=[1.0, 0.625, 0.25, 9.0])]
    shifts = tensor_parallel.margin_shifts(records)
    assert shifts == [0.0, 0.125, 0.25]  # through the parting token (same context), not after it
    text = tensor_parallel.summary_text(tensor_parallel.rows(records), shifts=shifts)
    assert ("where both had written the same tokens, the split moved vLLM's top-2 margin at 2 of 3 output tokens, by "
            "at most 0.250 logits (median of those moved 0.188)") in text
