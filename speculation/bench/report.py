"""Readable tables of a bench result (rich), overall and per category."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def render(result: dict, console: Console | None = None, per_category: bool = True) -> None:
    """Print the overall table and, optionally, speedup/tau per category."""
    console = console or Console()
    title = (
        f"{result['model']} {result['dtype']} | {result['dataset']} | {result['n_prompts']} prompts, "
        f"{result['n_turns']} turns | {result['max_new_tokens']} new tokens | T={result['temperature']}"
    )
    t = Table(title=title)
    for col in ("method", "tok/s", "speedup", "tau", "tree", "draft share", "draft ms/step",
                "verify ms/step", "fwd/step", "lossless"):
        t.add_column(col, justify="right" if col != "method" else "left")
    rows = list(result["methods"].items()) + [(f"peer:{k}", v) for k, v in result["peers"].items()]
    for name, m in rows:
        t.add_row(
            name,
            _fmt(m["tokens_per_s"], 1),
            _fmt(m["speedup"]) + "x",
            _fmt(m.get("tau")),
            _fmt(m.get("mean_tree_size"), 1),
            _fmt(m.get("drafting_share")),
            _fmt(1000 * m["drafting_s_per_step"], 2) if m.get("drafting_s_per_step") is not None else "-",
            _fmt(1000 * m["verify_s_per_step"], 1) if m.get("verify_s_per_step") is not None else "-",
            _fmt(m.get("drafter_forwards_per_step"), 1),
            _fmt(m.get("lossless")),
        )
    console.print(t)
    if not per_category:
        return
    cats = result["categories"]
    c = Table(title="speedup (tau) per category")
    c.add_column("method")
    for cat in cats:
        c.add_column(cat, justify="right")
    for name, m in rows:
        cells = []
        for cat in cats:
            pc = m["per_category"].get(cat)
            cells.append("-" if pc is None else f"{pc['speedup']:.2f}x ({_fmt(pc.get('tau'))})")
        c.add_row(name, *cells)
    console.print(c)
