"""Compare the JUnit reports of a patched (on) and an unpatched (off) ``run.sh`` run.

    python -m tools.torch_dcp_compat.summarize OUT_DIR

Prints per-file counts for both modes, then every test that fails patched but passes
stock (with the first line of its error) and every one that fails only stock.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

Outcome = tuple[str, str]  # (passed|failed|skipped, first line of the message)


def read_report(path: Path) -> dict[str, Outcome]:
    """Test id -> outcome from one JUnit XML file (missing or broken file: empty)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    results: dict[str, Outcome] = {}
    for case in root.iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        outcome, msg = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
            else:
                continue
            lines = (child.get("message") or child.text or "").strip().splitlines()
            msg = lines[0][:200] if lines else ""
            break
        results[tid] = (outcome, msg)
    return results


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    names = sorted({p.stem for mode in ("on", "off") for p in (out / mode).glob("*.xml")})
    print(f"{'file':52} {'patched p/f/s':>15} {'stock p/f/s':>13}")
    only_patched: list[str] = []
    only_stock: list[str] = []
    for name in names:
        on, off = read_report(out / "on" / f"{name}.xml"), read_report(out / "off" / f"{name}.xml")
        cols = []
        for rep in (on, off):
            c = Counter(o for o, _ in rep.values())
            cols.append(f"{c['passed']}/{c['failed']}/{c['skipped']}" if rep else "-")
        print(f"{name:52} {cols[0]:>15} {cols[1]:>13}")
        for tid, (o, msg) in on.items():
            if o == "failed" and off.get(tid, ("",))[0] == "passed":
                only_patched.append(f"{name}: {tid}\n    {msg}")
        for tid, (o, msg) in off.items():
            if o == "failed" and on.get(tid, ("",))[0] == "passed":
                only_stock.append(f"{name}: {tid}\n    {msg}")
    print(f"\nfail patched, pass stock ({len(only_patched)}):")
    print("\n".join(only_patched) or "  none")
    print(f"\nfail stock, pass patched ({len(only_stock)}):")
    print("\n".join(only_stock) or "  none")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
