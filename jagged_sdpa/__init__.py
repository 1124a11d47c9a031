"""jagged_sdpa: scaled-dot-product attention on ragged batches, without padding.

Public names only; see README.md and docs/api.md.
"""

from jagged_sdpa.api import explain, sdpa, varlen_attention
from jagged_sdpa.backends import Backend
from jagged_sdpa.errors import NoBackendError
from jagged_sdpa.paging import paged_append
from jagged_sdpa.plans import Plan, plan
from jagged_sdpa.selection import Explanation, use_backends

__version__ = "0.1.0"

__all__ = [
    "sdpa",
    "varlen_attention",
    "explain",
    "plan",
    "Plan",
    "paged_append",
    "Backend",
    "use_backends",
    "Explanation",
    "NoBackendError",
    "__version__",
]
