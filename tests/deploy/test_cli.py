"""The ``shuffledp`` dispatcher: version, a mistyped command, and help text for every option of every command."""

from __future__ import annotations

import argparse

import pytest

from shuffledp.deploy import cli

#: Every command path whose parser is checked (sub-commands of a parser are walked too).
COMMANDS = [["account"], ["ledger"], ["keys"], ["shuffler"], ["run"], ["resume", "x"], ["deploy"], ["audit"]]


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"shuffledp {cli.version()}\n"
    assert cli.version()[0].isdigit()
    assert cli.main(["--help"]) == 0 and "commands:" in capsys.readouterr().out


def test_a_mistyped_command_gets_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["rnu"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'rnu'; did you mean 'run'?" in err and "account, ledger" in err
    assert cli.main(["zzzzzz"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def _parsers(command: list[str], monkeypatch: pytest.MonkeyPatch) -> list[argparse.ArgumentParser]:
    """The parser ``shuffledp <command> --help`` builds, and every parser below it."""
    seen: list[argparse.ArgumentParser] = []

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        seen.append(self)
        raise SystemExit(0)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        m.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        try:
            cli.main([*command, "--help"])
        except SystemExit:
            pass
    found, todo = [], list(seen[:1])
    while todo:
        parser = todo.pop()
        found.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return found


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_every_option_has_help(command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    parsers = _parsers(command, monkeypatch)
    assert parsers, f"shuffledp {' '.join(command)} built no parser"
    missing = [f"{p.prog}: {'/'.join(a.option_strings) or a.dest}" for p in parsers for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not (a.help or "").strip()]
    assert missing == []
    leftovers = [p.prog for p in parsers if "``" in (p.description or "") or ":func:" in (p.description or "")]
    assert leftovers == []
