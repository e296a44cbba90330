"""After a run: which served topologies ran, on which device, and which were skipped and why (the summary
`make test-gpu` prints)."""
from __future__ import annotations

import re

_outcomes: dict[str, dict[str, str]] = {}  # "row-device" -> test name -> outcome or skip reason


def pytest_runtest_logreport(report):
    m = re.search(r"tests/integration/test_served_topologies\.py::(\w+)\[([\w-]+)\]", report.nodeid)
    if m is None or (report.when != "call" and not report.skipped and not report.failed):
        return
    outcome = "failed" if report.failed else "passed" if report.passed else None
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        outcome = "skipped: " + reason.removeprefix("Skipped: ")
    _outcomes.setdefault(m.group(2), {})[m.group(1)] = outcome


def pytest_terminal_summary(terminalreporter):
    if not _outcomes:
        return
    tr = terminalreporter
    tr.section("served topologies")
    for case, tests in sorted(_outcomes.items()):
        ran = [t for t, o in tests.items() if o in ("passed", "failed")]
        failed = [t for t, o in tests.items() if o == "failed"]
        if ran:
            tr.write_line(f"{case}: ran {len(ran)} test(s)" + (f", FAILED: {', '.join(failed)}" if failed else ", all passed"))
        else:
            reasons = sorted({o.removeprefix("skipped: ") for o in tests.values() if o})
            tr.write_line(f"{case}: skipped ({'; '.join(reasons)})")
