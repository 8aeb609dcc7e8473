"""Which data-parallel replica serves a request. The front end holds D engine replicas; each has its own scheduler
and its own prefix cache of KV blocks, and they share nothing. A request (a batch of prompts submitted together
goes to one replica, routed by its first prompt) is sent to the replica a policy picks from the loads the replicas
last reported (ReplicaLoad); a dead or restarting replica is never picked.

Policies:
  round-robin   the next live replica in turn. Blind to load and cache: the baseline to compare against.
  least-load    the live replica with the fewest requests (running + waiting). Ties go to a replica that has the
                request's LoRA adapter loaded already (it need not load it), then to the lower KV usage, then to the
                replica this router has sent fewer requests to: loads arrive with a lag, so a burst of requests
                routed before the next report would otherwise all land on one replica. Then the lowest index.
  prefix-aware  (the server's default) the replica most likely to hold the prompt's first KV blocks in its
                prefix cache, so that its prefill skips them: requests that share a system prompt or a
                conversation's history stick to one replica, and each replica's cache holds its own share of the
                prefixes instead of every replica holding all of them.

How prefix-aware knows: it cannot see the replicas' caches, so it remembers what it sent where. A prompt's leading
full blocks of `block_size` tokens are hashed as a chain (block i's hash covers blocks 0..i, as the engine's prefix
cache keys them, and is seeded with the LoRA adapter, since a prefix cached under one adapter is of no use to
another). Only the first `max_blocks` blocks are hashed: a route's cost (microseconds) does not grow with the prompt,
and the first blocks are what requests share. Each replica keeps an LRU of at most `capacity` hashes (an
approximation of its cache: bounded, it forgets what the replica has likely evicted); an index from hash to the
replicas holding it finds the longest match by walking the prompt's chain once, whatever the number of replicas.

Affinity yields to load, but a miss costs more than a queue: sending a request where its prefix is not cached means
a prefill of the whole prefix, and a copy of it in a cache that has its own prefixes to hold (under cache pressure
the copy evicts one of them, so the miss repeats there later). So a replica holding the prompt's first blocks keeps
it until it is more than `miss_threshold` requests busier than the least loaded replica; the longest match among
the replicas within that patience wins. With a closed loop of requests over a few prefixes, a replica that gets
more than its share runs slower (its misses and prefills hold everyone's decode) and holds its requests longer,
while the other drains: swings of 12 against 4 requests, even 16 against 0, are common and pass on their own,
since the next request for one of the drained replica's own prefixes brings it back. In a simulation of the
shared-prefix benchmark (`bench router-sim`: the real scheduler and this router, 8 prefixes, 16 streams, each
cache holding about half of the prefixes) diverting at every swing past 8 requests got 84.7% of the prompt tokens
from the cache against 92.8% with this patience, one engine's figure, and took 35% longer. SGLang's cache-aware
router is more patient still: it balances by load only past an absolute and a relative imbalance.

A replica that stays idle is another matter: when one has had nothing to do at more than `idle_routes` routes in a
row, the traffic does not ask for what it holds (one shared system prompt, say, would keep every request on one
replica), and the patience drops to `load_threshold`, so the prefix gets a copy there.

Room: a queue costs more than a short match saves. A replica has room when a sequence slot (`--max-num-seqs`) is
free once the requests queued there and on their way have taken theirs (ReplicaLoad.has_room). A request sent
where it must queue waits for a running one to finish, a whole answer's decode; a match of a few blocks saves a
prefill of a few dozen tokens. So a request whose match (or, for a prompt no replica holds, whose own length) is
under `queue_match` blocks goes to a replica with room when the one patience picked has none, and when none has
room, to the least busy: queues stay even. Longer matches keep their patience, as do new prompts of that length
(the first request of a long system prompt decides who owns it). Measured with `--max-num-seqs 4` and 16 chat
streams that share only the chat template, patience alone split them 11 and 5 (12 and 4 in another run), 7
waiting on one replica while the other had free slots, the last first tokens after 11 s where an even split gives
about 6 s. In `bench router-sim` (modelled time, medians of 6 seeds; BENCHMARKS.md) a one-block shared prefix at 4
and 8 slots per replica has its TTFT p90 1.8x and 1.9x lower; the shared-prefix workload (600-token prefixes) is
routed exactly as before at every slot count.

A prompt none of them holds goes to the one that remembers the fewest blocks among the replicas within
`load_threshold` of the least loaded (then least-load's order), as
SGLang's cache-aware router sends a miss to its smallest tree: new prefixes spread evenly over the caches, so no
replica ends up owning more shared prefixes than its cache holds, nor more requests than its share. A prompt
shorter than one block records nothing and routes by load. The chosen replica then records the prompt's hashes, its
first block last so that a prompt's head, the part others share, is evicted after its tail.

Among replicas that match equally, the block's owner wins — the replica that recorded it first (and, once that
one forgot it, the next holder) — unless it is more than `load_threshold` requests busier than the least loaded of
them. A request sent elsewhere because its owner was busy leaves a copy there; were ties settled by load, later
requests would keep both copies warm, each replica's cache would end up holding every shared prefix (round-robin's
waste), and under cache pressure the hit rate would fall toward round-robin's. Sent back to the owner, the stray
copy ages out.
"""
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ReplicaLoad", "Router", "RoundRobinRouter", "LeastLoadRouter", "PrefixAwareRouter", "NoReplica",
           "POLICIES", "make_router", "block_hashes"]


class NoReplica(RuntimeError):
    """No replica is alive to take the request."""


@dataclass(slots=True)
class ReplicaLoad:
    """What a replica last reported (every engine step, and every second when idle), and what was sent to it
    since."""
    running: int = 0                # sequences running
    waiting: int = 0                # sequences its scheduler could not start yet (no slot, no KV room): a queue
    kv_usage: float = 0.0           # fraction of its KV blocks in use, 0..1
    alive: bool = True              # False: dead (or restarting): never routed to
    loras: frozenset = frozenset()  # lora_int_ids of the adapters this replica has loaded or used recently
    pending: int = 0                # requests sent to it that its last report does not count yet
    max_seqs: int = 0               # the most sequences it runs at once (--max-num-seqs); 0: not known

    @property
    def busy(self) -> int:
        """Requests on the replica: running, queued, or on their way."""
        return self.running + self.waiting + self.pending

    @property
    def has_room(self) -> bool:
        """Whether a sequence slot is free for a request sent now, once those queued and on their way have taken
        theirs (always, while max_seqs is not known)."""
        return not self.max_seqs or self.busy < self.max_seqs


def block_hashes(prompt: Sequence[int], block_size: int, max_blocks: int, lora_id: int | None = None) -> list[int]:
    """The chained hashes of the prompt's leading full blocks (at most max_blocks), seeded with the adapter."""
    parent = hash((lora_id is not None, lora_id or 0))    # ints and tuples of ints hash the same in every process
    hashes = []
    for start in range(0, min(len(prompt) // block_size, max_blocks) * block_size, block_size):
        parent = hash((parent, tuple(prompt[start:start + block_size])))
        hashes.append(parent)
    return hashes


class Router:
    """The interface: route() picks a live replica for a request; subclasses implement _choose()."""
    policy: str = ""

    def __init__(self, num_replicas: int, block_size: int = 16):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_replicas, self.block_size = num_replicas, block_size
        self._routed = [0] * num_replicas
        self._prefix_hits = 0

    def route(self, prompt: Sequence[int], loads: Sequence[ReplicaLoad], lora_id: int | None = None) -> int:
        """The replica for a request whose (first) prompt is these token ids. Raises NoReplica when no replica is
        alive."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"{len(loads)} loads for {self.num_replicas} replicas")
        alive = [i for i, load in enumerate(loads) if load.alive]
        if not alive:
            raise NoReplica(f"none of the {self.num_replicas} replicas is alive")
        replica, hit = self._choose(prompt, loads, alive, lora_id)
        self._routed[replica] += 1
        self._prefix_hits += hit
        return replica

    def _choose(self, prompt: Sequence[int], loads: Sequence[ReplicaLoad], alive: list[int],
                lora_id: int | None) -> tuple[int, bool]:
        """(replica among `alive`, whether it was chosen for holding the prompt's prefix)."""
        raise NotImplementedError

    def forget_replica(self, replica: int) -> None:
        """The replica lost its cache (it died, or was restarted): drop what the router remembers of it."""

    def counters(self) -> dict:
        return {"routed": list(self._routed), "prefix_hits": self._prefix_hits, "policy": self.policy}

    def _load_order(self, loads: Sequence[ReplicaLoad], lora_id: int | None):
        """Sort key of least-load's order: the smallest key is the replica to pick."""
        def key(i: int) -> tuple:
            load = loads[i]
            has_adapter = lora_id is not None and lora_id in load.loras
            return load.busy, not has_adapter, load.kv_usage, self._routed[i], i
        return key


class RoundRobinRouter(Router):
    policy = "round-robin"

    def __init__(self, num_replicas: int, block_size: int = 16):
        super().__init__(num_replicas, block_size)
        self._next = 0

    def _choose(self, prompt, loads, alive, lora_id):
        replica = next((i for i in alive if i >= self._next), alive[0])
        self._next = (replica + 1) % self.num_replicas
        return replica, False


class LeastLoadRouter(Router):
    policy = "least-load"

    def _choose(self, prompt, loads, alive, lora_id):
        return min(alive, key=self._load_order(loads, lora_id)), False


class PrefixAwareRouter(Router):
    policy = "prefix-aware"

    def __init__(self, num_replicas: int, block_size: int = 16, *, max_blocks: int = 32, capacity: int = 50_000,
                 load_threshold: float = 8, miss_threshold: float = 16, idle_routes: int = 8, queue_match: int = 8):
        super().__init__(num_replicas, block_size)
        if max_blocks < 1 or capacity < 1 or not 0 <= load_threshold <= miss_threshold or min(idle_routes,
                                                                                            queue_match) < 0:
            raise ValueError(f"max_blocks and capacity must be at least 1, 0 <= load_threshold <= miss_threshold, "
                             f"idle_routes >= 0 and queue_match >= 0, got {max_blocks}, {capacity}, {load_threshold}, "
                             f"{miss_threshold}, {idle_routes}, {queue_match}")
        self.max_blocks, self.capacity = max_blocks, capacity
        self.load_threshold, self.miss_threshold = load_threshold, miss_threshold
        self.idle_routes, self.queue_match = idle_routes, queue_match
        self._idle = [0] * num_replicas         # per replica: the routes in a row it had nothing to do at
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._holders: dict[int, int] = {}      # block hash -> bit mask of the replicas whose LRU holds it
        self._owner: dict[int, int] = {}        # block hash -> the replica that has held it longest

    def blocks_held(self, replica: int) -> int:
        """How many block hashes the router remembers for the replica (at most `capacity`)."""
        return len(self._lru[replica])

    def _choose(self, prompt, loads, alive, lora_id):
        hashes = block_hashes(prompt, self.block_size, self.max_blocks, lora_id)
        busy = [load.busy for load in loads]
        self._idle = [n + 1 if b == 0 else 0 for n, b in zip(self._idle, busy)]
        replica, matched = self._pick(hashes, loads, busy, alive, lora_id)
        worth = matched if matched else len(hashes)     # a new prompt of many blocks: likely a prefix to own
        if worth < self.queue_match and not loads[replica].has_room:     # see the note on room
            least = min(busy[i] for i in alive)
            roomy = [i for i in alive if loads[i].has_room] or [i for i in alive if busy[i] == least]
            replica, matched = self._pick(hashes, loads, busy, roomy, lora_id)
        self._record(replica, hashes)
        return replica, matched > 0

    def _pick(self, hashes: list[int], loads, busy: list[int], alive: list[int], lora_id) -> tuple[int, int]:
        """(the replica among `alive` by affinity and patience, the blocks of the prompt it holds); `busy`: each
        replica's load.busy."""
        order = self._load_order(loads, lora_id)
        least = min(busy[i] for i in alive)
        spare = any(self._idle[i] > self.idle_routes for i in alive)       # a replica left idle: see the note
        patience = self.load_threshold if spare else self.miss_threshold
        candidates = sum(1 << i for i in alive if busy[i] <= least + patience)
        matched = 0
        for h in hashes:         # narrow to the replicas that hold the chain one block further
            holding = candidates & self._holders.get(h, 0)
            if not holding:
                break
            candidates, matched = holding, matched + 1
        if matched:
            holders = [i for i in alive if candidates >> i & 1]
            owner = self._owner[hashes[matched - 1]]
            nearest = min(busy[i] for i in holders)
            replica = owner if owner in holders and busy[owner] <= nearest + self.load_threshold else \
                min(holders, key=order)
        else:
            eligible = [i for i in alive if busy[i] <= least + self.load_threshold]
            if hashes:          # a prefix no replica holds: to the one remembering the fewest blocks
                replica = min(eligible, key=lambda i: (len(self._lru[i]), order(i)))
            else:
                replica = min(eligible, key=order)
        return replica, matched

    def _record(self, replica: int, hashes: list[int]) -> None:
        lru, bit = self._lru[replica], 1 << replica
        for h in reversed(hashes):      # the head last: most recent, evicted last
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders[h] = self._holders.get(h, 0) | bit
                self._owner.setdefault(h, replica)
        while len(lru) > self.capacity:
            self._drop(lru.popitem(last=False)[0], bit)

    def _drop(self, h: int, bit: int) -> None:
        mask = self._holders[h] & ~bit
        if mask:
            self._holders[h] = mask
            if self._owner[h] == bit.bit_length() - 1:      # the owner forgot it: the lowest other holder owns it
                self._owner[h] = (mask & -mask).bit_length() - 1
        else:
            del self._holders[h]
            del self._owner[h]

    def forget_replica(self, replica: int) -> None:
        lru, bit = self._lru[replica], 1 << replica
        for h in lru:
            self._drop(h, bit)
        lru.clear()


POLICIES: dict[str, type[Router]] = {cls.policy: cls for cls in (RoundRobinRouter, LeastLoadRouter, PrefixAwareRouter)}


def make_router(policy: str, num_replicas: int, block_size: int = 16, **kwargs) -> Router:
    """The router of that policy; kwargs go to its constructor (prefix-aware: max_blocks, capacity,
    load_threshold)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown router policy {policy!r}; known: {', '.join(POLICIES)}")
    return POLICIES[policy](num_replicas, block_size, **kwargs)
