"""Structured outputs, without torch at import: what a request asks for (`request`), compiled by
xgrammar or llguidance in a time-limited child process (`compiler`, `compile_worker`, `llguidance`),
cached by content (`cache`), one matcher per request (`state`), and the last check of a finished output
(`output_check`); `schema/` rewrites JSON Schemas into what a backend enforces, or names what it would not.

It never imports the engine's runtime (only `engine.errors`, a leaf of plain exception classes), Ray, or
torch at import: xgrammar (which loads torch) is imported by the compiler when one is built.
"""
