"""llmtrace's command line (installed as `llmtrace.cli`): Typer commands that parse their options, call one
engine function of `llmtrace.tracer` and render the records it returns. It sits above every engine layer.
"""
