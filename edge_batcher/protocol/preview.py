"""A bounded repr of what a client sent, for error messages.

Error messages quote the offending value so the client sees what was wrong; this keeps the quote
short (length and nesting depth) however large the value is.
"""

from __future__ import annotations

import builtins
import reprlib


class _Preview(reprlib.Repr):
    def repr(self, x: object) -> str:
        # the common quote, a short name, without reprlib's dispatch (every decoded tensor names
        # itself in its error texts); the same text reprlib would give
        if type(x) is str and len(x) <= self.maxstring:
            quoted = builtins.repr(x)
            if len(quoted) <= self.maxstring:
                return quoted
        return super().repr(x)


preview = _Preview()
preview.maxlevel = 3
preview.maxlist = preview.maxdict = 8
preview.maxstring = preview.maxother = 60
