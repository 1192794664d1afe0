"""Readable tables of a bench result (rich), overall and per category.

Both fit an 80-column terminal with every header word whole: headers break over two lines,
columns are separated by one space (no vertical rules), long method names fold, and the
per-category table has one row per category (Spec-Bench has 13) and one column per method,
each cell ``speedup`` over ``(tau)``.
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

#: (header, justify) of the overall table; a header's words never break, its lines are ``\n``.
OVERALL_COLUMNS = (
    ("method", "left"),
    ("tok/s", "right"),
    ("speedup", "right"),
    ("tau", "right"),
    ("tree", "right"),
    ("draft\nshare", "right"),
    ("draft\nms/step", "right"),
    ("verify\nms/step", "right"),
    ("fwd/\nstep", "right"),
    ("lossless", "right"),
)


#: Method names up to this many characters never fold in the overall table at 80 columns.
METHOD_WIDTH = 16


def _table(title: str) -> Table:
    return Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False)


def _add_column(t: Table, header: str, justify: str, max_word: int = 80) -> None:
    """A column at least as wide as the longest word of its header (up to ``max_word``); cells and
    longer words fold rather than clip."""
    width = min(max_word, max(len(w) for w in header.split()))
    t.add_column(header, justify=justify, min_width=width, overflow="fold")


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
    t = _table(title)
    rows = list(result["methods"].items()) + [(f"peer:{k}", v) for k, v in result["peers"].items()]
    for header, justify in OVERALL_COLUMNS:
        _add_column(t, header, justify)
    # Names up to this long stay on one line at 80 columns; longer ones fold.
    t.columns[0].min_width = min(METHOD_WIDTH, max(len(name) for name, _ in rows))
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
    if result.get("concurrency"):
        render_concurrency(result["concurrency"], console)
    if not per_category:
        return
    cats = result["categories"]
    c = _table("speedup (tau) per category")
    _add_column(c, "category", "left")
    for name, _ in rows:
        _add_column(c, name, "right", max_word=9)
    for cat in cats:
        cells = []
        for _, m in rows:
            pc = m["per_category"].get(cat)
            cells.append("-" if pc is None else f"{pc['speedup']:.2f}x\n({_fmt(pc.get('tau'))})")
        c.add_row(cat, *cells)
    console.print(c)


def _ms(v) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def render_concurrency(levels: dict, console: Console) -> None:
    """One table: per concurrency N and method (and the padded HF peer), throughput and latency."""
    t = _table("closed-loop concurrency (batched engine)")
    for header, justify in (("N", "right"), ("method", "left"), ("tok/s", "right"), ("speedup", "right"),
                            ("req tok/s", "right"), ("TTFT p50/p99 ms", "right"), ("ITL p50/p99 ms", "right"),
                            ("tau", "right"), ("tree/seq", "right"), ("lossless", "right")):
        _add_column(t, header, justify)
    for n, level in levels.items():
        rows = list(level["methods"].items()) + [(f"peer:{k}", v) for k, v in level.get("peers", {}).items()]
        for name, m in rows:
            t.add_row(n, name, _fmt(m["tokens_per_s"], 1), _fmt(m["speedup"]) + "x",
                      _fmt(m["request_tokens_per_s"], 1),
                      f"{_ms(m['ttft_p50_s'])}/{_ms(m['ttft_p99_s'])}", f"{_ms(m['itl_p50_s'])}/{_ms(m['itl_p99_s'])}",
                      _fmt(m.get("tau")), _fmt(m.get("mean_tree_tokens_per_seq_step"), 1), _fmt(m.get("lossless")))
    console.print(t)
