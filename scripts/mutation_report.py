"""Mutation testing of the operator tools' decision code (`make mutate`): what mutmut mutates, and its kill rate.

    python scripts/mutation_report.py --scope   # the mutant names `mutmut run` is given (the scope below)
    python scripts/mutation_report.py           # per module: killed / total, percent, and every survivor

The scope: the detector (spectie/tools/tiestop.py), its thresholds, the fix ledger, all of each; of the divergence
classifier its judgement (the verdict from the margins and gaps; the rest loads the model), of the guard its stop and
resume decisions (the rest talks to the server or renders the response). mutmut keeps each mutant's exit code in
mutants/spectie/<module>.py.meta; a mutant that makes the tests time out counts as killed.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path

SCOPE = {  # module -> the functions mutated (mutmut's names: x_<function>, xǁ<Class>ǁ<method>); "*": all of it
    "tiestop": ["*"],
    "thresholds": ["*"],
    "divergence": ["x_judge", "x_trailing", "x_gaps", "x_stop_where_other_goes_on", "x_check_tokens"],
    "guard": ["x_unguarded_reason", "x__uncheckable", "x_near_tie_stop", "x_complete", "x__token_limit",
              "x__continuation", "x__with_runner_up", "x__token_id"],
    "fixes": ["*"],
}
# Mutants that cannot change what the code does (a survivor no test can kill), each with why.
_IS_EOS = "the last token is one of guard.stops.ids there (checked just above): check's end-of-text test passes"
_NO_REASON = "part.stop_reason is None there (near_tie_stop returned earlier otherwise)"
EQUIVALENT = {
    "spectie.tools.guard.x_near_tie_stop__mutmut_15": _IS_EOS + " with the stops or without (None)",
    "spectie.tools.guard.x_near_tie_stop__mutmut_18": _IS_EOS + " with the stops or without (omitted)",
    "spectie.tools.guard.x_near_tie_stop__mutmut_22": _NO_REASON,
    "spectie.tools.guard.x_near_tie_stop__mutmut_26": _NO_REASON,
    "spectie.tools.guard.x__continuation__mutmut_16": "_extras tells only CHAT apart: None and COMPLETIONS ask for the same",
    "spectie.tools.tiestop.x_runner_up__mutmut_6": 'float("NAN") is the same NaN as float("nan")',
    "spectie.tools.tiestop.xǁEndOfTextǁmatches__mutmut_4": "a stop_reason that is no integer, added to the ids, matches no "
                                                     "token id (only integers are looked up in them)",
}
KILLED, SURVIVED = {1, 3, 24, -24, 36, 152, 255}, {0}  # pytest's failure codes and mutmut's timeouts; tests passed
NO_TESTS = {5, 33}


def scope_patterns() -> list[str]:
    """The mutant names `mutmut run` is given: a glob per function in scope (it matches the function's own name,
    by which mutmut finds the tests that run it, and its mutants' names), or per module."""
    return [f"spectie.{module}.{name}*".replace("**", "*") for module, names in SCOPE.items() for name in names]


def in_scope(mutant: str) -> bool:
    """Is a mutant ("spectie.tools.guard.x_complete__mutmut_12") one of a function in scope?"""
    module, function = mutant.removeprefix("spectie.").rsplit("__mutmut_", 1)[0].split(".", 1)
    return "*" in SCOPE.get(module, []) or function in SCOPE.get(module, [])


def outcomes(module: str, folder: Path = Path("mutants")) -> dict[str, int | None]:
    """Each in-scope mutant of `module` and its exit code as mutmut recorded it (None: not run yet)."""
    meta = folder / "spectie" / f"{module}.py.meta"
    if not meta.is_file():
        return {}
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    return {name: code for name, code in codes.items() if in_scope(name)}


def status(code: int | None) -> str:
    if code in KILLED:
        return "killed"
    if code in SURVIVED:
        return "survived"
    return "no tests" if code in NO_TESTS else "not run" if code is None else f"other (exit {code})"


def module_line(module: str, codes: dict[str, int | None]) -> str:
    """One module's counts: killed / total and percent, survivors (equivalent ones apart), the rest."""
    counts: dict[str, int] = {}
    for code in codes.values():
        counts[status(code)] = counts.get(status(code), 0) + 1
    killed, total = counts.pop("killed", 0), len(codes)
    survived = counts.pop("survived", 0)
    equivalent = sum(1 for name, code in codes.items() if status(code) == "survived" and name in EQUIVALENT)
    rate = f"{100 * killed / total:5.1f} %" if total else "  -"
    rest = "".join(f", {n} {what}" for what, n in sorted(counts.items()))
    return (f"{module:<11} {killed:>4} / {total:<4} killed {rate}   {survived} survived"
            f" ({equivalent} of them equivalent){rest}")


def main(argv: list[str]) -> int:
    if argv[1:] == ["--scope"]:
        print(" ".join(scope_patterns()))
        return 0
    print("mutation testing (mutmut): killed / total per module, in scope (scripts/mutation_report.py)")
    survivors = []
    for module in SCOPE:
        codes = outcomes(module)
        print(module_line(module, codes))
        survivors += [name for name, code in codes.items() if status(code) == "survived"]
    if survivors:
        print("\nsurvivors (`mutmut show <name>` shows the change):")
    for name in survivors:
        print(f"  {name}" + (f"  equivalent: {EQUIVALENT[name]}" if name in EQUIVALENT else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
