"""`python -m cli ...` runs the same entry point as the `llmtrace` console script."""

from cli.app import main

main()
