"""llama-server's two line rules for code completion, token by token as its ``process_token`` runs them.

* ``n_indent``: once a line has started, a line indented by fewer than ``n_indent`` spaces or tabs
  ends the generation, and the whole answer drops that line after its indentation (the streamed
  text keeps it: llama-server streams each token before it looks);
* ``t_max_predict_ms``: a token whose text holds a newline ends the generation once generating
  (since the first token) took longer than that.

Both see the text each token released, in UTF-8 bytes as llama-server counts it. Pure Python;
the work per token is bounded by the token's own text (a line is scanned once, whatever its length).

>>> rules = LineRules(n_indent=4)
>>> [rules.push(t, 0.0) for t in ["def f():\\n", "    x = 1\\n", "y"]]
[None, None, None]
>>> rules.push(" = 2", 0.0)  # the line "y = 2" is indented by 0 < 4: it is dropped
5
"""

from __future__ import annotations

import re

_BLANKS = re.compile(rb"[ \t]*")


class LineRules:
    """One generation's n_indent and t_max_predict_ms (0: off), fed one token's text at a time."""

    def __init__(self, n_indent: int = 0, t_max_predict_ms: float = 0) -> None:
        self.n_indent = n_indent
        self.t_max_predict_ms = t_max_predict_ms
        self.has_new_line = False  # llama-server's has_new_line: a released text held a newline
        self._text = bytearray()  # the text so far (kept only for n_indent)
        self._line = 0  # llama-server's last_nl_pos: where the line being checked starts
        self._blank_to = 0  # the line at _line holds only spaces and tabs up to here
        self._passed = -1  # the line at _line already passed the check (its indentation is final)

    @property
    def active(self) -> bool:
        return self.n_indent > 0 or self.t_max_predict_ms > 0

    def push(self, text: str, t_gen_ms: float) -> int | None:
        """One token's released text and the milliseconds generating has taken. None to go on; when a
        rule ends the generation, the number of characters at the end of the text so far (this
        token's included) that the whole answer drops (0 for the time limit)."""
        cut = None
        if self.n_indent > 0:
            self._text += text.encode("utf-8", errors="surrogatepass")
            if self.has_new_line:  # llama-server looks only once a line was started before this token
                cut = self._check_indent()
                self._next_line()
        if "\n" in text:
            self.has_new_line = True
            if cut is None and 0 < self.t_max_predict_ms < t_gen_ms:
                cut = 0
        return cut

    def _check_indent(self) -> int | None:
        start = self._line
        if start == 0 or self._passed == start:  # llama-server checks from the first line it found
            return None
        end = _BLANKS.match(self._text, max(start, self._blank_to)).end()
        self._blank_to = end
        if end == len(self._text):  # only blanks so far: the indentation may still grow
            return None
        if end - start < self.n_indent:
            return len(self._text[end:].decode("utf-8", errors="replace"))
        self._passed = start
        return None

    def _next_line(self) -> None:
        """llama-server moves to the first newline at or after the line it checked (one per token)."""
        at = self._text.find(b"\n", self._line)
        if at >= 0:
            self._line = at + 1
