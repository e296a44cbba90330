"""The `tandem` command line: `tandem serve`, `tandem generate`, `tandem models ...`, `tandem zoo ...`."""
from __future__ import annotations

import argparse
import sys


def _zoo(argv: list[str]) -> int:
    from zoo.cli import main as zoo_main

    return zoo_main(argv)


def _models(argv: list[str]) -> int:
    from zoo.models import main as models_main

    return models_main(argv)


def _generate(argv: list[str]) -> int:
    from deploy.local_demo import main as demo_main

    return demo_main(argv)


def _serve(argv: list[str]) -> int:
    from deploy.serve_cmd import main as serve_main

    return serve_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: structured, speculative LLM serving")
    parser.add_argument("command", choices=["serve", "generate", "models", "zoo"], help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command not in ("serve", "generate", "models", "zoo"):
        parser.error(f"unknown command {command!r}")
    if command == "zoo":
        return _zoo(rest)
    if command == "models":
        return _models(rest)
    if command == "generate":
        return _generate(rest)
    return _serve(rest)


if __name__ == "__main__":
    raise SystemExit(main())
