"""llmtrace's library: configs, analytical estimates, a hookable LLaMA, and trace records.

Nothing here prints, parses command lines or imports rich/typer; the CLI in `cli/` renders what this returns.
Importing `tracer` itself stays light (no torch): modules that need torch import it themselves.
"""
