"""The tables of BENCHMARKS.md, rendered from the committed JSON results (figures are never edited by hand).

    graftblock report            # rewrites BENCHMARKS.md, benchmarks/archive.md, README's headline
    graftblock report --check    # exit 1 naming what is stale

Each JSON under ``benchmarks/results/`` becomes one section (``section``, in ``base``): its title (``SECTIONS``),
the command that produced it, the date, the machine, the model and the dtype, all read from the JSON
itself, then the tables of the renderer registered for its ``kind`` (``@renderer``, one module per question: ``bench``, ``batching``, ``serving``, ``sweeps``,
``adaptation``, ``kernels``, ``training``, ``workloads``; a ``graftblock
bench`` JSON has no kind and renders as ``bench``), its plots and its hand-written note
(``benchmarks/notes/<stem>.md``). The layout (verdicts, contents, groups, archive) is
``benchmarks/report.py``'s.
"""

from __future__ import annotations

import sys

# Importing the renderer modules registers their kinds.
from benchmarks.render import adaptation, batching, bench, kernels, serving, sweeps, training, workloads  # noqa: F401
from benchmarks.render.base import (
    BENCH_KIND, HEADER, NOTES, RENDERERS, RESULTS, ROOT, SECTIONS, VERDICTS, WORKLOAD_DATASETS, UnknownKind,
    command_of, dataset_label, dataset_note, fmt, kind_of, renderer, section, title_of,
)

__all__ = ["BENCH_KIND", "HEADER", "NOTES", "RENDERERS", "RESULTS", "ROOT", "SECTIONS", "VERDICTS",
           "WORKLOAD_DATASETS", "UnknownKind", "command_of", "dataset_label", "dataset_note", "fmt",
           "kind_of", "renderer", "section", "title_of", "main"]


def main() -> int:
    """``python -m benchmarks.render``: the same as ``graftblock report``."""
    from benchmarks import report  # here, not at the top: report imports this package
    return report.main([])
