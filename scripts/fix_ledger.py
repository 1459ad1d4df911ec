#!/usr/bin/env python3
"""Fix ledger: which vLLM release first ships each public fix for the
speculative-decoding / GDN (Qwen3.5 hybrid) silent-early-stop family.

For every release asked for, the script

1. downloads the x86_64 wheel with ``python -m pip download --no-deps
   vllm==X -d <temp dir>`` (one release at a time),
2. extracts only the files named in MARKERS below (zipfile, standard library),
3. deletes the wheel,
4. checks each marker (an exact substring or a regex, optionally restricted
   to one function body), and
5. prints a table and writes everything to the JSON path given on the
   command line.

Only the standard library is used.  Publication dates come from the PyPI JSON
API (``https://pypi.org/pypi/vllm/json``, ``upload_time_iso_8601`` of the
x86_64 wheel, one request per run); pass
``--no-pypi-dates`` to skip that look-up.

A marker result is one of:

* ``present``  - the fix's code state is in the wheel,
* ``absent``   - the wheel has the file (and the anchor/scope) but not the
  fix's code state,
* ``unknown``  - the file, the anchor or the function scope is not in the
  wheel (refactored or removed), so the wheel cannot tell.

Markers with ``expect: "absent"`` are removals: the fix is indicated when the
pattern (the old code) is NOT found, and only if the ``anchor`` is found.

Per fix, the verdict for a release is ``present`` / ``absent`` when all its
decidable markers agree, ``mixed`` when they disagree, ``unknown`` when no
marker is decidable (or the fix has no marker).  Markers that were undecidable
are listed next to the verdict; they are never guessed.

Usage::

    python scripts/fix_ledger.py sources/fix_ledger.json
    python scripts/fix_ledger.py out.json --releases 0.27.0 0.28.0
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile

DEFAULT_RELEASES = [
    "0.26.0",
    "0.27.0",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
    "0.34.0",
]

GDN_ATTN = "vllm/v1/attention/backends/gdn_attn.py"
CONV1D = "vllm/model_executor/layers/mamba/ops/causal_conv1d.py"
V1_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
V2_MAMBA = "vllm/v1/worker/gpu/model_states/mamba_hybrid.py"
QWEN_GDN = "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"

ISSUE_39273 = "https://github.com/vllm-project/vllm/issues/39273"

# ---------------------------------------------------------------------------
# MARKERS: one entry per fix.  Each marker names a file inside the wheel and
# either an exact ``substring`` or a ``regex`` (Python re, MULTILINE).  An
# optional ``scope`` (regex matching a ``def`` line) restricts the search to
# that function body; an optional ``anchor`` must be found in the file (or
# scope) for the marker to be decidable at all.
# ---------------------------------------------------------------------------
MARKERS = [
    {
        "fix": "39273 / PR 40738",
        "state": "open",  # the pull request's state in the stored thread read for this ledger
        "title": "Fix GDN conv + SSM state corruption with ngram spec decode",
        "threads": [ISSUE_39273, "https://github.com/vllm-project/vllm/pull/40738"],
        "markers": [
            {
                "id": "40738-gdn_attn-src-indices",
                "file": GDN_ATTN,
                "substring": "spec_decode_src_indices",
                "why": "identifier the PR description says gdn_attn.py computes",
            },
            {
                "id": "40738-conv1d-fwd-spec-path",
                "file": CONV1D,
                "scope": r"^def _causal_conv1d_fwd_kernel\(",
                "regex": r"\bIS_SPEC_DECODING\b",
                "why": "PR adds an IS_SPEC_DECODING path to _causal_conv1d_fwd_kernel"
                " (the name already exists in the *update* kernel, hence the scope)",
            },
        ],
    },
    {
        "fix": "39273 / PR 52942",
        "state": "open",  # the pull request's state in the stored thread read for this ledger
        "title": "Fix stale mamba/GDN states with ngram spec decode on hybrid models",
        "threads": [ISSUE_39273, "https://github.com/vllm-project/vllm/pull/52942"],
        "markers": [
            {
                "id": "52942-none-mode-migration",
                "file": V1_RUNNER,
                "scope": r"^    def _update_states_after_model_execute\(",
                "regex": r"mamba_cache_mode\s*==\s*['\"]none['\"]",
                "why": "location-based: the PR adds a mamba_cache_mode=='none' state"
                " migration inside GPUModelRunner._update_states_after_model_execute;"
                " the stored thread names no new identifier",
            },
        ],
    },
    {
        "fix": "39273 / PR 56531 (identifier named in the PR)",
        "state": "open",  # the pull request's state in the stored thread read for this ledger
        "title": "Route every speculation-capable row through the speculative path",
        "threads": [
            ISSUE_39273,
            "https://github.com/vllm-project/vllm/pull/56531",
        ],
        "markers": [
            {
                "id": "56531-v2-helper-name",
                "file": V2_MAMBA,
                "substring": "compute_num_decode_draft_tokens",
                "why": "helper the PR description says is extracted for the V2 runner",
            },
        ],
    },
    {
        "fix": "39273 / PR 56531 (behaviour described in the PR)",
        "state": "open",  # the pull request's state in the stored thread read for this ledger
        "title": "Zero-draft decode rows stay speculative rows (V1 runner, GDN builder,"
        " V2 runner)",
        "threads": [
            ISSUE_39273,
            "https://github.com/vllm-project/vllm/pull/56531",
        ],
        "markers": [
            {
                "id": "56531-v1-use-spec-decode-from-config",
                "file": V1_RUNNER,
                "regex": r"^\s*use_spec_decode\s*=\s*self\.speculative_config is not None\s*$",
                "why": "'use_spec_decode now follows the speculative config rather than"
                " this step's scheduled drafts'",
            },
            {
                "id": "56531-v1-zero-draft-rows-0",
                "file": V1_RUNNER,
                "substring": "zero_draft_decode_mask",
                "why": "'zero-draft decode rows are marked 0 instead of the -1"
                " placeholder' (name taken from the wheel, not from the thread)",
            },
            {
                "id": "56531-v1-accepted-init-1",
                "file": V1_RUNNER,
                "regex": r"self\.num_accepted_tokens\.np\.fill\(1\)\s*\n\s*"
                r"self\.num_accepted_tokens\.copy_to_gpu\(\)",
                "why": "'num_accepted_tokens is initialized to 1'",
            },
            {
                "id": "56531-gdn-no-batch-fallback",
                "file": GDN_ATTN,
                "anchor": r"spec_sequence_masks_cpu = num_decode_draft_tokens_cpu >= 0",
                "regex": r"num_decode_draft_tokens_cpu\[[^\]]+\]\s*\.sum\(\)\s*\.item\(\)",
                "expect": "absent",
                "why": "removal: 'Drop the batch-level fallback' (the old code sums the"
                " draft counts and falls back to the non-spec path when it is 0)",
            },
            {
                "id": "56531-v2-zero-draft-rows",
                "file": V2_MAMBA,
                "substring": "is_decode, num_draft_tokens_per_req, -1",
                "why": "V2 runner: every decode row keeps its (possibly 0) draft count;"
                " before, only rows with >0 drafts did",
            },
        ],
    },
    {
        "fix": "51812",
        "state": "merged",  # the pull request's state in the stored thread read for this ledger
        "title": "Align Qwen GDN gates with speculative tokens",
        "threads": ["https://github.com/vllm-project/vllm/pull/51812"],
        "markers": [
            {
                "id": "51812-a-gather",
                "file": QWEN_GDN,
                "substring": "a_spec = a.index_select(0, spec_token_indx)",
                "why": "'Gather a and b with the same indices' as mixed_qkv",
            },
            {
                "id": "51812-b-gather",
                "file": QWEN_GDN,
                "substring": "b_spec = b.index_select(0, spec_token_indx)",
                "why": "same, gate b",
            },
            {
                "id": "51812-spec-call-uses-gathered",
                "file": QWEN_GDN,
                "regex": r"a=a_spec,\s*\n\s*b=b_spec,",
                "why": "the speculative fused recurrent update receives the gathered"
                " gates",
            },
        ],
    },
    {
        "fix": "41467",
        "state": "closed",  # the pull request's state in the stored thread read for this ledger
        "title": "Detect MTP truncation at reasoning-to-tool-call boundary (closed PR)",
        "threads": ["https://github.com/vllm-project/vllm/pull/41467"],
        "markers": [],
        "no_marker_reason": "the stored thread (a closed PR, not an issue) shows the"
        " summary only; its diff, files and identifiers were not visible, so no"
        " marker can be chosen",
    },
]


# ---------------------------------------------------------------------------


def _scope_text(text: str, scope: str) -> str | None:
    """Return the body of the first function whose def line matches scope."""
    lines = text.splitlines(keepends=True)
    pat = re.compile(scope)
    for i, line in enumerate(lines):
        if pat.search(line):
            indent = len(line) - len(line.lstrip())
            stop = re.compile(r"^\s{0,%d}(def |async def |class |@)" % indent)
            out = [line]
            for nxt in lines[i + 1 :]:
                if stop.match(nxt) and (len(nxt) - len(nxt.lstrip())) <= indent:
                    break
                out.append(nxt)
            return "".join(out)
    return None


def check_marker(marker: dict, files: dict) -> dict:
    """files: path -> text or None (not in wheel)."""
    res = {"id": marker["id"], "file": marker["file"]}
    text = files.get(marker["file"])
    if text is None:
        res.update(result="unknown", why_unknown="file not in wheel")
        return res
    if marker.get("scope"):
        text = _scope_text(text, marker["scope"])
        if text is None:
            res.update(result="unknown", why_unknown="scope not found: " + marker["scope"])
            return res
    if marker.get("anchor") and not re.search(marker["anchor"], text, re.M):
        res.update(result="unknown", why_unknown="anchor not found: " + marker["anchor"])
        return res
    if "substring" in marker:
        hits = text.count(marker["substring"])
    else:
        hits = len(re.findall(marker["regex"], text, re.M))
    res["pattern_hits"] = hits
    expect = marker.get("expect", "present")
    found = hits > 0
    fixed = found if expect == "present" else not found
    res["result"] = "present" if fixed else "absent"
    return res


def verdict(marker_results: list) -> dict:
    if not marker_results:
        return {"verdict": "unknown", "undecidable_markers": []}
    known = [m for m in marker_results if m["result"] != "unknown"]
    undecidable = [m["id"] for m in marker_results if m["result"] == "unknown"]
    if not known:
        v = "unknown"
    elif all(m["result"] == "present" for m in known):
        v = "present"
    elif all(m["result"] == "absent" for m in known):
        v = "absent"
    else:
        v = "mixed"
    return {"verdict": v, "undecidable_markers": undecidable}


_PYPI_CACHE: dict = {}


def pypi_upload_time(version: str) -> str | None:
    """Upload time of the x86_64 wheel, from the project-level PyPI JSON
    (https://pypi.org/pypi/vllm/json, fetched once per run)."""
    if "data" not in _PYPI_CACHE:
        url = "https://pypi.org/pypi/vllm/json"
        try:
            with urllib.request.urlopen(url, timeout=120) as r:
                _PYPI_CACHE["data"] = json.load(r)
        except Exception as e:  # noqa: BLE001
            print(f"  (PyPI date look-up failed: {e})", file=sys.stderr)
            _PYPI_CACHE["data"] = None
    data = _PYPI_CACHE["data"]
    if not data:
        return None
    times = [
        f.get("upload_time_iso_8601")
        for f in data.get("releases", {}).get(version, [])
        if f.get("filename", "").endswith("x86_64.whl")
    ]
    return times[0] if times else None


def process_release(version: str, wanted: list, keep_dir: str | None) -> dict:
    rec = {"version": version}
    with tempfile.TemporaryDirectory(prefix=f"fixledger-{version}-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps",
            f"vllm=={version}", "-d", tmp,
        ]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        rec["download_seconds"] = round(time.monotonic() - t0, 2)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if proc.returncode != 0 or not wheels:
            rec["available"] = False
            rec["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return rec
        rec["available"] = True
        wheel = os.path.join(tmp, wheels[0])
        rec["wheel"] = wheels[0]
        rec["wheel_bytes"] = os.path.getsize(wheel)
        h = hashlib.sha256()
        with open(wheel, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        rec["wheel_sha256"] = h.hexdigest()
        files = {}
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            meta = [n for n in names if n.endswith(".dist-info/METADATA")]
            if meta:
                m = zf.read(meta[0]).decode("utf-8", "replace")
                mv = re.search(r"^Version:\s*(\S+)", m, re.M)
                rec["metadata_version"] = mv.group(1) if mv else None
            for path in wanted:
                if path in names:
                    out_dir = keep_dir and os.path.join(keep_dir, version)
                    zf.extract(path, out_dir or tmp)
                    with open(os.path.join(out_dir or tmp, path), encoding="utf-8") as fh:
                        files[path] = fh.read()
                else:
                    files[path] = None
        os.remove(wheel)  # only the extracted files are kept (in tmp or keep_dir)
        rec["files_in_wheel"] = {p: (files[p] is not None) for p in wanted}
        rec["fixes"] = {}
        for fix in MARKERS:
            mres = [check_marker(m, files) for m in fix["markers"]]
            rec["fixes"][fix["fix"]] = {"markers": mres, **verdict(mres)}
    return rec


def first_present(releases: list, fix_id: str) -> str | None:
    for r in releases:
        if r.get("available") and r["fixes"][fix_id]["verdict"] == "present":
            return r["version"]
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json_out", help="path of the JSON file to write")
    ap.add_argument("--releases", nargs="+", default=DEFAULT_RELEASES)
    ap.add_argument("--no-pypi-dates", action="store_true",
                    help="skip the PyPI JSON look-up of upload times")
    ap.add_argument("--keep-sources", metavar="DIR",
                    help="keep the extracted files under DIR/<version>/")
    args = ap.parse_args()

    wanted = sorted({m["file"] for fix in MARKERS for m in fix["markers"]})
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    releases = []
    for v in args.releases:
        print(f"[{v}] downloading ...", file=sys.stderr, flush=True)
        rec = process_release(v, wanted, args.keep_sources)
        if rec.get("available") and not args.no_pypi_dates:
            rec["pypi_upload_time_x86_64_wheel"] = pypi_upload_time(v)
        releases.append(rec)

    summary = {}
    for fix in MARKERS:
        summary[fix["fix"]] = {
            "first_release_with_fix": first_present(releases, fix["fix"]),
            "per_release": {
                r["version"]: (r["fixes"][fix["fix"]]["verdict"] if r.get("available")
                               else "not on PyPI")
                for r in releases
            },
        }

    skipped = None
    if _PYPI_CACHE.get("data"):
        def key(v):
            try:
                return tuple(int(x) for x in v.split("."))
            except ValueError:
                return None
        req = [key(v) for v in args.releases if key(v)]
        if req:
            lo, hi = min(req), max(req)
            skipped = sorted(
                (v for v in _PYPI_CACHE["data"].get("releases", {})
                 if key(v) and lo <= key(v) <= hi and v not in args.releases),
                key=key,
            )

    out = {
        "generated_utc": started,
        "pypi_versions_in_range_not_requested": skipped,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "pip_download": "python -m pip download --no-deps vllm==<version> -d <tmp>",
        "releases_requested": args.releases,
        "releases_not_on_pypi": [r["version"] for r in releases if not r.get("available")],
        "total_download_seconds": round(sum(r.get("download_seconds", 0) for r in releases), 2),
        "markers": MARKERS,
        "releases": releases,
        "summary": summary,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    with open(args.json_out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=2)
        fh.write("\n")

    # table
    vers = [r["version"] for r in releases]
    w = max(len(f["fix"]) for f in MARKERS)
    print("fix".ljust(w) + " | " + " | ".join(v.ljust(7) for v in vers) + " | first")
    print("-" * (w + 3 + 10 * len(vers) + 6))
    for fix in MARKERS:
        row = summary[fix["fix"]]
        cells = [row["per_release"][v][:7].ljust(7) for v in vers]
        print(fix["fix"].ljust(w) + " | " + " | ".join(cells) + " | "
              + str(row["first_release_with_fix"]))
    print()
    print("marker detail (P=present A=absent ?=unknown):")
    for fix in MARKERS:
        for m in fix["markers"]:
            cells = []
            for r in releases:
                if not r.get("available"):
                    cells.append("-")
                    continue
                mr = next(x for x in r["fixes"][fix["fix"]]["markers"] if x["id"] == m["id"])
                cells.append({"present": "P", "absent": "A"}.get(mr["result"], "?"))
            print(f"  {m['id']:<40} " + " ".join(c.ljust(7) for c in cells))
    print(f"\nJSON written to {args.json_out}; downloads took "
          f"{out['total_download_seconds']} s in total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
