"""Fast checks of ``shuffledp deploy``: argument validation, the files it writes, the timing breakdown and the
README's documented command (no Flower processes here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shuffledp.deploy import deploy_cli

README = Path(__file__).resolve().parents[2] / "deploy" / "README.md"


def test_readme_local_section_starts_with_the_command() -> None:
    text = README.read_text()
    section = text.split("## Local TLS deployment", 1)[1]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S)
    assert block is not None
    command = block.group(1).strip()
    assert command == "shuffledp deploy local --nodes 3 --rounds 2"
    args = deploy_cli.parser().parse_args(command.split()[2:])
    assert (args.action, args.nodes, args.rounds) == ("local", 3, 2)


def test_readme_sections_exist() -> None:
    text = README.read_text()
    for heading in ("## Running the server side", "## Enrolling and starting a device", "## Rotating keys",
                    "## Simulation across several machines on a Ray cluster", "### ARM devices",
                    "## Keys and who keeps them"):
        assert heading in text, heading


@pytest.mark.parametrize(
    "argv, message",
    [
        (["deploy", "keys", "--out", "X", "--nodes", "0"], "--nodes must be an integer in [1, "),
        (["deploy", "local", "--nodes", "3", "--min-reports", "4"], "--min-reports must be an integer in [1, 3]"),
        (["deploy", "local", "--eps0", "-1"], "--eps0 must be a finite number > 0"),
        (["deploy", "local", "--clip-l1", "nan"], "--clip-l1 must be a finite number > 0"),
        (["deploy", "local", "--rounds", "0"], "--rounds must be an integer in [1, "),
    ],
)
def test_bad_arguments_are_refused_with_a_reason(argv: list[str], message: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a if a != "X" else str(tmp_path / "k") for a in argv]
    assert deploy_cli.main(argv) == 2  # a usage error, as argparse's own; a failed run exits 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "k").exists()  # nothing written for a refused command


def test_an_output_that_exists_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing is overwritten: an --out that already holds files is refused with exit 2 (a wrong parameter), not
    1 (a failure), and left as it was."""
    used = tmp_path / "used"
    used.mkdir()
    (used / "mine").write_text("keep")
    assert deploy_cli.main(["deploy", "keys", "--out", str(used), "--nodes", "2"]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in used.iterdir()] == ["mine"] and (used / "mine").read_text() == "keep"


def test_every_deploy_command_in_the_readme_parses() -> None:
    import shlex

    commands, inside = [], False
    for line in README.read_text().splitlines():
        if line.strip().startswith("```"):
            inside = not inside
        elif inside and line.strip().startswith("shuffledp deploy"):
            commands.append(line.split("#")[0].strip())
    assert len(commands) >= 4
    parser = deploy_cli.parser()
    for command in commands:
        argv = shlex.split(command.replace("$", ""))[2:]
        try:
            parser.parse_args(argv)
        except SystemExit as exc:  # argparse reports the bad flag on stderr
            raise AssertionError(f"README command does not parse: {command}") from exc


