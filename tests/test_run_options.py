"""`run`'s options: declared in groups (cli/run_options.py), each group checked in one place (cli/run_args.py) before
torch is imported, messages naming the options as typed; old spellings still read; one placeholder style."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.cli.command import OTHER, panel_of, renamed_args
from llmtrace.cli.run_args import GROUPS
from llmtrace.cli.run_legacy import legacy_json_path
from llmtrace.cli.run_options import PANELS

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def _command(name: str) -> typer.main.TyperCommand:
    return typer.main.get_group(app).commands[name]


def test_each_option_is_in_the_group_that_checks_it() -> None:
    params = {p.name: p for p in _command("run").params if p.name != "help"}
    grouped = {f.name: group for group in GROUPS for f in fields(group)}
    assert set(params) == set(grouped)
    for name, param in params.items():
        if param.param_type_name == "option":
            assert panel_of(param) == grouped[name].PANEL, name
    assert [group.PANEL for group in GROUPS] == list(PANELS)


def test_help_lists_the_groups_in_order() -> None:
    result = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    headings = [line[:-1] for line in result.stdout.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings == ["Arguments", *PANELS, OTHER]
    assert "<int range>" not in result.stdout and "PATH" not in result.stdout.replace("--json PATH", "")


# (arguments after `run`, what stderr says): each refused by its group before torch is imported
REFUSED = [
    (["sky", "--top-k", "-1", "--temperature", "1"], "--top-k must be a whole number >= 0"),
    (["sky", "--top-k", "5"], "--top-k has no effect when --temperature is 0 (greedy)"),
    (["sky", "--min-p", "0.1", "--top-p", "0.5"], "--top-p and --min-p have no effect when --temperature is 0"),
    (["sky", "--temperature", "-1"], "--temperature must be >= 0"),
    (["sky", "--temperature", "1e-9"], "--temperature must be 0 (greedy) or at least 1e-06"),
    (["sky", "--top-p", "0", "--temperature", "1"], "--top-p must be in (0, 1]"),
    (["sky", "--min-p", "1", "--temperature", "1"], "--min-p must be in [0, 1)"),
    (["sky", "--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["sky", "--seed", "-1", "--temperature", "1"], "--seed must be a whole number in [0, 2**64)"),
    (["sky", "-n", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["sky", "--prompt-len", "0"], "--prompt-len must be at least 1, got 0"),
    (["sky", "--batch", "0"], "--batch must be at least 1, got 0"),
    (["sky", "--device", "gpu"], "--device must be cpu, cuda, cuda:N or mps, got 'gpu'"),
    (["sky", "--temperatures", "0.1,x"], "--temperatures takes numbers separated by commas"),
    (["sky", "--temperatures", "0,1"], "--temperatures values must be finite and > 0"),
    (["sky", "--attention-steps", "a"], "--attention-steps takes step numbers >= 0"),
    (["sky", "--trace-steps", "often"], "--trace-steps: 'often' is not first, last, every:K"),
    (["sky", "--repeat", "0"], "--repeat must be at least 1, got 0"),
    (["sky", "--threads", "100000"], "--threads must be between 1 and the"),
    (["sky", "--batch-sweep", "4,2"], "--batch-sweep takes increasing batch sizes"),
    (["sky", "--tp", "0"], "--tp must be at least 1, got 0"),
    (["sky", "--tp", "2", "--tp-timeout", "0.1"], "--tp-timeout must be at least 0.5 seconds"),
    (["sky", "--json", "--summary-json"], "--json and --summary-json both write to stdout"),
    (["--dry-run", "--lens"], "--no-kv-cache, --lens and --attention look at a real generation; drop --dry-run"),
    (["--dry-run", "--html", "x.html"], "--html reports a real generation; drop --dry-run"),
    (["--dry-run", "--repeat", "2"], "--repeat times real runs; drop --dry-run"),
    (["sky", "--batch-sweep", "1,2", "--staged"], "--batch-sweep times batched decode steps on its own; drop --staged"),
    (["sky", "--batch-sweep", "1,2", "--temperature", "1"], "--batch-sweep decodes greedily"),
    (["sky", "--tp", "2", "--lens"], "--tp runs one sequence's generation over its ranks"),
    (["sky", "--tune", "--tp", "2"], "--tune times this machine for a real run on one device"),
    (["sky", "--batch", "2", "--lens"], "--batch does not combine with --lens"),
    (["sky", "--json-file", "/no/such/folder/t.json"], "cannot write /no/such/folder/t.json: no folder"),
]

# Runs every case in one fresh interpreter through the console entry's main(), then says whether torch was imported.
_SCRIPT = """
import contextlib, io, json, sys
from llmtrace.cli.app import main
results = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(["run", *args])
            code = 0
        except SystemExit as exc:
            code = exc.code
    results.append([code, err.getvalue()])
print(json.dumps({"results": results, "torch": "torch" in sys.modules}))
"""


def _refused_in_a_fresh_process(cases: list[list[str]], prelude: str = "") -> dict:
    env = {**os.environ, "LLMTRACE_DEBUG": ""}  # llmtrace imported as the test process imports it
    proc = subprocess.run([sys.executable, "-c", prelude + _SCRIPT, json.dumps(cases)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_bad_values_are_refused_by_name_before_torch_is_imported() -> None:
    report = _refused_in_a_fresh_process([args for args, _ in REFUSED])
    for (args, message), (code, stderr) in zip(REFUSED, report["results"]):
        assert code == 2, (args, stderr)
        assert stderr.count("\n") == 1 and stderr.startswith("llmtrace: error: "), (args, stderr)
        assert message in stderr, (args, stderr)
    assert report["torch"] is False


def test_html_without_matplotlib_is_refused_before_the_model_runs(tmp_path: Path) -> None:
    # sys.modules[name] = None is how Python spells "cannot be imported": find_spec answers None, import raises
    report = _refused_in_a_fresh_process([["sky", "--html", str(tmp_path / "r.html")]],
                                         prelude="import sys\nsys.modules['matplotlib'] = None\n")
    [(code, stderr)] = report["results"]
    assert code == 2 and stderr.count("\n") == 1
    assert "--html draws its figures with matplotlib, which is not installed" in stderr
    assert "pip install 'llmtrace[html]'" in stderr
    assert report["torch"] is False and not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("args, expected", [
    (["sky", "--json", "t.json"], ["sky", "--json-file", "t.json"]),
    (["sky", "--json", "out/T.JSON.GZ", "-n", "2"], ["sky", "--json-file", "out/T.JSON.GZ", "-n", "2"]),
    (["sky", "--json=t.json"], ["sky", "--json-file", "t.json"]),
    (["sky", "--json", "-"], ["sky", "--json"]),
    (["--json", "sky"], ["--json", "sky"]),  # a prompt after the flag stays the prompt
    (["--json", "--chat", "sky"], ["--json", "--chat", "sky"]),
    (["sky", "--", "--json", "t.json"], ["sky", "--", "--json", "t.json"]),
])
def test_old_json_path_spelling_is_still_read(args: list[str], expected: list[str]) -> None:
    assert legacy_json_path(args) == expected


def test_renamed_options_are_still_read() -> None:
    assert renamed_args(["-p", "4", "--prompt-tokens", "8", "--prompt-tokens=9", "--", "--prompt-tokens"],
                        {"--prompt-tokens": "--prompt-len"}) == \
        ["-p", "4", "--prompt-len", "8", "--prompt-len=9", "--", "--prompt-tokens"]
    for command in ("flops", "roofline"):
        new = runner.invoke(app, [command, "--max-new-tokens", "7", "--json"])
        old = runner.invoke(app, [command, "--new-tokens", "7", "--json"])
        short = runner.invoke(app, [command, "-n", "7", "--json"])
        assert new.exit_code == old.exit_code == short.exit_code == 0, old.output
        assert new.stdout == old.stdout == short.stdout
        assert "--new-tokens" not in runner.invoke(app, [command, "--help"]).stdout  # hidden


def test_every_command_writes_placeholders_one_way() -> None:
    from typer.main import get_group

    group = get_group(app)
    for name, command in group.commands.items():
        ctx = command.make_context(name, ["--help"], resilient_parsing=True)
        for param in command.params:
            if param.param_type_name != "option" or getattr(param, "is_flag", False) or param.hidden:
                continue
            metavar = param.make_metavar(ctx)
            assert metavar.startswith("<") and metavar.endswith(">") and metavar == metavar.lower() \
                and "range" not in metavar, f"{name} {param.opts}: {metavar}"
