"""Context parallelism over ``torch.distributed`` for packed ragged batches (docs/api.md section 9).

``plan_shards`` decides which rank owns which rows; ``varlen_attention`` runs exact attention
over all of them (all-gather of the keys each rank needs, or Ulysses' all-to-all over heads);
``explain`` shows each rank's work, the bytes each algorithm moves and why one was chosen.
"""

from jagged_sdpa.distributed.api import DistExplanation, explain, varlen_attention
from jagged_sdpa.distributed.shards import ShardPlan, plan_shards

__all__ = ["plan_shards", "ShardPlan", "varlen_attention", "explain", "DistExplanation"]
