"""llama-server's line rules for code completion (speculative/line_rules.py), token by token as its
process_token runs them; the same outputs are compared with llama-server itself in
test_llama_server_parity.py."""

from __future__ import annotations

import pytest

from pyllama_spec.speculative.line_rules import LineRules


def _run(tokens: list[str], n_indent: int = 0, t_max_predict_ms: float = 0, ms_per_token: float = 0.0):
    """The answer llama-server keeps, the tokens it took, and whether a rule ended it."""
    rules, text = LineRules(n_indent, t_max_predict_ms), ""
    for k, token in enumerate(tokens):
        text += token
        cut = rules.push(token, (k + 1) * ms_per_token)
        if cut is not None:
            return text[:len(text) - cut], k + 1, True
    return text, len(tokens), False


def test_no_rule_keeps_everything():
    assert _run(["a\n", "  b\n", "c"]) == ("a\n  b\nc", 3, False)


def test_a_line_indented_less_than_n_indent_is_dropped_after_its_indentation():
    # the check lags a token behind the newline (llama-server looks once a line was started before)
    assert _run(["x\n", "    y = 1\n", "  z", "\n", "w"], n_indent=4) == ("x\n    y = 1\n  ", 4, True)


def test_a_line_indented_enough_passes():
    assert _run(["x\n", "    y\n", "    z\n", "    w"], n_indent=4) == ("x\n    y\n    z\n    w", 4, False)


def test_the_first_line_is_never_checked():
    assert _run(["abc", "def", "\n"], n_indent=8) == ("abcdef\n", 3, False)


def test_tabs_count_as_indentation_and_a_blank_line_counts_as_a_line():
    assert _run(["a\n", "\t\tb\n", "\t\tc\n", "\t\n", "x"], n_indent=2) == ("a\n\t\tb\n\t\tc\n\t", 5, True)


def test_a_cut_can_reach_back_into_earlier_tokens():
    # the line "  y" arrived in one token: llama-server drops it at the next, with that token's text
    assert _run(["a\n", "b\n", "  y", "z"], n_indent=4) == ("a\n", 3, True)


def test_the_time_limit_ends_at_a_newline_only():
    tokens = ["a", "b", "c\n", "d", "e\n", "f"]
    assert _run(tokens, t_max_predict_ms=4, ms_per_token=1.0) == ("abc\nde\n", 5, True)
    assert _run(tokens, t_max_predict_ms=100, ms_per_token=1.0) == ("abc\nde\nf", 6, False)


@pytest.mark.parametrize("n", [1_000, 8_000])
def test_one_long_line_is_scanned_once(n, monkeypatch):
    """A line of blanks a token at a time costs its length, not its length squared: every scan
    starts where the last one stopped."""
    from pyllama_spec.speculative import line_rules

    scanned = []

    class Counting:
        def match(self, text, pos):
            m = line_rules.re.compile(rb"[ \t]*").match(text, pos)
            scanned.append(m.end() - pos)
            return m

    monkeypatch.setattr(line_rules, "_BLANKS", Counting())
    rules = LineRules(n_indent=4)
    for token in ["x\n", "    y\n", *[" "] * n]:
        assert rules.push(token, 0) is None
    assert sum(scanned) <= n + 8
