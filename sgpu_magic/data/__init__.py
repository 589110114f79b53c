"""Data inside ranks (aside from the layers): ``VolumeDataset`` and ``DataLoader`` with a per-machine file cache.

Usage in a rank::

    from sgpu_magic.data import VolumeDataset, DataLoader

Lazy (PEP 562): ``sgpu_magic.data.cache`` alone does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgpu_magic.data.dataset import VolumeDataset
    from sgpu_magic.data.loader import DataLoader

__all__ = ["VolumeDataset", "DataLoader"]


def __getattr__(name: str) -> Any:
    if name == "DataLoader":
        from sgpu_magic.data.loader import DataLoader

        return DataLoader
    if name in __all__:
        from sgpu_magic.data import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
