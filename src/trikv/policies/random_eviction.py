"""Random eviction: the control every scoring rule must beat at the same budget."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .base import Policy, ScoringContext

POSITION_BITS = 24  # positions are permuted within [0, 2^24): distinct positions get distinct scores below 16.7M
_MASK = (1 << POSITION_BITS) - 1
# odd multipliers (invertible mod 2^24) and xor-shifts (invertible) of a 24-bit mixing permutation
_MULTIPLIERS = (0x9E3775, 0x2C1B3D, 0x3A8F05)
_SHIFTS = (12, 11, 13)


def mix24(x):
    """A bijection of [0, 2^24) that scatters neighbouring integers: multiply by an odd constant and xor-shift,
    three times, modulo 2^24. Works elementwise on Python ints, torch int64 tensors and NumPy int64 arrays alike
    (every product stays below 2^48), so every backend computes the same scores."""
    for multiplier, shift in zip(_MULTIPLIERS, _SHIFTS):
        x = (x * multiplier) & _MASK
        x = x ^ (x >> shift)
    return x


def head_key(seed: int, layer: int, head: int) -> int:
    """The 24-bit key of (seed, layer, KV head): which permutation of positions that head's scores follow."""
    return mix24((seed * 0x10001 + layer * 0x3B9 + head * 0x61 + 0x5BD1E9) & _MASK)


def random_scores(positions, keys):
    """Scores of entries at `positions` (any integer array) under per-head keys `keys` (broadcastable): the keyed
    permutation mix24(position xor key), as float-exact integers below 2^24."""
    return mix24((positions & _MASK) ^ keys)


@dataclass
class RandomEviction(Policy):
    """Keep a uniformly random subset of the candidates of every (layer, KV head): a control for what any eviction
    at the same budget keeps, under the same trigger, budget accounting and prompt protection as every method.

    Rule: score_j = pi_{l,h}(p_j), a pseudo-random permutation of RoPE positions keyed by (seed, layer, KV head)
    (`mix24`); top-B. Scores are a function of the position alone, so an entry's rank does not change from round
    to round, distinct positions never tie, and every backend (transformers, vLLM, MLX) keeps the same sets.
    Defaults: seed 0, no recent window. Cost: O(N) integer operations per round.
    """

    name = "random"
    rule = "a uniformly random subset per (layer, KV head), seeded (the control)"
    paper = "trikv's control: random eviction with the prompt protected as for every method"
    control = True
    scores_rows_independently = True
    scores_layers_independently = True
    seed: int = 0

    def __post_init__(self):
        self._first_layer, self._first_head = 0, 0  # set on the parts a round scores separately
        self._keys: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def scores_heads_independently(self) -> bool:
        return True

    def for_layers(self, layers: slice) -> "RandomEviction":
        part = copy.copy(self)
        part._first_layer, part._keys = self._first_layer + (layers.start or 0), {}
        return part

    def for_heads(self, heads: slice) -> "RandomEviction":
        part = copy.copy(self)
        part._first_head, part._keys = self._first_head + (heads.start or 0), {}
        return part

    def head_keys(self, layers: int, heads: int) -> torch.Tensor:
        """[L, 1, Hkv, 1] int64: the key of each (layer, KV head) of a context, by absolute index."""
        if (layers, heads) in self._keys:
            return self._keys[layers, heads]
        keys = [[head_key(self.seed, self._first_layer + layer, self._first_head + head) for head in range(heads)]
                for layer in range(layers)]
        self._keys[layers, heads] = torch.tensor(keys, dtype=torch.int64)[:, None, :, None]
        return self._keys[layers, heads]

    def score(self, context: ScoringContext) -> torch.Tensor:
        L, _, Hkv, _ = context.positions.shape
        keys = self.head_keys(L, Hkv).to(context.positions.device)
        return random_scores(context.positions.clamp_min(0).long(), keys).float()
