"""Which KV-cache slots hold the keys and values of which token prefixes.

A multi-turn episode sends its whole history with every turn, and each history extends the last
one: the previous prompt, the tokens the engine sampled, then the tool's output. When a
sequence finishes, the engine copies its keys and values into a retained slot and records the
tokens here; a later request whose prompt starts with those tokens has that part copied back
into its own slot and prefills only the rest.

Prompts admitted together share their common prefixes too, with each other and with the
sequences running (`shared_prefixes`): the samples of one GRPO group (the same prompt several
times), or episodes that open with the same system prompt, have that part prefilled once and
copied to the others, which prefill only the rest.

Retained prefixes are found by whole blocks of `block` tokens (a chained hash per block,
checked against the stored tokens, so a hash collision can never serve wrong keys), then
matched to the token, as prompts of one batch and running sequences share. At least one token
of a prompt is always left to prefill: its logits start the generation. Slots are reused
least recently used first. Keys and values belong to the weights that computed them: the
engine clears the index whenever its weights change.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """Token prefixes held in the cache slots `slots` (module docstring). Not thread-safe: the
    engine's scheduler thread owns it."""

    def __init__(self, slots: Sequence[int], block: int = 16) -> None:
        if block < 1:
            raise ValueError(f"block must be at least 1 token, got {block}")
        self.block = block
        self.slots = tuple(slots)
        """Every slot it may fill (none: the prefix cache is off)."""
        self._free = list(slots)
        self._tokens: dict[int, list[int]] = {}
        """Slot -> the tokens whose keys and values it holds."""
        self._by_prefix: dict[int, set[int]] = {}
        """Chained hash of a block-aligned prefix -> the slots that hold it."""
        self._recent: OrderedDict[int, None] = OrderedDict()
        """Occupied slots, least recently used first."""

    def __len__(self) -> int:
        return len(self._tokens)

    def _hashes(self, tokens: Sequence[int], blocks: int) -> list[int]:
        out: list[int] = []
        chained = 0
        for i in range(blocks):
            chained = hash((chained, tuple(tokens[i * self.block : (i + 1) * self.block])))
            out.append(chained)
        return out

    def lookup(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """`(slot, length)`: the slot holding the longest prefix of `tokens` shorter than
        `tokens` itself, and that prefix's length; None when none holds a whole block of it.
        Candidates are found by whole blocks, then matched to the token."""
        candidates: set[int] = set()
        for i, key in enumerate(self._hashes(tokens, (len(tokens) - 1) // self.block)):
            length = (i + 1) * self.block
            matching = {
                slot
                for slot in self._by_prefix.get(key, ())
                if self._tokens[slot][:length] == list(tokens[:length])
            }
            if not matching:
                break
            candidates = matching
        if not candidates:
            return None
        found = max(
            ((slot, _common_prefix(self._tokens[slot], tokens)) for slot in candidates),
            key=lambda hit: (hit[1], -hit[0]),
        )
        self._recent.move_to_end(found[0])
        return found

    def store(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """Record that the keys and values of `tokens` are about to be copied into a slot;
        return `(slot, length)` to copy, or None when there is nothing worth copying (shorter
        than a block, or held whole already)."""
        blocks = len(tokens) // self.block
        if blocks == 0:
            return None
        keys = self._hashes(tokens, blocks)
        for held in self._by_prefix.get(keys[-1], ()):
            if self._tokens[held][: len(tokens)] == list(tokens):
                self._recent.move_to_end(held)
                return None
        if self._free:
            slot = self._free.pop()
        elif self._recent:
            slot, _ = self._recent.popitem(last=False)
            self._forget(slot)
        else:
            return None
        self._tokens[slot] = list(tokens)
        for key in keys:
            self._by_prefix.setdefault(key, set()).add(slot)
        self._recent[slot] = None
        return slot, len(tokens)

    def _forget(self, slot: int) -> None:
        tokens = self._tokens.pop(slot)
        for key in self._hashes(tokens, len(tokens) // self.block):
            holders = self._by_prefix.get(key)
            if holders is not None:
                holders.discard(slot)
                if not holders:
                    del self._by_prefix[key]

    def clear(self) -> int:
        """Forget every prefix (the weights changed); returns how many slots held one."""
        held = list(self._tokens)
        for slot in held:
            self._forget(slot)
            self._free.append(slot)
        self._recent.clear()
        return len(held)


def shared_prefixes(
    prompts: Sequence[Sequence[int]],
    cached: Sequence[int],
    *,
    held: Sequence[Sequence[int]] = (),
    min_gain: int = 1,
) -> dict[int, tuple[int, int]]:
    """Which prompts of one prefill batch can copy a prefix from a sequence already in the
    cache or from another prompt of the batch.

    `held` are the tokens whose keys and values running sequences hold in their slots.
    Returns follower index -> `(source, shared length)`: the source is `held[source]` when
    `source < len(held)`, else prompt `source - len(held)` of the batch (an earlier one); it
    starts with the same `shared length` tokens, which is shorter than the follower's prompt
    (at least one token is left to prefill) and longer than the `cached` prefix the follower
    already has.

    A prompt that shares nothing is a source; one that follows another is a source too when
    the later prompts would copy at least `min_gain` tokens more from it than from its own
    source: the first prompt of each GRPO group of a batch that opens with one system prompt
    copies the system prompt from the first group's and is copied by its group-mates. Its
    followers can copy only once it is prefilled: prefilling the batch takes one pass per link
    of the longest chain of batch prompts, and `min_gain` is what an extra pass must save."""
    followers: dict[int, tuple[int, int]] = {}
    sources = list(range(len(held)))
    for i, prompt in enumerate(prompts):
        best, best_length = -1, cached[i]
        for source in sources:
            tokens = held[source] if source < len(held) else prompts[source - len(held)]
            length = _common_prefix(tokens, prompt)
            if length > best_length:
                best, best_length = source, length
        if best >= 0:
            followers[i] = (best, best_length)
        gain = sum(
            max(0, _common_prefix(prompt, prompts[j]) - best_length)
            for j in range(i + 1, len(prompts))
        )
        if best < 0 or gain >= min_gain:
            sources.append(len(held) + i)
    return followers


def _common_prefix(leader: Sequence[int], prompt: Sequence[int]) -> int:
    """The length of the common prefix of `leader` and `prompt`, leaving at least one token
    of `prompt` past it."""
    limit = min(len(leader), len(prompt) - 1)
    n = 0
    step = 16  # whole chunks first: list slices compare in C
    while n + step <= limit and list(leader[n : n + step]) == list(prompt[n : n + step]):
        n += step
    while n < limit and leader[n] == prompt[n]:
        n += 1
    return n
