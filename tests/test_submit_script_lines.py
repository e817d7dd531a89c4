"""launch/submit.py: no command-line value can add a line to the sbatch script.

Every value the CLI copies into the script (the #SBATCH directives, the exports, the run directory, the training
overrides) is either refused with exit 2 naming its flag, or the script keeps exactly the lines it has for a plain
value. A newline in --partition used to become an `#SBATCH --uid=0` directive or a shell line, and ended Slurm's
directive parsing, so --time, --output and --chdir were dropped.

    .venv/bin/python -m pytest -q tests/test_submit_script_lines.py
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBMIT = os.path.join(REPO, "launch", "submit.py")
PLAIN = "plain0"
BASE = ["--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu", "--time", "1:00:00", "--job-name", "t"]

#: the flags whose values reach the script, each with how a value is given there (FLAG=VALUE keeps argparse from
#: reading a value that starts with '-' as a flag; None: after `--`, as a training override)
FLAGS = [
    "--partition",
    "--account",
    "--run-dir",
    "--job-name",
    "--time",
    "--nccl-socket-ifname",
    "--gloo-socket-ifname",
    "--nccl-ib-hca",
    "--nccl-net-gdr-level",
    "--env",
    None,
]
#: characters that break lines somewhere (bash: \n; Python's splitlines and editors: the rest), quotes, shell syntax
NASTY = ["\n", "\r", "\x00", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\t", " ", "'",
         '"', "\\", "$", "`", ";", "&", "|", "#", "%", "(", ")", "{", "}", "*", "=", "-", "/", ".", "..", "é", "\ufeff",
         "\x7f", "\x1b", "#SBATCH --uid=0", "touch /tmp/owned", "$(id)"]  # fmt: skip


sys.path.insert(0, os.path.join(REPO, "launch"))
import submit  # noqa: E402 - launch/ is a folder of scripts, imported as test_submit.py imports it


def _argv(flag: str | None, value: str) -> list[str]:
    """The command line with `value` given to `flag` (the placeholder elsewhere)."""
    if flag is None:
        return [*BASE, "--", f"trainer.run_dir=/tmp/r/{value}"]
    if flag == "--env":
        return [*BASE, f"--env=KEY_{PLAIN}={value}"]
    if flag in ("--partition", "--job-name", "--time"):
        rest = list(BASE)
        rest[rest.index(flag) + 1] = value
        return [*rest[: rest.index(flag)], f"{flag}={value}", *rest[rest.index(flag) + 2 :]]
    return [*BASE, f"{flag}={value}"]


def _script(argv: list[str]) -> str | int:
    """The script launch/submit.py would write for argv, or the exit code it refuses argv with."""
    try:
        args, overrides = submit.parse(argv)
        run_dir = submit.script_run_dir(args, "runs/x")
        submit.check_script_values(args, overrides, run_dir)
        return submit.render_script(args, overrides, run_dir)
    except submit.SubmitError as err:
        return err.code
    except SystemExit as err:  # argparse's usage errors
        return int(err.code)


def _expected(flag: str | None) -> str:
    value = "1:00:00" if flag == "--time" else PLAIN
    text = _script(_argv(flag, value))
    assert isinstance(text, str), f"the plain value {value!r} for {flag} was refused"
    return text


def _check(flag: str | None, value: str, expected: str) -> None:
    got = _script(_argv(flag, value))
    if isinstance(got, int):
        assert got == 2, f"{flag} {value!r}: refused with exit {got}, expected 2"
        return
    for split in (lambda t: t.split("\n"), str.splitlines):  # bash's lines, and every other reader's
        want, have = split(expected), split(got)
        assert len(have) == len(want), f"{flag} {value!r} changed the script's line count: {len(want)} -> {len(have)}"
    want_lines, have_lines = expected.split("\n"), got.split("\n")
    for want, have in zip(want_lines, have_lines):
        if want.startswith("#SBATCH") or have.startswith("#SBATCH"):
            # the same directive, in the same place: one value per line, nothing after it
            assert want.split("=", 1)[0] == have.split("=", 1)[0], f"{flag} {value!r}: {have!r} for {want!r}"
            assert len(have.split()) == 2, f"{flag} {value!r}: the directive {have!r} holds more than one word"
        elif PLAIN not in want and "1:00:00" not in want:
            assert want == have, f"{flag} {value!r} changed a line that does not hold it: {have!r}"


@pytest.mark.parametrize("flag", FLAGS, ids=[f or "override" for f in FLAGS])
def test_no_value_adds_a_line_to_the_script(flag: str | None) -> None:
    expected = _expected(flag)
    rng = random.Random(f"sbatch-lines {flag}")  # seeded: the same strings on every run
    values = [PLAIN + piece + "x" for piece in NASTY] + [piece for piece in NASTY]
    for _ in range(300):
        values.append("".join(rng.choice(NASTY + ["a", "b", "0", "_"]) for _ in range(rng.randint(1, 6))))
    for value in values:
        _check(flag, value, expected)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--partition", "gpu\n#SBATCH --uid=0"),
        ("--account", "acct\ntouch /tmp/owned"),
        ("--run-dir", "/tmp/run\nrm -rf $HOME/x"),
        ("--partition", "gpu\u2028x"),
    ],
)
def test_a_line_break_in_a_flag_is_refused_by_the_cli(flag: str, value: str, tmp_path) -> None:
    """The real CLI, as a user runs it: exit 2 naming the flag, and no script printed or written."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + "/usr/bin:/bin")
    res = subprocess.run(
        [sys.executable, SUBMIT, *BASE[:4], "--partition", "gpu", "--time", "5", "--job-name", "t", "--dry-run",
         f"{flag}={value}", "--", "trainer.runtime=cpu"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert flag in res.stderr and "#!/bin/bash" not in res.stdout
