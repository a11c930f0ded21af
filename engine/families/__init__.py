"""Family adapters. Importing this package registers every family (one file each)."""

from . import flux, lumina2, pixart, qwenimage, sana, sd3, wan, zimage  # noqa: F401
from .base import (  # noqa: F401
    BlockList, Carry, FamilyAdapter, TextBatch, TextSpec, family_for_class, family_names, get_family,
    register_family,
)
