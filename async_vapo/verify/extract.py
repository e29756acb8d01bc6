"""Pull the final answer out of a model response.

The answer is the content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) in the response.
"Last" means the box whose opening comes last, so for ``\\boxed{\\boxed{1}}`` the answer is ``1``;
this matches the ``last_boxed_only_string`` convention of the MATH benchmark graders, except that an
unclosed box at the end does not hide an earlier complete one.

Invariants:
- One left-to-right pass over at most ``max_chars`` characters: time and memory are linear in the
  window, whatever the input (no regex with nested quantifiers, no rescans per candidate box).
- Only the last ``max_chars`` characters are read. Models put their final answer at the end, and a
  fixed window bounds the work; a box that opens before the window is not seen.
- Brace matching follows TeX: ``\\{`` and ``\\}`` are literal braces and do not open or close a group,
  ``\\\\`` (a line break) is skipped so that ``\\\\{`` still opens one.
"""

from __future__ import annotations

import re

__all__ = ["ANSWER_LINE_WINDOW", "extract_answer_line", "extract_boxed"]

# Alternation of fixed tokens; the only quantifier is \s* right before a literal "{", so a failed
# match costs one pass over that whitespace run and the scan stays linear.
_TOKEN = re.compile(r"\\\\|\\(?:boxed|fbox)\s*\{|\\[{}]|[{}]")


def extract_boxed(text: str, max_chars: int = 10_000) -> str | None:
    """Return the content of the last complete ``\\boxed{...}``/``\\fbox{...}`` in ``text``.

    Only the last ``max_chars`` characters of ``text`` are scanned. Returns ``None`` when that window
    holds no complete box. The content is returned as written (not stripped, not normalized).
    """
    if max_chars <= 0:
        return None
    window = text[-max_chars:]
    # Each entry is the content start of an open group, or -1 for a plain "{" group.
    open_groups: list[int] = []
    best_start = -1
    best: tuple[int, int] | None = None
    for match in _TOKEN.finditer(window):
        token = match.group()
        if token[0] == "\\" and len(token) == 2:
            continue  # \\ or \{ or \}: never a group delimiter
        if token == "{":
            open_groups.append(-1)
        elif token == "}":
            if not open_groups:
                continue  # stray closing brace
            content_start = open_groups.pop()
            if content_start >= 0 and content_start > best_start:
                best_start = content_start
                best = (content_start, match.start())
        else:
            open_groups.append(match.end())
    if best is None:
        return None
    return window[best[0] : best[1]]


ANSWER_LINE_WINDOW = 300
"""Characters at the end of a response that DAPO's reward reads for its ``Answer:`` line."""
_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")


def extract_answer_line(text: str, window: int = ANSWER_LINE_WINDOW) -> str | None:
    """The rest of the line after the last ``Answer:`` (any case) in the last ``window`` characters, as DAPO's
    reward function reads it (its prompt asks for "Answer: $Answer" as the last line); None when there is
    none. The regex has one bounded quantifier per match, so the scan is linear in the window."""
    matches = _ANSWER_LINE.findall(text[-window:]) if window > 0 else []
    return matches[-1] if matches else None
