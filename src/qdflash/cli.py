"""The `qdflash` command: `qdflash serve ...` (qdflash.serve), `qdflash latency ...` (qdflash.bench_latency)."""

from __future__ import annotations

import sys

COMMANDS = {"serve": "qdflash.serve", "latency": "qdflash.bench_latency"}


def main(argv: list[str] | None = None) -> None:
    import importlib

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: qdflash {{{','.join(COMMANDS)}}} [options]   (qdflash <command> --help for its options)", file=sys.stderr)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
