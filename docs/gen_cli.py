"""Regenerate the usage lines and option tables of docs/cli.md from the argparse parsers.

    python docs/gen_cli.py           # rewrite what lies between the generated-block markers
    python docs/gen_cli.py --check   # exit 1 (and name the commands) if docs/cli.md is stale

Only the blocks between ``<!-- cli:<command>:begin -->`` and ``<!-- cli:<command>:end -->`` are
written; the prose around them is edited by hand. Every leaf sub-command of
``graftblock.cli.build_parser()`` must have a block, and every block a sub-command.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent / "cli.md"
REPO = DOC.parent.parent
WIDTH = "100"
BLOCK = re.compile(
    r"(<!-- cli:(?P<cmd>[a-z0-9 -]+):begin -->\n)(?P<body>.*?)(<!-- cli:(?P=cmd):end -->)", re.S
)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _leaves(parser: argparse.ArgumentParser, path: list[str]) -> dict[str, argparse.ArgumentParser]:
    sub = _subparsers(parser)
    if sub is None:
        return {" ".join(path): parser}
    out: dict[str, argparse.ArgumentParser] = {}
    for name, child in sub.choices.items():
        out.update(_leaves(child, path + [name]))
    return out


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._StoreFalseAction):
        return "on"
    if action.default is None or action.default == argparse.SUPPRESS:
        return "–"
    if action.default == "":
        return '""'
    return f"`{action.default}`"


def _block(parser: argparse.ArgumentParser) -> str:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flags = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
        if action.choices and not isinstance(action, argparse.BooleanOptionalAction):
            flags += " (" + " \\| ".join(f"`{c}`" for c in action.choices) + ")"
        elif action.metavar:
            flags += f" `{action.metavar}`"
        rows.append(f"| {flags} | {_default(action)} | {_cell(action.help or '')} |")
    usage = parser.format_usage().strip()
    return (f"```text\n{usage}\n```\n\n| option | default | meaning |\n|---|---|---|\n"
            + "\n".join(rows) + "\n\n")


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every block regenerated, and the commands whose block changed."""
    os.environ["COLUMNS"] = WIDTH
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # the checkout's own parsers, not an installed copy's
    from graftblock.cli import build_parser

    leaves = _leaves(build_parser(), ["graftblock"])
    found = {m.group("cmd") for m in BLOCK.finditer(text)}
    if found != set(leaves):
        missing, extra = sorted(set(leaves) - found), sorted(found - set(leaves))
        raise SystemExit(f"docs/cli.md blocks do not match the parsers: missing {missing}, unknown {extra}")
    changed: list[str] = []

    def sub(m: re.Match) -> str:
        new = _block(leaves[m.group("cmd")])
        if new != m.group("body"):
            changed.append(m.group("cmd"))
        return m.group(1) + new + m.group(4)

    return BLOCK.sub(sub, text), changed


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--check", action="store_true", help="only report whether docs/cli.md is stale")
    opts = args.parse_args(argv)
    text = DOC.read_text(encoding="utf-8")
    new, changed = render(text)
    if opts.check:
        if changed:
            stale = ", ".join(changed)
            print(f"docs/cli.md is stale for: {stale} (run python docs/gen_cli.py)", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new, encoding="utf-8")
    which = f" ({', '.join(changed)})" if changed else ""
    print(f"docs/cli.md: {len(changed)} block(s) regenerated{which}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
