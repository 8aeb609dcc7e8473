"""Paged KV blocks with reference counts and a prefix cache over full blocks.

A full block is keyed by a hash chained over every token before it (Python's tuple hash: fast, not
collision-resistant). A hit is only taken after checking the block itself: its tokens equal the request's,
and the block it was computed after is the request's previous hit, still holding what it held then (blocks
carry a version bumped on reuse). By induction the whole prefix matches, so a collision can cost a cache
hit but never hands out someone else's KV. Freed blocks keep their tokens and hash until they are reused,
which is what lets a preempted or repeated prompt hit the cache.

Eviction: a new block is the least recently freed one, taken first among the blocks whose cached KV was never hit
and only then among those that were (two segments, as a 2Q or segmented LRU cache keeps them). A request's own
tail (its unique prompt suffix and its output) is never hit again, while a system prompt that served one hit
is likely to serve more: under pressure the tails go first, and a shared prefix that sits idle for a moment
outlives the one-off blocks freed after it. A sequence frees its tail blocks before its head, so within a
segment a prefix loses its end before its start (a hit needs the start).

LoRA: the chain of a sequence with an adapter starts from the adapter's id (hash and recorded parent of its first
block), so a prompt under one adapter (or none) never reuses the KV another adapter computed.

Sliding windows: when every layer of the model attends to at most `window` tokens, the blocks of a sequence
that lie wholly before the window of its next query (and one block more, so that the parent of every block
still to be hashed is alive) can never be read again: `release_outside_window` frees them while the sequence
runs, so its KV use stops growing at the window. Their ids stay in the block table, stale (the attention
backends never read before a row's window); `num_window_freed` counts them. They go back to the free list
with their hash: what they hold is the exact KV of their tokens at their positions, so a later prompt with
that prefix may hit them, and a block reused for other tokens leaves the cache (and breaks the chain after it)
as any other.
"""
from collections import OrderedDict

from nanovllm_tp.scheduler.sequence import Sequence


NO_PARENT = -1


def check_holds_a_sequence(num_blocks: int, block_size: int, max_model_len: int, pool: str = "the KV cache") -> None:
    """The rule every KV pool keeps: one max_model_len sequence fits in it (else a request could wait forever).
    `pool` says which pool in the message."""
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(f"{pool} holds {num_blocks} blocks of {block_size} tokens, but one "
                         f"max_model_len={max_model_len} sequence needs {needed}: raise kv_cache_memory "
                         "(or gpu_memory_utilization) or lower max_model_len")


def _root(seq: Sequence) -> int:
    """The parent recorded for a sequence's first block: NO_PARENT for the base model, below it for a LoRA
    adapter (NO_PARENT - lora_int_id), so that a chain of one adapter (or of none) never continues another's."""
    return NO_PARENT - seq.lora_id


def _root_hash(seq: Sequence):
    """What the hash chain starts from: None for the base model, the adapter's id otherwise."""
    return ("lora", seq.lora_id) if seq.lora_id else None


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "version", "parent", "parent_version", "reused")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.version = 0                 # bumped each time the block is reused for other tokens
        self.parent = NO_PARENT          # the block this one's KV was computed after, and its version then
        self.parent_version = 0
        self.reused = False              # its cached KV was hit since it was filled: evicted after the others


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int = 0):
        """window: the most recent tokens any layer reads (0: some layer reads them all, nothing is released)."""
        if num_blocks < 1 or block_size < 1 or window < 0:
            raise ValueError(f"need num_blocks >= 1, block_size >= 1 and window >= 0, got {num_blocks}, "
                             f"{block_size}, {window}")
        self.block_size = block_size
        self.window = window
        self.num_window_freed_blocks = 0     # lifetime count, for tests and stats
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # Ordered so that the least recently freed block is reused (and its cache entry evicted) first; blocks
        # whose KV served a hit wait in free_reused_ids, taken only when free_block_ids is empty.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.free_reused_ids: OrderedDict[int, None] = OrderedDict()
        self.num_prefix_hit_tokens = 0   # lifetime count, for tests and stats
        self.num_prefix_query_tokens = 0   # tokens whose KV was looked up in the cache (vLLM's queries)
        # Each block's version, where the KV pool is shared (workers/kv_pool.py): another engine copying a block
        # checks that it was not taken for other tokens meanwhile. A sequence of ints, or None.
        self.stamps = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.free_reused_ids)

    def free_ids(self) -> list[int]:
        """Every free block, in the order they would be taken."""
        return [*self.free_block_ids, *self.free_reused_ids]

    def usage(self) -> float:
        """The fraction of blocks in use (held by a sequence)."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    @staticmethod
    def chain_hash(prefix_hash: int | None, token_ids: tuple[int, ...]) -> int:
        return hash((prefix_hash, token_ids))

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of seq, leaving at least one token to compute (none for a
        prompt whose logprobs are still owed or whose pooling reads every hidden state)."""
        if not self.enable_prefix_caching or seq.computes_whole_prompt:
            return []
        hits, prefix_hash = [], _root_hash(seq)
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block_tokens(i, self.block_size)
            prefix_hash = self.chain_hash(prefix_hash, tokens)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if block_id is None or not self._continues(self.blocks[block_id], tokens, hits[-1] if hits else
                                                       _root(seq)):
                break
            hits.append(block_id)
        return hits

    def _continues(self, block: Block, tokens: tuple[int, ...], parent: int) -> bool:
        if block.token_ids != tokens or block.parent != parent:
            return False
        return parent < 0 or self.blocks[parent].version == block.parent_version

    def can_allocate(self, seq: Sequence) -> list[int] | None:
        """The cached prefix blocks to reuse if seq fits now, else None."""
        hits = self._cached_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)   # these sit in the free list
        needed = seq.num_blocks(self.block_size) - len(hits) + revived
        return hits if needed <= self.num_free_blocks else None

    def allocate(self, seq: Sequence, hits: list[int]) -> None:
        self._take(seq, hits, seq.num_blocks(self.block_size))
        seq.num_cached_tokens = len(hits) * self.block_size
        self.num_prefix_hit_tokens += seq.num_cached_tokens
        self.num_prefix_query_tokens += len(seq)

    def _take(self, seq: Sequence, hits: list[int], count: int) -> None:
        """seq's block table: the cached blocks `hits`, then fresh blocks up to `count`."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._free_list(block).pop(block_id)
            block.ref_count += 1
            block.reused = True
            seq.block_table.append(block_id)
        for _ in range(count - len(hits)):
            seq.block_table.append(self.take_block())

    def allocate_imported(self, seq: Sequence, num_computed: int) -> list[int] | None:
        """Blocks for a sequence whose first `num_computed` tokens' KV another engine computed (it comes with the
        sequence: engine/kv_transfer.py): the blocks of those tokens, the leading full ones taken from the prefix
        cache where it holds them (a hit, counted as one). Returns the positions in seq's block table whose KV the
        caller writes (the blocks not found in the cache), or None when the pool is short (nothing taken)."""
        count = -(-num_computed // self.block_size)
        hits = self._cached_prefix(seq)[:num_computed // self.block_size]
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if count - len(hits) + revived > self.num_free_blocks:
            return None
        self._take(seq, hits, count)
        seq.num_cached_tokens = num_computed
        self.num_prefix_hit_tokens += len(hits) * self.block_size
        self.num_prefix_query_tokens += num_computed
        return list(range(len(hits), count))

    def share(self, block_id: int) -> None:
        """One more owner of an allocated block (a forked sequence reading its sibling's prompt KV)."""
        self.blocks[block_id].ref_count += 1

    def take_block(self) -> int:
        """A free block (never-hit ones first), evicting whatever cache entry it held; its ref count becomes 1."""
        block_id, _ = (self.free_block_ids or self.free_reused_ids).popitem(last=False)
        block = self.blocks[block_id]
        block.reused = False
        if block.hash is not None:
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = None, ()
        block.version += 1
        if self.stamps is not None:
            self.stamps[block_id] = block.version
        block.ref_count = 1
        return block_id

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks go back first so the oldest (shared, most reusable) prefix blocks are evicted last.
        for block_id in reversed(self.live_blocks(seq)):
            self._release(block_id)
        seq.block_table = []
        seq.num_cached_tokens = seq.num_window_freed = 0

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free_list(block)[block_id] = None

    def _free_list(self, block: Block) -> OrderedDict:
        """The segment a free block waits in: free_reused_ids once its KV served a hit, else free_block_ids."""
        return self.free_reused_ids if block.reused else self.free_block_ids

    def release_outside_window(self, seq: Sequence) -> None:
        """Free seq's blocks that no query from its next token on can read (see the module's note)."""
        if not self.window:
            return
        dead = (seq.num_cached_tokens - self.window + 1) // self.block_size - 1
        while seq.num_window_freed < dead:
            self._release(seq.block_table[seq.num_window_freed])
            seq.num_window_freed += 1
            self.num_window_freed_blocks += 1

    def live_blocks(self, seq: Sequence) -> list[int]:
        """The blocks seq holds (its table less the entries released for the window)."""
        return seq.block_table[seq.num_window_freed:]

    def can_append(self, seq: Sequence) -> bool:
        """Whether seq's next decode token has a slot (it needs a new block on a block boundary)."""
        needs_block = (seq.num_tokens - 1) // self.block_size >= len(seq.block_table)
        return not needs_block or self.num_free_blocks > 0

    def may_append(self, seq: Sequence) -> None:
        if (seq.num_tokens - 1) // self.block_size >= len(seq.block_table):
            seq.block_table.append(self.take_block())

    def hash_blocks(self, seq: Sequence) -> None:
        """Register every block that the last step filled completely (its KV is now computed)."""
        if not self.enable_prefix_caching:
            return
        start = (seq.num_cached_tokens - seq.num_scheduled_tokens) // self.block_size
        for i in range(start, seq.num_cached_tokens // self.block_size):
            self.hash_block(seq, i)

    def hash_block(self, seq: Sequence, i: int) -> None:
        """Register seq's full block i, whose predecessors are registered already."""
        block = self.blocks[seq.block_table[i]]
        if block.hash is not None:   # a block reused from the cache already carries this hash
            return
        parent = seq.block_table[i - 1] if i > 0 else _root(seq)
        tokens = seq.block_tokens(i, self.block_size)
        block.hash = self.chain_hash(self.blocks[parent].hash if i > 0 else _root_hash(seq), tokens)
        block.token_ids, block.parent = tokens, parent
        block.parent_version = self.blocks[parent].version if i > 0 else 0
        self.hash_to_block_id[block.hash] = block.block_id
