"""Which transformers versions `wcache.integrations.transformers` runs on, answered without importing it."""

from __future__ import annotations

from wcache.integrations.versions import SupportedVersions

# The range's one owner: doctor reads it through the registry's entry, and tests/test_engine_registry.py fails
# when pyproject's extra `transformers` says otherwise.
SUPPORTED = SupportedVersions(("transformers",), ">=4.56")
