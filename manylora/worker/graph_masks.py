"""Which projection mask a LoRA decode graph step replays: the admission and eviction policy
of the masked decode graphs (``worker/cuda_graph.py``).

A decode step's projection mask (``SlotTable.kind_mask``: one bit per projection kind, set
where some slot of the step targets that kind in some layer) says which LoRA projections it
needs. The all-kinds graph of each (bucket, variant) is captured at start-up and is valid
for every step (a kind no slot targets has rank 0, so its kernels exit at once). A graph
captured for mask ``M`` launches the kernels of ``M``'s kinds only and is valid for any step
whose mask is a subset of ``M``: it saves the launches, tails and early-exit programs of the
projections no adapter targets (slot buffers on all seven projections with q/k/v/o adapters
run as the engine with ``lora_target_modules`` q/k/v/o).

At start-up nothing is known of the adapters, so masked graphs are made during serving:
a mask is *admitted* once ``min_uses`` steps asked for it (a transient mix of adapters
does not pay for captures), and its graphs are captured lazily, one per (bucket, variant)
on first use. At most ``max_masks`` masks are held; when all places are taken, a mask is
admitted only if it was asked for more often than the least recently used held mask, which
it evicts (its graphs are destroyed): TinyLFU's admission, so masks taking turns cannot
make every step capture. Counts are halved every ``AGING`` asks, so old popularity fades.
A step whose mask is not held replays the smallest held superset of it, else the
all-kinds graph.

The policy is a deterministic function of the sequence of masks it is asked about: under
tensor parallelism every rank runs it on the same masks (computed on rank 0 and sent with
the step, ``StepLayout.lora_mask``), so every rank captures, replays and evicts the same
graphs at the same steps (their captures run collectives in lock step).
"""

from __future__ import annotations

from collections import OrderedDict

#: Asks between two halvings of the masks' use counts.
AGING = 4096


class GraphMaskPolicy:
    """LRU set of the projection masks that have decode graphs besides the all-kinds one.

    Args:
        full_mask: the mask of every kind (``SlotTable.full_mask``; 0 without LoRA).
        max_masks: masks held besides ``full_mask`` (0: never capture a masked graph).
        min_uses: steps that must ask for a mask before it is admitted (>= 1).

    Raises:
        ValueError: a negative ``full_mask`` or ``max_masks``, or ``min_uses`` below 1.
    """

    def __init__(self, full_mask: int, max_masks: int = 4, min_uses: int = 2) -> None:
        if full_mask < 0 or max_masks < 0 or min_uses < 1:
            raise ValueError(f"full_mask {full_mask}, max_masks {max_masks} and min_uses "
                             f"{min_uses}: need >= 0, >= 0 and >= 1")
        self.full_mask = full_mask
        self.max_masks = max_masks
        self.min_uses = min_uses
        self._held: OrderedDict[int, None] = OrderedDict()
        self._uses: dict[int, int] = {}
        self._asks = 0

    @property
    def held(self) -> tuple[int, ...]:
        """The masks held besides ``full_mask``, least recently used first."""
        return tuple(self._held)

    def choose(self, mask: int) -> tuple[int, tuple[int, ...]]:
        """The mask whose graph a step needing ``mask`` replays, and the masks evicted now.

        Args:
            mask: the step's projection mask; negative: every kind.

        Returns:
            ``(run, evicted)``: ``run`` is ``mask`` itself when held or admitted now, else
            the smallest held superset (fewest kinds; the most recently used of equals),
            else ``full_mask``; ``run`` is always a superset of ``mask``. ``evicted``: the
            mask dropped to admit ``mask``, if any (its graphs must be destroyed).

        Raises:
            ValueError: bits outside ``full_mask``.
        """
        if mask < 0 or mask == self.full_mask:
            return self.full_mask, ()
        if mask & ~self.full_mask:
            raise ValueError(f"projection mask {mask:#x} has bits outside {self.full_mask:#x}")
        self._uses[mask] = self._uses.get(mask, 0) + 1
        self._asks += 1
        if self._asks % AGING == 0:
            self._uses = {m: n // 2 for m, n in self._uses.items() if n // 2}
        uses = self._uses.get(mask, 0)
        if mask in self._held:
            self._held.move_to_end(mask)
            return mask, ()
        if self.max_masks and uses >= self.min_uses:
            if len(self._held) < self.max_masks:
                self._held[mask] = None
                return mask, ()
            victim = next(iter(self._held))
            if uses > self._uses.get(victim, 0):
                del self._held[victim]
                self._held[mask] = None
                return mask, (victim,)
        supersets = [m for m in reversed(self._held) if m & mask == mask]
        if not supersets:
            return self.full_mask, ()
        best = min(supersets, key=lambda m: m.bit_count())
        self._held.move_to_end(best)
        return best, ()
