"""`align VERB --help` explains every argument, with its default where it has one (issue 36)."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from align.cli import VERBS, build_parser


def verb_parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_verb_is_in_the_parser() -> None:
    assert set(verb_parsers()) == set(VERBS)


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_argument_has_help_and_its_default(verb: str) -> None:
    parser = verb_parsers()[verb]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help is not argparse.SUPPRESS and action.help.strip(), \
            f"align {verb}: {name} has no help text"
        default = action.default
        if default in (None, False, [], argparse.SUPPRESS) or action.required:
            continue
        assert "default" in action.help, f"align {verb}: {name} does not say its default ({default!r})"


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_help_prints(verb: str) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([verb, "--help"])
    assert exit_.value.code == 0
    text = out.getvalue()
    assert f"align {verb}" in text and "%(default)" not in text


def test_report_mapping_help_says_the_preset_is_detected() -> None:
    mapping = next(a for a in verb_parsers()["report"]._actions if a.dest == "mapping")
    assert "detected" in mapping.help
