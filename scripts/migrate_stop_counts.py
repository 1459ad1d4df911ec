"""One-off migration (2026-12-05) of measured engine-outcome records written before the end-of-text token
stopped being counted as an output token before the stop.

Until then a measured record's `output_tokens_before_stop` and `stop_offset_from_prompt_len` were the
number of `token_ids` vLLM returned, the end-of-text id included, and `stop_position` was one past the
end-of-text token. Everything is recomputed from the recorded repeats with the code that writes new
records (`spectie.engines.runner.tokens_before_stop`); `stop_offset_from_prompt_len` (the report's own count)
is dropped; a note says so. Run: .venv/bin/python scripts/migrate_stop_counts.py results/measured
"""

import json
import sys
from pathlib import Path

from spectie.records import validate_record, write_record
from spectie.engines.runner import tokens_before_stop

NOTE = ("Stop counts recomputed on 2026-12-05 from the recorded repeats by scripts/migrate_stop_counts.py: the "
        "end-of-text token is no longer counted as an output token before the stop, stop_position is its 0-based "
        "index, and the report-only stop_offset_from_prompt_len is left out.")


def migrate(record: dict) -> bool:
    results = record["results"]
    if record.get("kind") != "engine-outcome" or "stop_offset_from_prompt_len" not in results:
        return False
    for repeat in results["repeats"]:
        before = tokens_before_stop(repeat)
        repeat["tokens_before_stop"] = before
        repeat["stop_position"] = None if before is None else results["prompt_tokens"] + before
    stopped = [r for r in results["repeats"] if r["finish_reason"] == "stop"]
    results["output_tokens_before_stop"] = stopped[0]["tokens_before_stop"] if stopped else None
    results["stop_position"] = stopped[0]["stop_position"] if stopped else None
    del results["stop_offset_from_prompt_len"]
    record["notes"] = (record["notes"] + " " + NOTE) if record.get("notes") else NOTE
    return True


def main(folder: str) -> None:
    changed = 0
    for path in sorted(Path(folder).rglob("*.json")):
        record = json.loads(path.read_text())
        if record.get("provenance") == "measured" and migrate(record):
            write_record(validate_record(record, str(path)), path)
            changed += 1
    print(f"{changed} records migrated")


if __name__ == "__main__":
    main(sys.argv[1])
