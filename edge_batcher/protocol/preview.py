"""A bounded repr of what a client sent, for error messages.

Error messages quote the offending value so the client sees what was wrong; this keeps the quote
short (length and nesting depth) however large the value is.
"""

from __future__ import annotations

import reprlib

preview = reprlib.Repr()
preview.maxlevel = 3
preview.maxlist = preview.maxdict = 8
preview.maxstring = preview.maxother = 60
