"""--json output: a record's `asdict()`, on stdout alone."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any


def print_json(record: Any) -> None:
    json.dump(asdict(record), sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
