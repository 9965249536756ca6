"""torch dtypes by name: the one mapping from the core's dtype names
(`core/dtypes.py`) to torch that the KV buffers, the loader and the engine
share."""

from __future__ import annotations

import torch

from ..core.dtypes import DTYPE_SIZES

# The core names its dtypes as torch does, so the mapping is read off torch
# rather than written again; a float8 type this torch build lacks is absent.
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_SIZES if hasattr(torch, name)}
