"""The command line: instant help, one-line errors for bad options, python -m equivalence."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dflash_pipeline.cli import app

runner = CliRunner()


def test_cli_import_is_light():
    code = "import sys, dflash_pipeline.cli; bad = [m for m in ('torch', 'transformers', 'zarr') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_python_m_is_the_console_script():
    res = subprocess.run([sys.executable, "-m", "dflash_pipeline", "--help"], capture_output=True, text=True)
    assert res.returncode == 0
    for cmd in ("extract", "train", "export", "eval", "store"):
        assert cmd in res.stdout


def test_dflash_command_in_the_environment_is_ours():
    """The DFlash authors' package (a test dependency) also installs a `dflash` command; the one in
    this environment must be ours, as the README tells users to type it."""
    from pathlib import Path

    script = Path(sys.executable).parent / "dflash"
    if not script.exists():
        pytest.skip("no dflash command next to this interpreter (package not installed as a script)")
    res = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-500:]
    for cmd in ("extract", "train", "export", "eval", "store"):
        assert cmd in res.stdout


@pytest.mark.parametrize("args, needle", [
    (["train", "--store", "s", "--out", "o", "--epochs", "1", "--steps", "3"], "--epochs or --steps, not both"),
    (["train", "--store", "s", "--out", "o", "--tokens-per-batch", "1000", "--max-length", "300"], "must be a multiple"),
    (["train", "--store", "s", "--out", "o", "--swa-layers", "0,x", "--sliding-window", "4"], "comma-separated integers"),
    (["train", "--store", "s", "--out", "o", "--checkpoint-layers", "some"], "--checkpoint-layers takes 'auto' or an integer"),
    (["train", "--store", "s", "--out", "o", "--checkpoint-layers", "-1"], "--checkpoint-layers must be >= 0"),
    (["extract", "--out", "o", "--codec", "zip"], "--codec must be one of bf16, fp8"),
    (["extract", "--out", "o", "--gpus", "two"], "--gpus must be 'all' or a positive number"),
    (["train", "--store", "s", "--out", "o", "--gpus", "two"], "--gpus must be 'all' or a positive number"),
    (["eval", "--drafter", "d", "--gpus", "0"], "--gpus must be 'all' or a positive number"),
    (["extract", "--out", "o", "--chat-template-kwargs", "enable_thinking=false"], "must be a JSON object"),
    (["extract", "--out", "o", "--chat-template-kwargs", '{"tokenize": true}'], "tokenize cannot be set here"),
    (["eval", "--drafter", "d", "--chat-template-kwargs", "[false]"], "must be a JSON object, got a JSON list"),
    (["eval", "--drafter", "nowhere", "--temperature", "-1"], "temperature"),
    (["store", "verify", "x", "--drop-corrupt"], "--drop-corrupt only acts together with --repair"),
])
def test_bad_options_are_one_line(args, needle):
    res = runner.invoke(app, args)
    assert res.exit_code == 2
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr
