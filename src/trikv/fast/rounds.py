"""Fast pieces of a compression round (see `trikv.fast`)."""

from __future__ import annotations

import torch

from ..scoring import TriScorer


def gather_slots(buffer: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """buffer [L, b, H, C, *rest] (contiguous), order [L, b, H, P] slot indices -> [L, b, H, P, *rest].

    Same result as `buffer[:, :, :, :N].gather(3, order[..., None].expand(..., D))`, as one index_select of
    whole rows of the flattened buffer (a memcpy per kept entry).
    """
    L, b, H, C = buffer.shape[:4]
    rest = buffer.shape[4:]
    if not buffer.is_contiguous():
        buffer = buffer.contiguous()
    base = torch.arange(L * b * H, device=order.device).view(L, b, H, 1) * C
    flat = (order + base).reshape(-1)
    return buffer.reshape(L * b * H * C, *rest).index_select(0, flat).view(*order.shape, *rest)


def compact_slots_(buffer: torch.Tensor, order: torch.Tensor) -> None:
    """In place: buffer[l, r, h, :P] = buffer[l, r, h, order[l, r, h]] for every layer (order [L, b, H, P]).

    One layer at a time through a small scratch (1/L of the cache), so a round allocates no cache-sized
    tensor: fresh large allocations are page-faulted in on every round, which costs more than the copy.
    """
    L, b, H, C = buffer.shape[:4]
    P = order.shape[-1]
    if not buffer.is_contiguous():
        raise ValueError("compact_slots_ needs a contiguous buffer")
    rest = buffer.shape[4:]
    base = (torch.arange(b * H, device=order.device) * C).view(b, H, 1)
    scratch = None
    for layer in range(L):
        index = (order[layer] + base).reshape(-1)
        rows = buffer[layer].view(b * H * C, *rest)
        scratch = torch.index_select(rows, 0, index, out=scratch) if scratch is not None else rows.index_select(0, index)
        buffer[layer, :, :, :P].copy_(scratch.view(b, H, P, *rest))


# Slots scored together ahead of a round at the least: a slice's cost is mostly fixed (a few batched ops over every
# layer), so three slots a step (batch 1, B=256, beta=128) cost more than scoring them all at the round.
AHEAD_MIN_SLICE = 32


class FastTriScorer(TriScorer):
    """`TriScorer` with a faster `score` (same math; results equal up to float rounding), and scoring ahead.

    Scoring ahead (`spread`, on by default): a key's TriAttention score depends only on the key and on the
    position t at which the round runs, and t is known in advance (the round runs when the cache reaches
    budget + slack, i.e. after a known number of decode steps). Between two rounds, `spread_step` (called
    by the cache before every decode forward) scores a slice of the stored slots for that future t, so that
    the round itself only scores the one or two newest slots and selects. The selection, the z-scores and
    the compaction are unchanged; the scores are the same numbers a round-time computation gives. In a batch
    whose rows are due at different steps a round scores only its due rows, so nothing is scored ahead.
    """

    spread = True

    @classmethod
    def from_scorer(cls, scorer: TriScorer) -> "FastTriScorer":
        fast = cls.__new__(cls)
        fast.__dict__.update(scorer.__dict__)
        fast._device_cache = {}
        geometry = scorer.geometry
        F = geometry.num_bands
        real, imag = geometry.real_index.tolist(), geometry.imag_index.tolist()
        if real == list(range(F)) and imag == list(range(F, 2 * F)):
            fast._band_view = "half"
        elif real == list(range(0, 2 * F, 2)) and imag == list(range(1, 2 * F, 2)):
            fast._band_view = "interleaved"
        else:
            fast._band_view = None  # partial rotary etc.
            fast._permutation = torch.cat([geometry.real_index, geometry.imag_index])
        fast._clear_ahead()
        return fast

    def for_layers(self, layers: slice) -> "FastTriScorer":
        part = super().for_layers(layers)
        part._clear_ahead()
        part._ahead = None
        return part

    def for_heads(self, heads: slice) -> "FastTriScorer":
        part = super().for_heads(heads)
        part._clear_ahead()
        part._ahead = None
        return part

    # ---- the score --------------------------------------------------------------------------------
    def _magnitude(self, keys: torch.Tensor) -> torch.Tensor:
        """|k_f| per band: [..., N, D] -> [..., N, F] (hypot of strided views: no index copy)."""
        F = self.num_bands
        if self._band_view == "half":
            return torch.hypot(keys[..., :F], keys[..., F:])
        if self._band_view == "interleaved":
            return torch.hypot(keys[..., 0::2], keys[..., 1::2])
        permutation = self._permutation.to(keys.device)
        return torch.hypot(keys[..., permutation[:F]], keys[..., permutation[F:]])

    def _weights(self, t: torch.Tensor, keys: torch.Tensor):
        """Trig weights [L, b, Hkv, G, D] for positions t and norm weights [L, Hkv, G, F] (None when off)."""
        trig = self._dense_weights(self._trig_weights(t, None), keys).transpose(-1, -2) if self.use_trig else None
        norm_t = self._on(keys.device, torch.float32)[0].transpose(-1, -2) if self.use_norm else None
        return trig, norm_t

    def _score_into(self, keys: torch.Tensor, weights, out: torch.Tensor) -> None:
        """Scores of keys [L, b, Hkv, n, D] into out [L, b, Hkv, G, n]; one layer at a time for long n."""
        trig, norm_t = weights
        L, b, Hkv, n, _ = keys.shape
        # all layers and heads in one batched computation, except long spans on CPU: there, a layer at a time keeps
        # the intermediates small (fresh cache-sized CPU allocations are page-faulted in on every round)
        chunked = n > 256 and keys.device.type == "cpu"
        layers = [slice(layer, layer + 1) for layer in range(L)] if chunked else [slice(None)]
        for part in layers:
            k = keys[part].float()  # [l, b, Hkv, n, D]
            score = None
            if trig is not None:
                score = torch.matmul(trig[part], k.transpose(-1, -2))  # [l, b, Hkv, G, n]
            if norm_t is not None:
                magnitude = self._magnitude(k)  # [l, b, Hkv, n, F]
                term = torch.matmul(norm_t[part][:, None], magnitude.transpose(-1, -2))
                score = term if score is None else score.add_(term)
            out[part].copy_(score)

    def score(self, keys: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """keys [L, b, Hkv, N, D] post-RoPE of every layer, t [b] -> [L, b, Hkv, G, N] (float32)."""
        if self.offset_aggregation != "mean":
            return super().score(keys, t)
        L, b, Hkv, N, D = keys.shape
        done = self._usable_ahead(keys, t)
        if done:
            out = self._ahead[..., :N]  # slots [0, done) were scored ahead for this very t
            weights = self._ahead_weights
        else:
            out = torch.empty(L, b, Hkv, self.group, N, dtype=torch.float32, device=keys.device)
            weights = self._weights(t, keys)
        if done < N:
            self._score_into(keys[:, :, :, done:], weights, out[..., done:])
        self._clear_ahead()
        return out

    # ---- scoring ahead ----------------------------------------------------------------------------
    def _clear_ahead(self) -> None:
        self._ahead_done = 0
        self._ahead_key = None
        self._ahead_t = None
        self._ahead_weights = None
        self._ahead_probe = None

    def _usable_ahead(self, keys: torch.Tensor, t: torch.Tensor) -> int:
        """Leading slots of `keys` already scored for `t` (0 if the ahead state does not belong to them)."""
        done = self._ahead_done
        if not done or self._ahead_t is None or done > keys.shape[3]:
            return 0
        if keys.data_ptr() != self._ahead_key[0] or tuple(keys.shape[:3]) != tuple(self._ahead.shape[:3]):
            return 0
        if not torch.equal(t.to(self._ahead_t.device), self._ahead_t):
            return 0
        if not torch.equal(keys[:, :, :, done - 1], self._ahead_probe):  # the slots were not rewritten since
            return 0
        return done

    def ahead(self, buffer: torch.Tensor, length: int, t_round: int, t_of, steps_left: int, total: int) -> None:
        """Score the next slice of buffer[..., :length] for the round at logical position `t_round`.

        `t_of()` gives the per-row positions [b] of that round; `steps_left` decode steps (this one included)
        remain before it; `total` slots will be stored when it runs.
        """
        key = (buffer.data_ptr(), tuple(buffer.shape), t_round)
        if key != self._ahead_key or self._ahead_done > length:
            self._clear_ahead()
            L, b, Hkv, C, _ = buffer.shape
            shape = (L, b, Hkv, self.group, C)
            if getattr(self, "_ahead", None) is None or tuple(self._ahead.shape) != shape or self._ahead.device != buffer.device:
                self._ahead = torch.empty(shape, dtype=torch.float32, device=buffer.device)
            self._ahead_key = key
            self._ahead_t = t_of()
            self._ahead_weights = self._weights(self._ahead_t, buffer)
        done = self._ahead_done
        share = max(-(-(total - done) // max(steps_left, 1)), AHEAD_MIN_SLICE)
        stop = min(length, done + share)
        if stop - done < min(AHEAD_MIN_SLICE, share) or stop <= done:
            return  # too few new slots for a slice worth its fixed cost: they wait for the next step (or the round)
        self._score_into(buffer[:, :, :, done:stop], self._ahead_weights, self._ahead[..., done:stop])
        self._ahead_done = stop
        self._ahead_probe = buffer[:, :, :, stop - 1].clone()


def spread_step(cache) -> None:
    """Before a decode forward: let a fast TriAttention scorer score ahead for the next round (see FastTriScorer)."""
    scorer = getattr(cache.policy, "scorer", None)
    if (
        not isinstance(scorer, FastTriScorer) or not scorer.spread or scorer.offset_aggregation != "mean"
        or cache.budget is None or cache.layout != "uniform" or cache.batch_size < 0
        or (not cache.schedule.aligned and cache.scores_due_rows_only)  # rounds score their due rows alone
    ):
        return
    steps_left = cache.schedule.steps_until_due(cache.length)  # decode forwards before the round's
    if steps_left < 1:
        return
    t_round = cache.seen + steps_left
    scorer.ahead(cache.store.keys, cache.length, t_round, lambda: cache.current_positions() + steps_left, steps_left,
                 cache.length + steps_left)


def accelerate(policy) -> None:
    """Give a bound TriAttention policy the fast scorer (no-op for other policies or when already fast)."""
    scorer = getattr(policy, "scorer", None)
    if type(scorer) is TriScorer:
        policy.scorer = FastTriScorer.from_scorer(scorer)
