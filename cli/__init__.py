"""llmtrace's command line: Typer commands that call `tracer/` and render what it returns."""
