"""cli/formatting.py: one convention per unit (its docstring), checked on values whose text is known by hand."""

from __future__ import annotations

import pytest

from llmtrace.cli import formatting as fmt


@pytest.mark.parametrize(("value", "text"), [
    (0, "0 FLOP"), (512, "512 FLOP"), (13_218_912_451, "13.22 GFLOP"), (52_100_000_000, "52.10 GFLOP"),
    (999_970_000_000, "1.000 TFLOP"), (3.3589e12, "3.359 TFLOP"),
])
def test_flop_counts_keep_four_significant_figures(value: float, text: str) -> None:
    assert fmt.flops(value) == text


def test_macs_are_half_the_flops() -> None:
    assert fmt.flops(2 * 16_777_216, matmul_as_macs=True) == "16.78 MMAC"  # 4096 x 4096 multiply-adds


@pytest.mark.parametrize(("value", "text"), [
    (999, "999 B"), (524_288, "524.3 kB"), (1_048_576_000, "1.049 GB"), (2.5e12, "2.500 TB"),
])
def test_bytes_are_decimal_with_a_lower_case_k(value: float, text: str) -> None:
    assert fmt.nbytes(value) == text


@pytest.mark.parametrize(("value", "text"), [
    (524_288, "524.3 kB (512.0 KiB)"), (1_048_576_000, "1.049 GB (0.9766 GiB)"), (32_768_000, "32.77 MB (31.25 MiB)"),
])
def test_bytes_both_gives_the_binary_figure_at_the_same_step(value: float, text: str) -> None:
    assert fmt.bytes_both(value) == text


@pytest.mark.parametrize(("seconds", "text"), [
    (1.5, "1.50 s"), (0.0123, "12.3 ms"), (0.000456, "456 µs"), (7.89e-7, "789 ns"), (1234.5, "1,234 s"),
    (0.99996, "1.00 s"),
])
def test_durations_keep_three_significant_figures(seconds: float, text: str) -> None:
    assert fmt.duration_s(seconds) == text
    assert fmt.duration_ns(seconds * 1e9) == text  # the same text from nanoseconds


def test_rates_and_ratios_keep_three_significant_figures() -> None:
    assert fmt.flops_per_s(312e12) == "312 TFLOP/s"
    assert fmt.bytes_per_s(25.3e9) == "25.3 GB/s"
    assert fmt.tokens_per_s(27.34) == "27.3 tok/s"
    assert fmt.tokens_per_s(6896.6) == "6,897 tok/s"
    assert fmt.intensity(1.0) == "1.00 FLOP/B"
    assert fmt.times(153.2) == "153×"


def test_shares_never_round_to_a_misleading_zero_or_hundred() -> None:
    assert fmt.share(1, 10_000) == "<0.1%"
    assert fmt.share(9_999, 10_000) == ">99.9%"
    assert fmt.share(1, 3) == "33.3%"
    assert fmt.share(1, 0) == "-"


def test_table_cells_in_the_headers_unit() -> None:
    assert fmt.number_in(2.5e10, "G") == "25.0"
    assert fmt.number_in(0.0123, "ms") == "12.3"
    assert fmt.number_in(80 * 2**30, "GiB") == "80.0"


def test_flow_breaks_only_between_phrases_and_indents_the_rest() -> None:
    phrases = ["Parameters [bold]6,738,415,616[/] =", "embedding 131,072,000", "+ 32 layers × 202,383,360",
               "+ final norm 4,096"]
    assert fmt.flow(phrases, 80) == ("Parameters 6,738,415,616 = embedding 131,072,000 + 32 layers × 202,383,360"
                                     .replace("6,738,415,616", "[bold]6,738,415,616[/]") + "\n  + final norm 4,096")
    assert fmt.flow(phrases, 200).count("\n") == 0
    # the markup is not counted: the first line is 74 columns on screen, 85 characters as a string
    assert fmt.flow(phrases[:3], 74).count("\n") == 0
    assert fmt.flow(phrases[:3], 73).count("\n") == 1
    assert fmt.flow(["a" * 90, "b"], 80) == "a" * 90 + "\n  b"  # a phrase wider than the line stays whole
