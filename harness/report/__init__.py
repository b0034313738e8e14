"""Reports of a diagnosis: terminal text, JSON (schema in :mod:`.model`), self-contained HTML
and a Chrome-trace timeline of the collectives."""

from harness.report.chrome_trace import chrome_trace, write_chrome_trace
from harness.report.html import render_html, write_html
from harness.report.model import SCHEMA, DiagnosisReport, build_report
from harness.report.terminal import format_terminal

__all__ = [
    "SCHEMA",
    "DiagnosisReport",
    "build_report",
    "chrome_trace",
    "format_terminal",
    "render_html",
    "write_chrome_trace",
    "write_html",
]
