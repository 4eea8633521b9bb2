"""Every `--json` output names its schema, the schema is a file shipped with the package (pyproject's package-data),
and the real output of each command validates against it; the record-made schema files equal what the records give
(tests/record_schema.py; regenerate with LLMTRACE_UPDATE_SCHEMAS=1); help texts point to README sections that
exist."""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from record_schema import record_schema
from typer.testing import CliRunner

from llmtrace.cli.app import app
from llmtrace.tracer.core.json_schemas import SCHEMA_FILES, load_schema, registry, schema_path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
UPDATE = os.environ.get("LLMTRACE_UPDATE_SCHEMAS") == "1"
runner = CliRunner()


def _records() -> dict[str, tuple[type, str, str]]:
    """id -> (record, title, description) of the schema files made from records."""
    from llmtrace.tracer.analytic.catalog import ModelsReport
    from llmtrace.tracer.analytic.flops_report import FlopsReport
    from llmtrace.tracer.analytic.kvmem import KVMemReport
    from llmtrace.tracer.hardware.listing import HardwareListing
    from llmtrace.tracer.hardware.measure import MeasureReport
    from llmtrace.tracer.roofline.analysis import RooflineReport
    from llmtrace.tracer.trace.diff import TraceDiff

    return {
        "llmtrace.flops/2": (FlopsReport, "llmtrace flops --json", "FLOPs, bytes and parameters of a model's prefill, "
                             "decode step and generation (llmtrace.tracer.analytic.flops_report.FlopsReport as "
                             "asdict); FLOP and byte figures are integers (FLOPs, never MACs), ratios floats."),
        "llmtrace.kvmem/1": (KVMemReport, "llmtrace kvmem --json", "The KV cache's size by formula, over context "
                             "lengths and against a memory budget (llmtrace.tracer.analytic.kvmem.KVMemReport as "
                             "asdict); bytes are integers."),
        "llmtrace.models/1": (ModelsReport, "llmtrace models --json", "Every preset's shape, parameters, weight bytes "
                              "and KV bytes per position (llmtrace.tracer.analytic.catalog.ModelsReport as asdict)."),
        "llmtrace.roofline/1": (RooflineReport, "llmtrace roofline --json", "A model's prefill and decode against a "
                                "machine's compute and memory ceilings (llmtrace.tracer.roofline.analysis."
                                "RooflineReport as asdict): seconds, FLOP/s and bytes/s as numbers, FLOPs and bytes as "
                                "integers."),
        "llmtrace.hardware/1": (HardwareListing, "llmtrace hardware --json", "Every hardware profile with its ridge "
                                "points (llmtrace.tracer.hardware.listing.HardwareListing as asdict): FLOP/s and "
                                "bytes/s as numbers (decimal), memory in bytes; null = no peak for that dtype."),
        "llmtrace.hardware-measure/1": (MeasureReport, "llmtrace hardware --measure --json", "This machine measured "
                                        "(llmtrace.tracer.hardware.measure.MeasureReport as asdict): the profile it "
                                        "gives, every timing in seconds, and where it was saved (null: not saved, "
                                        "not_saved says why)."),
        "llmtrace.diff/1": (TraceDiff, "llmtrace diff --json", "Two saved traces side by side (llmtrace.tracer.trace."
                            "diff.TraceDiff as asdict): per-step figures of each phase and stage role, ratios B/A "
                            "(null where A is zero or a side lacks the row)."),
    }


@pytest.mark.parametrize("schema", ["llmtrace.flops/2", "llmtrace.kvmem/1", "llmtrace.models/1", "llmtrace.roofline/1",
                                    "llmtrace.hardware/1", "llmtrace.hardware-measure/1", "llmtrace.diff/1"])
def test_record_schema_files_equal_what_the_records_give(schema: str) -> None:
    record, title, description = _records()[schema]
    made = json.dumps(record_schema(record, schema, title, description), indent=1, ensure_ascii=False) + "\n"
    path = schema_path(schema)
    if UPDATE:
        path.write_text(made, encoding="utf-8")
    assert path.read_text(encoding="utf-8") == made, (
        f"{path.name} differs from {record.__name__}'s fields; if the change is intended, regenerate it with "
        "LLMTRACE_UPDATE_SCHEMAS=1, review the diff and bump the schema's version when a field was renamed or removed")


def test_every_schema_is_a_valid_schema_shipped_as_package_data() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    shipped = {f"{package.removeprefix('llmtrace.tracer.').replace('.', '/')}/{name}"
               for package, names in data["tool"]["setuptools"]["package-data"].items()
               if package.startswith("llmtrace.tracer.") for name in names}
    for schema, file in SCHEMA_FILES.items():
        document = load_schema(schema)
        jsonschema.Draft202012Validator.check_schema(document)
        assert file in shipped, f"{file} is not in pyproject's package-data"
        if schema != "llmtrace.trace":  # the trace's $id carries its schema_version
            assert document["$id"] == schema


def _validate(document: dict[str, Any]) -> None:
    """`document` against the schema its own "schema" field names (the registry resolves cross-file $refs)."""
    schema = load_schema(document["schema"])
    jsonschema.Draft202012Validator(schema, registry=registry()).validate(document)


def _json(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert list(document)[0] == "schema", "the schema's id comes first"
    _validate(document)
    return document


@pytest.mark.parametrize("args", [
    ["flops"], ["flops", "--model", "llama3-8b", "--dtype", "int4"], ["kvmem", "--model", "llama3-8b", "--budget",
                                                                      "24GiB"],
    ["models"], ["roofline"], ["roofline", "--model", "llama2-70b", "--hardware", "h100-sxm", "--tp", "4"],
    ["roofline", "--model", "llama3-8b", "--hardware", "rtx-4090", "--dtype", "int4", "--kernels", "eager"],
])
def test_analytical_json_names_and_matches_its_schema(args: list[str], tmp_path: Path) -> None:
    document = _json([*args, "--json"], env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert document["schema"] == {"flops": "llmtrace.flops/2", "kvmem": "llmtrace.kvmem/1",
                                  "models": "llmtrace.models/1", "roofline": "llmtrace.roofline/1"}[args[0]]


def test_hardware_json_lists_every_profile_against_its_schema(tmp_path: Path) -> None:
    from llmtrace.tracer.hardware.profiles import PROFILES

    document = _json(["hardware", "--json"], env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert document["schema"] == "llmtrace.hardware/1"
    assert [p["name"] for p in document["profiles"]] == list(PROFILES)
    a100 = document["profiles"][0]
    assert a100["ridge_point"]["bf16"] == pytest.approx(312e12 / 2039e9)
    assert document["store"] == str(tmp_path / "llmtrace" / "hardware.json")


def test_hardware_measure_json_and_the_listing_after_it(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    document = _json(["hardware", "--measure", "--dtypes", "fp32", "--repeats", "1", "--max-n", "128",
                      "--copy-mib", "1", "--json"], env=env)
    assert document["schema"] == "llmtrace.hardware-measure/1"
    assert document["saved_to"] == str(tmp_path / "llmtrace" / "hardware.json") and document["not_saved"] == ""
    assert document["profile"]["fp32"] == document["measurement"]["gemms"][0]["flops_per_s"] > 0
    listed = _json(["hardware", "--json"], env=env)["profiles"]
    assert listed[-1]["name"] == "this-machine" and listed[-1]["fp32"] == document["profile"]["fp32"]


def test_diff_json_names_and_matches_its_schema() -> None:
    trace = str(GOLDEN / "tiny_trace.json")
    document = _json(["diff", trace, str(GOLDEN / "tiny_batch_trace.json"), "--json"])
    assert document["schema"] == "llmtrace.diff/1" and document["same_model"] is True
    assert {row["phase"] for row in document["rows"]} == {"prefill", "decode"}
    assert _json(["diff", trace, trace, "--json"])["divergence"]["index"] is None


def test_the_summary_line_names_its_schema_and_the_trace_holds_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    trace_path = tmp_path / "t.json"
    result = runner.invoke(app, ["run", "The sky is", "--model", str(tiny_llama_dir), "--max-new-tokens", "3",
                                 "--no-roofline", "--summary-json", "--json", str(trace_path)])
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout)
    assert list(line)[0] == "schema" and line["schema"] == "llmtrace.run-summary/1"
    _validate(line)
    trace = json.loads(trace_path.read_text(encoding="utf-8"))
    _validate(trace)
    assert trace["summary"] == line


def test_repeat_json_holds_median_min_max_and_stddev(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import statistics

    from llmtrace.tracer.trace.run_trace import Trace

    for out in (str(tmp_path / "r.json"), "-"):
        result = runner.invoke(app, ["run", "The sky is", "--model", str(tiny_llama_dir), "--max-new-tokens", "4",
                                     "--no-roofline", "--repeat", "3", "--json", out])
        assert result.exit_code == 0, result.output
        text = Path(out).read_text(encoding="utf-8") if out != "-" else result.stdout
        document = json.loads(text)  # on stdout: one document, written after the repeats
        _validate(document)
        repeat = document["repeat"]
        assert repeat["repeats"] == 3 and repeat["decode_steps"] == 3
        for name in ("ttft", "prefill_forward", "decode_per_token", "prefill_tokens_per_second",
                     "decode_tokens_per_second"):
            spread = repeat[name]
            samples = spread["samples"]
            assert len(samples) == 3
            assert spread["median"] == statistics.median(samples)
            assert (spread["min"], spread["max"]) == (min(samples), max(samples))
            assert spread["stddev"] == pytest.approx(statistics.stdev(samples))
        # the first sample is this trace's own run: its summary's rates
        assert repeat["decode_tokens_per_second"]["samples"][0] == document["summary"]["decode_tokens_per_second"]
        assert repeat["prefill_tokens_per_second"]["unit"] == "tok/s" and repeat["ttft"]["unit"] == "s"
        assert Trace.from_json(text).generated_ids  # the block does not stop it reading back


# ---- help texts name README sections that exist ----------------------------------------------------------------------


def _readme_sections() -> set[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return {line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")}


def test_help_texts_point_to_readme_sections_that_exist() -> None:
    """A help text that says 'README' names a section of it in quotes ("`--json` schemas"), and that section is
    a heading of README.md."""
    from llmtrace.cli.app import COMMAND_MODULES

    sections = _readme_sections()
    pointers = []
    for command in COMMAND_MODULES:
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400"})
        assert result.exit_code == 0, result.output
        text = " ".join(result.stdout.split())
        for match in re.finditer(r"README(?:\.md)?", text):
            quoted = re.match(r'(?:\.md)?,? (?:section )?"([^"]+)"', text[match.end():])
            assert quoted, f"`{command} --help` points to README without naming a section: {text[match.start():][:80]}"
            pointers.append(quoted.group(1))
            assert quoted.group(1) in sections, f"`{command} --help` names no README section {quoted.group(1)!r}"
    assert "`--json` schemas" in pointers


def test_roofline_json_with_kernels_measured_at_decode_shapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The roofline's optional part, `kernel_decode` (this machine's saved decode ceilings), against the schema."""
    from test_batch_sweep import MACHINE, SMOL, ceilings_for

    from llmtrace.tracer.hardware.decode_ceilings import save_ceilings, this_cpu_name
    from llmtrace.tracer.hardware.store import save_measured_profile

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    save_measured_profile(MACHINE, {"device": "cpu", "others_cpu": 0.0})
    save_ceilings(ceilings_for(SMOL, device=this_cpu_name()))
    document = _json(["roofline", "--model", "smollm2-135m", "--hardware", "this-machine", "--dtype", "fp32", "-p",
                      "20", "-n", "8", "--batch", "2", "--json"])
    assert document["decode_ceilings"] == "measured kernels at decode shapes"
    assert document["kernel_decode"]["first_step"]["batch"] == 2 and document["kernel_decode"]["table"]
