#!/usr/bin/env python
"""Seconds per test file from a JUnit report of the engine suite, for tests/durations.json.

tests/conftest.py hands the engine suite's files to the pytest-xdist workers longest first (by this table), so
that no long file starts last and leaves one worker running alone at the end. Refresh it after a CI run:

    TEST_REPORT_DIR=/tmp/reports bash scripts/test.sh && python scripts/test_durations.py /tmp/reports/engine.xml
"""

import argparse
import collections
import json
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def file_seconds(report: Path) -> dict[str, int]:
    seconds: collections.Counter = collections.Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        if parts and parts[-1][:1].isupper():  # a test class: its module is the file
            parts = parts[:-1]
        seconds["/".join(parts) + ".py"] += float(case.get("time", 0))
    return {f: round(s) for f, s in seconds.most_common()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path, help="the engine suite's JUnit XML (TEST_REPORT_DIR/engine.xml)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    table = file_seconds(args.report)
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{args.out}: {len(table)} files, {sum(table.values())} s")


if __name__ == "__main__":
    main()
