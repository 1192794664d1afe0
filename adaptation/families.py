"""The registered drafter families: ``graftblock train <name>`` for each entry, one line per family.

A new family (e.g. a Medusa- or MTP-style head) brings its config, its drafter and model files,
its loss with its :class:`~adaptation.family.DrafterFamily` plug-in, and one line here.
"""

from __future__ import annotations

from adaptation.eagle3_loss import Eagle3Family
from adaptation.family import DrafterFamily
from adaptation.specblock_loss import SpecBlockFamily

FAMILIES: dict[str, DrafterFamily] = {
    Eagle3Family.name: Eagle3Family(),
    SpecBlockFamily.name: SpecBlockFamily(),
}
"""Family name -> the family with its default knobs."""
