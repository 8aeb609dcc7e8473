"""Rank 0's LRU of LoRA adapters over the engine's `max_loras` slots (every rank holds the same slot tables).

A sequence holds its adapter's slot from the moment it gets KV blocks until it gives them back (finish,
preemption). An adapter not resident takes a free slot, else the least recently used slot that no sequence
holds; the load travels in the next plan (`lora_loads`: slot, id, path) and every rank reads the directory. When
every slot is held, `acquire` says no and the request waits."""
from collections import OrderedDict

from nanovllm_tp.scheduler.sequence import Sequence


class LoRASlots:
    def __init__(self, max_loras: int):
        self.resident: OrderedDict[int, int] = OrderedDict()    # lora_int_id -> slot, least recently used first
        self.holders = [0] * max_loras                          # sequences holding each slot
        self.loads: list[list] = []                             # [slot, id, path] the next plan carries
        self.num_loads = 0                                      # lifetime, for tests and stats

    def acquire(self, seq: Sequence) -> bool:
        """Give seq its adapter's slot (loading it if need be); False when every slot is held by others."""
        lora = seq.lora
        if lora is None or seq.lora_slot >= 0:
            return True
        slot = self.resident.get(lora.lora_int_id)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self.resident[lora.lora_int_id] = slot
            self.loads = [load for load in self.loads if load[0] != slot] + [[slot, lora.lora_int_id,
                                                                              lora.lora_path]]
            self.num_loads += 1
        self.resident.move_to_end(lora.lora_int_id)
        self.holders[slot] += 1
        seq.lora_slot = slot
        return True

    def can_acquire(self, seq: Sequence) -> bool:
        return seq.lora is None or seq.lora_slot >= 0 or seq.lora.lora_int_id in self.resident or \
            self._free_slot(evict=False) is not None

    def _free_slot(self, evict: bool = True) -> int | None:
        used = set(self.resident.values())
        for slot in range(len(self.holders)):
            if slot not in used and self.holders[slot] == 0:      # empty, or its adapter forgotten and left
                return slot
        for lora_id, slot in self.resident.items():       # least recently used first
            if self.holders[slot] == 0:
                if evict:
                    del self.resident[lora_id]
                return slot
        return None

    def release(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.holders[seq.lora_slot] -= 1
            seq.lora_slot = -1

    def forget(self, lora_id: int) -> None:
        """Drop an adapter (removed by the user): the sequences holding its slot keep it until they leave, and
        the id's next use loads its directory afresh."""
        self.resident.pop(lora_id, None)

    def take_loads(self) -> list[list] | None:
        loads, self.loads = self.loads, []
        return loads or None
