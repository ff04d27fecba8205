"""Hugging Face transformers: `from_pretrained` over a daemon's tensors (`attach`), and the greedy run of
`verify --engine transformers` (`greedy`).

    from wcache.integrations.transformers import from_pretrained
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wcache.lazy_exports import lazy_exports

__all__ = ["from_pretrained"]
# Lazy: importing the package (as the registry's dotted names do) loads neither torch nor transformers.
__getattr__, __dir__ = lazy_exports(__name__, {"from_pretrained": "wcache.integrations.transformers.attach"},
                                    globals())

if TYPE_CHECKING:
    from wcache.integrations.transformers.attach import from_pretrained
