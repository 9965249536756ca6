"""The routing rule: which replica serves a new request, given the hit
each replica would give it (a PrefixIndex answers that) and how busy each
one is.

A request costs a replica the prompt tokens it must compute (the prompt
less its hit there) and the wait behind the requests already queued there.
The rule prices a queued request as `queued_request_tokens` prompt tokens
and sends the request where the sum is smallest:

    cost(replica) = (prompt_tokens - hit_tokens(replica))
                    + queued_request_tokens * (queue(replica) - min queue)
                    - affinity * (held_tokens(replica) - hit_tokens(replica))

So a longer hit wins while the replicas are about equally busy, and a
replica `d` requests busier than the least busy one must offer a hit more
than `d * queued_request_tokens` tokens longer to be chosen. Ties go to the
shorter queue, then in turn (a rotating start), so cold requests spread
like round robin. The default (256 tokens per queued request) is about the
prefill a queued request of a chat workload still needs.

The last term is there when the router says, per replica, how much of the
prompt's leading blocks it holds (`held`: the full-attention keys, what a
token-prefix router sees; never less than the hit). On a hybrid model the
hit alone forgets where a prompt family lives: once a family's Mamba
checkpoint is gone, every replica offers the same short hit and the
family's requests spread in turn, each to a replica that never saw its
prefix, where the checkpoint policy (it learns branch points from the
prompts it has seen) places no checkpoint at the family's branch point, so
the family keeps missing. The replica holding the family's blocks is where
its next computation leaves the checkpoint its later requests hit.
benchmarks/replica_routing.py measures it (64 replicas): on Jamba-1.5-Mini
the hit alone saved 94% of the prefill tokens one big cache saves, less
than a token-prefix router; with affinity 0.25, as many as that router; on
Gemma-3-27B it moves the saving by under 1%.

Pure Python, no torch: a router process imports it with the index.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence


class RoutingRule:
    def __init__(self, queued_request_tokens: int = 256, affinity: float = 0.25):
        if queued_request_tokens < 0:
            raise ValueError(f"queued_request_tokens must be >= 0, got {queued_request_tokens}")
        if not 0 <= affinity <= 1:
            raise ValueError(f"affinity must be between 0 and 1, got {affinity}")
        self.queued_request_tokens = queued_request_tokens
        self.affinity = affinity
        self._turn = 0

    def costs(self, prompt_tokens: int, replicas: Sequence[Hashable], hits: Mapping[Hashable, int],
              queues: Mapping[Hashable, int], held: Mapping[Hashable, int] | None = None) -> dict:
        """Each replica's cost, in prompt-token equivalents (see the module)."""
        least = min(queues.get(r, 0) for r in replicas)
        costs = {r: (prompt_tokens - hits.get(r, 0)) + self.queued_request_tokens * (queues.get(r, 0) - least)
                 for r in replicas}
        if held and self.affinity:
            for r, tokens in held.items():
                if r in costs:
                    costs[r] -= self.affinity * max(0, tokens - hits.get(r, 0))
        return costs

    def choose(self, prompt_tokens: int, replicas: Sequence[Hashable], hits: Mapping[Hashable, int],
               queues: Mapping[Hashable, int], held: Mapping[Hashable, int] | None = None) -> Hashable:
        """The replica with the smallest cost; `hits` may leave out replicas
        with no hit, `queues` those with nothing queued, `held` those
        holding no more than their hit."""
        if not replicas:
            raise ValueError("no replica to route to")
        costs = self.costs(prompt_tokens, replicas, hits, queues, held)
        n = len(replicas)
        start = self._turn % n
        self._turn += 1
        best = None
        for i in range(n):
            r = replicas[(start + i) % n]
            rank = (costs[r], queues.get(r, 0))
            if best is None or rank < best[0]:
                best = (rank, r)
        return best[1]
