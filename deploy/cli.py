"""The `tandem` command line: `tandem serve`, `tandem generate`, `tandem models ...`, `tandem zoo ...`, and
`tandem ray-start ...` (`ray start` with Ray's metrics exporters off: deploy/ray_start.py)."""
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


def _ray_start(argv: list[str]) -> int:
    from deploy.ray_start import main as ray_start_main

    return ray_start_main(argv)


COMMANDS = {"serve": _serve, "generate": _generate, "models": _models, "zoo": _zoo, "ray-start": _ray_start}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: structured, speculative LLM serving")
    parser.add_argument("command", choices=list(COMMANDS), help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        parser.error(f"unknown command {command!r}")
    return COMMANDS[command](rest)


if __name__ == "__main__":
    raise SystemExit(main())
