"""`python -m llmtrace ...` runs the same entry point as the `llmtrace` console script.

This file is the whole of the `llmtrace` namespace's own folder (pyproject maps the repository root to it); the
library is llmtrace.tracer (tracer/) and the command line llmtrace.cli (cli/).
"""

from llmtrace.cli.app import main

if __name__ == "__main__":
    main()
