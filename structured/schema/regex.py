"""Regex facts the schema checks and rewrites rely on: a pattern's width and atoms, a pattern bounded
to a length range (`bounded_pattern`), alternatives anchored at both ends joined (`anchored_alternation`),
and what xgrammar would misread in a pattern (`regex_problem`).
"""
from __future__ import annotations

import re
import warnings


_QUANTIFIER = re.compile(r"(\*|\+|\?|\{\d+(?:,\d*)?\})\??")


def _width(regex: str) -> tuple[int, int] | None:
    """(min, max) code points a regex matches (max 2**31 - 1 or more for unbounded), or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "possible nested set": [[ in ECMA classes
            lo, hi = re._parser.parse(regex).getwidth()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - Python cannot parse it: no claim about it
        return None
    return lo, hi


def _atoms(body: str) -> list[tuple[str, str]] | None:
    """`body` split into (atom, quantifier) at the top level, or None where it has a top-level `|`."""
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch == "|":
            return None
        if ch == "\\":
            j = i + 2
        elif ch == "[":
            j = i + 1
            j += body[j] == "^" if j < len(body) else 0
            j += body[j] == "]" if j < len(body) else 0
            while j < len(body) and body[j] != "]":
                j += 2 if body[j] == "\\" else 1
            j += 1
        elif ch == "(":
            depth, j = 0, i
            while j < len(body):
                if body[j] == "\\":
                    j += 2
                    continue
                depth += body[j] == "("
                depth -= body[j] == ")"
                j += 1
                if depth == 0:
                    break
        else:
            j = i + 1
        if j > len(body):
            return None
        q = _QUANTIFIER.match(body, j)
        k = q.end() if q else j
        out.append((body[i:j], body[j:k]))
        i = k
    return out


def _group_alternatives(body: str) -> list[str] | None:
    """The alternatives of a body that is one group `(a|b)` / `(?:a|b)` with a `|` at its top, else None."""
    atoms = _atoms(body)
    if atoms is None or len(atoms) != 1 or atoms[0][1] or not atoms[0][0].startswith("("):
        return None
    inner = atoms[0][0][3:-1] if atoms[0][0].startswith("(?:") else atoms[0][0][1:-1]
    if inner.startswith("?"):
        return None
    parts = _split_top(inner)
    return parts if len(parts) > 1 else None


def bounded_pattern(pattern: str, min_length: int, max_length: int | None) -> str | None:
    """A regex equal to `pattern` (anchored ^...$) restricted to lengths [min_length, max_length] with
    no length keywords needed, or None where this cannot be written simply."""
    if not (pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$")):
        return None
    if regex_problem(pattern) is not None:
        return None
    body = pattern[1:-1]
    if "[]" in body or "[^]" in body:
        return None  # an empty class in ECMA, a literal ] in Python: the parsers disagree
    alternatives = _group_alternatives(body)
    if alternatives is not None:
        big = max_length if max_length is not None else float("inf")
        kept = []
        for alternative in alternatives:
            width = _width(alternative)
            if width is None:
                return None
            if width[1] < min_length or width[0] > big:
                continue  # no string of this alternative has an allowed length
            bounded = bounded_pattern("^" + alternative + "$", min_length, max_length)
            if bounded is None:
                return None
            kept.append(bounded[1:-1])
        return "^(?:" + "|".join(kept) + ")$" if kept else None
    width = _width(pattern)
    atoms = _atoms(body)
    if width is None or atoms is None or "".join(a + q for a, q in atoms) != body:
        return None
    big = max_length if max_length is not None else float("inf")
    if width[0] >= min_length and width[1] <= big:
        return pattern  # the pattern implies the bounds
    widths = [_width(a + q) for a, q in atoms]
    if any(w is None for w in widths):
        return None
    varying = [i for i, w in enumerate(widths) if w[0] != w[1]]
    if len(varying) != 1:
        return None
    i = varying[0]
    atom, _ = atoms[i]
    if _width(atom) != (1, 1) or atom.startswith("("):
        return None
    fixed = sum(w[0] for j, w in enumerate(widths) if j != i)
    lo = max(widths[i][0], min_length - fixed)
    hi = widths[i][1] if widths[i][1] < 2**31 - 1 else None
    if max_length is not None:
        hi = max_length - fixed if hi is None else min(hi, max_length - fixed)
    if hi is not None and (hi < lo or hi < 0):
        return None  # no string fits: left to the refusal
    repeat = f"{{{lo},{'' if hi is None else hi}}}"
    return "^" + "".join(a + (repeat if j == i else q) for j, (a, q) in enumerate(atoms)) + "$"


def _split_top(regex: str) -> list[str]:
    """`regex` split at its top-level `|` (outside groups and classes)."""
    parts, depth, start, i, in_class = [], 0, 0, 0, False
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            parts.append(regex[start:i])
            start = i + 1
        i += 1
    parts.append(regex[start:])
    return parts


def anchored_alternation(pattern: str) -> str | None:
    """`^a$|(^b$)` -> `^(?:a|b)$` (and `^$|^b$` -> `^(?:b)?$`): alternatives each anchored at both ends,
    which xgrammar would otherwise read with the inner anchors dropped; None when not of that form."""
    alternatives = _split_top(pattern)
    if len(alternatives) < 2:
        return None
    inner = []
    for alternative in alternatives:
        atoms = _atoms(alternative)
        if atoms is not None and len(atoms) == 1 and not atoms[0][1] and alternative.startswith("(") \
                and not alternative.startswith("(?"):
            alternative = alternative[1:-1]  # one plain group around the whole alternative
        if not (alternative.startswith("^") and alternative.endswith("$") and not alternative.endswith("\\$")):
            return None
        body = alternative[1:-1]
        if "|" in _split_top(body)[0] or len(_split_top(body)) > 1 or regex_problem("^" + body + "$") is not None:
            return None
        inner.append(body)
    nonempty = [b for b in inner if b]
    if not nonempty:
        return "^$"
    group = "(?:" + "|".join(nonempty) + ")"
    return "^" + group + ("?" if len(nonempty) < len(inner) else "") + "$"


_UNSUPPORTED_ESCAPE = re.compile(r"\\(?:[1-9bBkAZzGQE]|[pP]\{)")
_REPEAT = re.compile(r"(?<!\\)\+")
_MISREAD_INSIDE = re.compile(r"\[\^|\\|\(")  # a negated class, an escape, a nested group


def _trailing_optional_repeat(regex: str) -> bool:
    r"""Whether an alternative of `regex` ends, after something else, in an optional group whose body
    repeats with "+" and holds a negated class, an escape or a group: xgrammar 0.2.8 reads those wrongly
    (measured: `^a(:[^\s]+)?$` and `^a(:\S+)?$` accept "a:", `^a(\.[0-9]+)?$` accepts "a1";
    JSONSchemaBench Github_medium o22092, Github_hard o58443's `(-x(-[a-zA-Z0-9]{1,8})+)?$`), while
    `^a(:[0-9]+)?$`, `^x(:a+)?$` and a group that is the whole regex (`^(?:(?:\S+\s+){0,9}\S+)?$`)
    are read right. A measured boundary, not a proof: what falls inside goes to llguidance."""
    for alternative in _split_top(regex):
        if alternative.endswith("$") and not alternative.endswith("\\$"):
            alternative = alternative[:-1]
        atoms = _atoms(alternative[1:] if alternative.startswith("^") else alternative)
        if not atoms or len(atoms) < 2:
            continue
        group, quantifier = atoms[-1]
        inner = group[3:-1] if group.startswith("(?:") else group[1:-1]
        if (group.startswith("(") and quantifier in ("?", "??") and _REPEAT.search(inner)
                and _MISREAD_INSIDE.search(inner)):
            return True
    return False


def regex_problem(regex: str) -> str | None:
    """Why xgrammar's regex would not match exactly what an ECMA regex matches, or None."""
    if "(?" in regex.replace("(?:", ""):
        return "lookaround and inline flags in regexes are ignored"
    if _UNSUPPORTED_ESCAPE.search(regex):
        return "backreferences, word boundaries and anchors other than ^ $ are not supported in regexes"
    if _trailing_optional_repeat(regex):
        return "an optional group with a repetition at the end of a regex is misread"
    # ^ and $ anywhere but the ends (alternatives of anchored branches) are dropped, changing the language
    in_class = False
    escaped = False
    for i, ch in enumerate(regex):
        if escaped:
            escaped = False
            continue
        if ch == "\\":
            escaped = True
        elif ch == "[":
            in_class = True
        elif ch == "]":
            in_class = False
        elif not in_class and ((ch == "^" and i > 0) or (ch == "$" and i < len(regex) - 1)):
            return "anchors inside a regex (not at its ends) are ignored"
    return None
