"""A request body's JSON, parsed so that any malformed body is a 400 in OpenAI's shape, never a 500,
and never parsed when it holds more values than any request could need.

`ValueCounter` runs on the event loop as the body arrives: it counts the commas outside strings,
a bound on the number of values, so a body of millions of numbers or objects (whose parse would
hold the interpreter for a second) is refused before it is read whole, let alone parsed.
`loads` runs on a worker thread (the router never parses on its event loop): it turns malformed
JSON, invalid UTF-8, nesting past the parser's recursion limit and integer literals longer than
Python's integer-conversion limit (`sys.get_int_max_str_digits()`, 4,300 digits by default)
into `APIError`s.  The last names the field that holds the literal (``max_tokens``,
``stop_token_ids.3``), found by parsing the body a second time with every integer kept as text:
only such bodies pay for it.
"""

from __future__ import annotations

import json
import re
import sys

from serving.openai_api import APIError

# the rest of a JSON string's content, up to its closing quote or to a backslash whose escaped
# byte is in the next piece (possessive: no backtracking, linear in the bytes)
_STRING_REST = re.compile(rb'(?:[^"\\]++|\\.)*+', re.S)


class ValueCounter:
    """Counts the separators (commas outside strings) of a JSON text fed in pieces as it arrives:
    a bound on how many values the text holds (every repeated value in an array or an object
    needs one), known before the text is parsed.  Linear in the bytes, its work done in C but for
    a few steps per string; `feed` is cheap enough to run on an event loop, a piece at a time."""

    def __init__(self):
        self.separators = 0
        self._in_string = False
        self._escaped = False  # the piece ended in a string's backslash: skip the next byte

    def feed(self, data: bytes | bytearray) -> int:
        """Account for the next piece; returns the separators so far."""
        i, n = 0, len(data)
        if self._escaped and n:
            self._escaped, i = False, 1
        while i < n:
            if self._in_string:
                j = data.find(b'"', i)
                j = n if j < 0 else j
                if data.find(b"\\", i, j) >= 0:  # escapes on the way: the regex finds the string's end
                    j = _STRING_REST.match(data, i).end()
                if j >= n:
                    break
                if data[j] == 0x5C:  # a backslash, the piece's last byte
                    self._escaped = True
                    break
                self._in_string, i = False, j + 1  # the closing quote
            else:
                j = data.find(b'"', i)
                self.separators += data.count(b",", i, n if j < 0 else j)
                if j < 0:
                    break
                self._in_string, i = True, j + 1
        return self.separators


class _Digits(str):
    """An integer literal kept as its text (a marker: no JSON value parses to this type)."""


def _int_or_digits(text: str):
    limit = sys.get_int_max_str_digits()
    digits = len(text) - text.startswith("-")
    return _Digits(text) if limit and digits > limit else int(text)


def _path_to(obj, marker_type) -> tuple[str, int] | None:
    """(dotted path, digits) of the first `marker_type` value in `obj`, depth first; iterative
    (a body nested as deep as the parser allows does not exhaust the stack)."""
    stack = [((), obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, marker_type):
            return ".".join(map(str, path)) or "body", len(value) - value.startswith("-")
        if isinstance(value, dict):
            stack.extend((path + (k,), v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((path + (i,), v) for i, v in reversed(list(enumerate(value))))
    return None


def loads(raw: bytes | bytearray | str):
    """The JSON value of `raw`, or an APIError (400, code invalid_json, or invalid_value with
    `param` naming the field of an over-long integer literal)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
    except ValueError:  # int(): a literal over the conversion limit (json raises nothing else as ValueError)
        pass
    try:
        found = _path_to(json.loads(raw, parse_int=_int_or_digits), _Digits)
    except (ValueError, RecursionError):
        found = None
    if found is None:
        raise APIError(400, "malformed JSON body: an integer literal too long to convert", code="invalid_json")
    path, digits = found
    limit = sys.get_int_max_str_digits()
    raise APIError(
        400,
        f"'{path}': an integer literal of {digits} digits; at most {limit} digits are accepted",
        param=path,
        code="invalid_value",
    )
