"""The typed records say what the stored records hold: every field's value has the type its annotation names."""

import types
import typing

from spectie.records import record_types
from spectie.records.store import record_paths, read_stored


def conforms(value, hint) -> bool:
    """Whether `value` is of the annotated type (containers checked by kind, not element by element)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(conforms(value, option) for option in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typing.get_origin(hint) or hint)


def test_every_stored_field_has_the_type_its_record_type_names():
    wrong = set()
    for path in record_paths():
        stored = read_stored(path)
        parameters, results = record_types.KINDS[stored["kind"]]
        for cls, data in ((parameters, stored["parameters"]), (results, stored["results"]),
                          (record_types.Fingerprint, stored.get("fingerprint", {}))):
            hints = typing.get_type_hints(cls)
            wrong |= {f"{cls.__name__}.{name}: {hints[name]} holds {type(value).__name__}"
                      for name, value in data.items() if not conforms(value, hints[name])}
    assert not wrong, sorted(wrong)

