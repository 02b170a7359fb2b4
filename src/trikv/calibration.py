"""Calibration: per-head statistics of the exact pre-RoPE queries (and keys) of a model.

For every layer l and query head h, band f:  mu = E[q_f] (complex mean) and A = E[|q_f|].
Concentration (Mean Resultant Length) R_f = |mu_f| / A_f. Key statistics are kept for analysis only.

The vectors are captured where they enter the rotation: `apply_rotary_pos_emb` in the model's modeling
module is wrapped for the duration of the capture, so q_norm/k_norm (Qwen3) and projection biases (Qwen2)
are included. Sums stream in float64; no vector of a long text is kept.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from . import __version__
from .architectures import SHAPE_KEYS, ModelShape, attention_modules, model_shape, shape_metadata
from .geometry import RopeGeometry
from .qk_capture import capture_pre_rope

log = logging.getLogger(__name__)

MIN_CALIBRATION_TOKENS = 1024  # the shortest length docs/calibration.md measures; `trikv calibrate` warns below its own default


STATS_FORMAT = "trikv-query-stats/1"
_TENSORS = ("q_mean_real", "q_mean_imag", "q_abs_mean")
_KEY_TENSORS = ("k_mean_real", "k_mean_imag", "k_abs_mean")


class StatsFileError(ValueError):
    """A statistics file is unreadable, malformed, or belongs to another model."""


def weight_signature(model: torch.nn.Module) -> list[float]:
    """Summary numbers of the first and last q_proj weights: tells models of the same shape apart."""
    attns = attention_modules(model)
    numbers = []
    for attn in (attns[0], attns[-1]):
        w = attn.q_proj.weight.detach().float()
        numbers += [w.mean().item(), w.std().item(), w.abs().mean().item()]
    return numbers


def _check_plausible(path, mean_real: torch.Tensor, mean_imag: torch.Tensor, abs_mean: torch.Tensor) -> None:
    """Refuse statistics that no calibration can produce (they would make every selection meaningless):
    E|q_f| < 0, E|q_f| < |E[q_f]| (beyond float32 rounding), or nothing measured at all."""
    if bool((abs_mean < 0).any()):
        raise StatsFileError(f"{path}: negative E|q| values; these are not calibration statistics")
    magnitude = torch.sqrt(mean_real**2 + mean_imag**2)
    if bool((magnitude > abs_mean * (1 + 1e-4) + 1e-6).any()):
        raise StatsFileError(f"{path}: |E[q]| exceeds E|q| in some band, which no calibration produces")
    if not bool((abs_mean > 0).any()):
        raise StatsFileError(f"{path}: every statistic is zero; the calibration saw no tokens")


def checkpoint_weight_signature(model_dir: str | Path, num_layers: int) -> list[float] | None:
    """`weight_signature` read from a safetensors checkpoint folder (serving engines repack the weights they
    load); None when the folder holds no safetensors with the transformers names of the q_proj weights."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    wanted = [f"model.layers.{layer}.self_attn.q_proj.weight" for layer in (0, num_layers - 1)]
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in wanted:
                if name in handle.keys():
                    found[name] = handle.get_tensor(name)
    if len(found) != len(wanted):
        return None
    numbers = []
    for name in wanted:
        w = found[name].float()
        numbers += [w.mean().item(), w.std().item(), w.abs().mean().item()]
    return numbers


@dataclass
class QueryStats:
    """Calibrated pre-RoPE statistics. Complex tensors are complex128, magnitudes float64."""

    q_mean: torch.Tensor  # [L, Hq, F] complex: mu
    q_abs_mean: torch.Tensor  # [L, Hq, F] float: A = E|q_f|
    k_mean: torch.Tensor | None = None  # [L, Hkv, F] complex (analysis only)
    k_abs_mean: torch.Tensor | None = None  # [L, Hkv, F]
    metadata: dict = field(default_factory=dict)

    @property
    def concentration(self) -> torch.Tensor:
        """R_f = |mu_f| / A_f, [L, Hq, F] (0 where a band never fired)."""
        return torch.where(self.q_abs_mean > 0, self.q_mean.abs() / self.q_abs_mean.clamp_min(1e-30), 0.0)

    @property
    def layers(self) -> list[int]:
        """The model layers these statistics cover, in row order (all layers unless the file names them)."""
        return list(self.metadata.get("layers", range(self.q_mean.shape[0])))

    def rows(self, layers) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu, A) [len(layers), Hq, F] of the given model layers."""
        index = {layer: row for row, layer in enumerate(self.layers)}
        missing = [layer for layer in layers if layer not in index]
        if missing:
            raise StatsFileError(f"the statistics cover layers {self.layers}, not layer(s) {missing}")
        rows = torch.tensor([index[layer] for layer in layers], dtype=torch.long)
        return self.q_mean.index_select(0, rows), self.q_abs_mean.index_select(0, rows)

    def head_concentration(self) -> torch.Tensor:
        """Mean R over bands per (layer, query head), [L, Hq]."""
        return self.concentration.mean(-1)

    def summary(self) -> dict:
        head_r = self.head_concentration()
        return {
            "heads": int(head_r.numel()),
            "mean_R": float(head_r.mean()),
            "share_R_gt_0.9": float((head_r > 0.9).double().mean()),
            "share_R_gt_0.95": float((head_r > 0.95).double().mean()),
            "tokens": int(self.metadata.get("token_count", 0)),
        }

    # ---- persistence -------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        tensors = {
            "q_mean_real": self.q_mean.real.float().contiguous(),
            "q_mean_imag": self.q_mean.imag.float().contiguous(),
            "q_abs_mean": self.q_abs_mean.float().contiguous(),
        }
        if self.k_mean is not None:
            tensors |= {
                "k_mean_real": self.k_mean.real.float().contiguous(),
                "k_mean_imag": self.k_mean.imag.float().contiguous(),
                "k_abs_mean": self.k_abs_mean.float().contiguous(),
            }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"trikv": json.dumps(self.metadata, sort_keys=True)})
        # safetensors writes through a private temporary file (mode 0600): give the file the user's usual permissions
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(path, 0o666 & ~umask)

    @classmethod
    def load(cls, path: str | Path) -> "QueryStats":
        path = Path(path)
        if not path.is_file():
            raise StatsFileError(f"statistics file not found: {path}")
        try:
            tensors = load_file(str(path))
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                raw_meta = (handle.metadata() or {}).get("trikv")
        except (SafetensorError, OSError, ValueError, RuntimeError) as error:
            raise StatsFileError(f"{path} is not a readable safetensors statistics file (corrupt or truncated?): {error}") from None
        if raw_meta is None:
            raise StatsFileError(f"{path} has no trikv metadata; was it written by `trikv calibrate`?")
        try:
            metadata = json.loads(raw_meta)
        except json.JSONDecodeError as error:
            raise StatsFileError(f"{path}: metadata is not valid JSON: {error}") from None
        if metadata.get("format") != STATS_FORMAT:
            raise StatsFileError(f"{path}: format {metadata.get('format')!r}, expected {STATS_FORMAT!r}")
        missing = [name for name in _TENSORS if name not in tensors]
        if missing:
            raise StatsFileError(f"{path}: missing tensors {missing}")
        missing = [key for key in SHAPE_KEYS + ("rope_checksum",) if key not in metadata]
        if missing:
            raise StatsFileError(f"{path}: metadata lacks {missing}; was it written by `trikv calibrate`?")
        covered = metadata.get("layers", list(range(metadata["num_layers"])))
        if not isinstance(covered, list) or not covered or any(not isinstance(x, int) or not 0 <= x < metadata["num_layers"] for x in covered):
            raise StatsFileError(f"{path}: metadata 'layers' must list layer indices below {metadata['num_layers']}, got {covered!r}")
        expected = (len(covered), metadata["num_heads"], metadata["head_dim"] // 2)
        for name in _TENSORS:
            if tuple(tensors[name].shape) != expected:
                raise StatsFileError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, metadata says {expected}")
            if not torch.isfinite(tensors[name]).all():
                raise StatsFileError(f"{path}: tensor {name} holds non-finite values")
        _check_plausible(path, tensors["q_mean_real"].double(), tensors["q_mean_imag"].double(), tensors["q_abs_mean"].double())
        k_mean = k_abs = None
        if all(name in tensors for name in _KEY_TENSORS):
            k_mean = torch.complex(tensors["k_mean_real"].double(), tensors["k_mean_imag"].double())
            k_abs = tensors["k_abs_mean"].double()
        return cls(
            q_mean=torch.complex(tensors["q_mean_real"].double(), tensors["q_mean_imag"].double()),
            q_abs_mean=tensors["q_abs_mean"].double(),
            k_mean=k_mean,
            k_abs_mean=k_abs,
            metadata=metadata,
        )

    # ---- validation --------------------------------------------------------------------------
    def check_matches(self, model: torch.nn.Module, source: str = "statistics") -> None:
        """Raise StatsFileError naming the first mismatch between these stats and `model`."""
        self.check_against(model_shape(model), RopeGeometry.from_model(model), lambda: weight_signature(model), source)

    def check_against(self, shape: ModelShape, geometry: RopeGeometry, signature, source: str = "statistics") -> None:
        """Raise StatsFileError naming the first mismatch with a model of this shape and RoPE geometry;
        `signature` is a callable returning the served weights' `weight_signature` (called only when the stats
        carry one)."""
        meta = self.metadata
        expected = {**shape_metadata(shape), "rope_checksum": geometry.checksum()}
        if shape.layer_types is not None or "layer_types" in meta:
            expected["layer_types"] = list(shape.layer_types) if shape.layer_types is not None else None
        for key, value in expected.items():
            if meta.get(key) != value:
                raise StatsFileError(
                    f"{source} do not match the model: {key} is {meta.get(key)!r} in the stats "
                    f"(calibrated on {meta.get('model_name', '?')}) but {value!r} in the model"
                )
        missing = sorted(set(shape.cached_layers) - set(self.layers))
        if missing:
            raise StatsFileError(
                f"{source} cover layers {self.layers} but the model's cache bounds layers {list(shape.cached_layers)} "
                f"(missing {missing}); recalibrate with `trikv calibrate`"
            )
        expected_signature = meta.get("weight_signature")
        if expected_signature is None:
            log.warning("%s carry no weight signature (written by an older trikv?): checked against the model's shape "
                        "and RoPE only; recalibrate to check that they come from these very weights", source)
        else:
            current = signature()
            if any(not math.isclose(a, b, rel_tol=0.02, abs_tol=1e-6) for a, b in zip(expected_signature, current)):
                raise StatsFileError(
                    f"{source} were calibrated on different weights ({meta.get('model_name', '?')}): "
                    "same architecture, but the q_proj weights differ; recalibrate with `trikv calibrate`"
                )


class StatsAccumulator:
    """Streaming float64 sums of pre-RoPE q (and k) bands per layer and head."""

    def __init__(self, shape: ModelShape, geometry: RopeGeometry, layers=None):
        F = shape.head_dim // 2
        self.shape, self.geometry = shape, geometry
        self.layers = list(range(shape.num_layers) if layers is None else layers)
        self.row_of = {layer: row for row, layer in enumerate(self.layers)}
        L = len(self.layers)
        self.q_sum = torch.zeros(L, shape.num_heads, F, dtype=torch.complex128)
        self.q_abs_sum = torch.zeros(L, shape.num_heads, F, dtype=torch.float64)
        self.k_sum = torch.zeros(L, shape.num_kv_heads, F, dtype=torch.complex128)
        self.k_abs_sum = torch.zeros(L, shape.num_kv_heads, F, dtype=torch.float64)
        self.tokens_per_layer = torch.zeros(L, dtype=torch.long)

    def add(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        # q: [b, Hq, n, D], k: [b, Hkv, n, D]; layers the statistics do not cover are skipped
        if layer not in self.row_of:
            return
        layer = self.row_of[layer]
        q_bands = self.geometry.to_complex(q.detach().double().cpu())  # [b, Hq, n, F]
        k_bands = self.geometry.to_complex(k.detach().double().cpu())
        self.q_sum[layer] += q_bands.sum(dim=(0, 2))
        self.q_abs_sum[layer] += q_bands.abs().sum(dim=(0, 2))
        self.k_sum[layer] += k_bands.sum(dim=(0, 2))
        self.k_abs_sum[layer] += k_bands.abs().sum(dim=(0, 2))
        self.tokens_per_layer[layer] += q.shape[0] * q.shape[2]

    def finish(self, metadata: dict) -> QueryStats:
        count = self.tokens_per_layer.double().clamp_min(1)[:, None, None]
        return QueryStats(
            q_mean=self.q_sum / count,
            q_abs_mean=self.q_abs_sum / count,
            k_mean=self.k_sum / count,
            k_abs_mean=self.k_abs_sum / count,
            metadata=metadata,
        )


def stats_metadata(model: torch.nn.Module, token_count: int, source: str, model_name: str | None = None,
                   layers=None) -> dict:
    shape = model_shape(model)
    geometry = RopeGeometry.from_model(model)
    hybrid = {} if shape.layer_types is None else {"layer_types": list(shape.layer_types)}
    covered = {} if layers is None or list(layers) == list(range(shape.num_layers)) else {"layers": list(layers)}
    return {
        **hybrid,
        **covered,
        "format": STATS_FORMAT,
        "model_name": model_name or getattr(model, "trikv_name", None) or getattr(model.config, "_name_or_path", "?"),
        **shape_metadata(shape),
        "rope_checksum": geometry.checksum(),
        "attention_scaling": geometry.attention_scaling,
        "weight_signature": weight_signature(model),
        "token_count": token_count,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "calibration_source": source,
        "trikv_version": __version__,
    }


@torch.no_grad()
def calibrate(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    source: str,
    chunk_tokens: int = 2048,
    progress: bool = True,
    model_name: str | None = None,
    all_layers: bool = False,
) -> QueryStats:
    """Stream `token_ids` [n] through the model in independent chunks and return its query statistics.

    The statistics cover the layers a trikv cache bounds (every layer; a hybrid model's full-attention layers),
    or every layer with `all_layers` (for analysis); the file records which (`metadata["layers"]`)."""
    from tqdm.auto import tqdm

    shape = model_shape(model)
    geometry = RopeGeometry.from_model(model)
    if chunk_tokens < 2:
        raise ValueError("chunk_tokens must be at least 2")
    token_ids = token_ids.flatten()
    if token_ids.numel() == 0:
        raise ValueError("calibration text is empty")
    if token_ids.numel() < MIN_CALIBRATION_TOKENS:
        log.warning("calibrating on %d tokens only: fewer than the shortest length measured (%d; docs/calibration.md "
                    "gives the length that was enough)", token_ids.numel(), MIN_CALIBRATION_TOKENS)
    layers = list(range(shape.num_layers)) if all_layers else list(shape.cached_layers)
    accumulator = StatsAccumulator(shape, geometry, layers)
    device = next(model.parameters()).device
    chunks = list(token_ids.split(chunk_tokens))
    with capture_pre_rope(model, accumulator.add):
        for chunk in tqdm(chunks, desc="calibrating", unit="chunk", disable=not progress):
            model(input_ids=chunk[None].to(device), use_cache=False, logits_to_keep=1)  # queries only: no vocabulary-wide logits
    metadata = stats_metadata(model, int(token_ids.numel()), source, model_name, layers)
    return accumulator.finish(metadata)


def bundled_stats_path(name: str) -> Path:
    return Path(__file__).parent / "data" / "stats" / f"{name}.safetensors"


def load_stats(name_or_path: str | Path, model: torch.nn.Module | None = None) -> QueryStats:
    """Load stats by bundled model name or file path; validated against `model` when given."""
    path = Path(name_or_path)
    if not path.exists() and bundled_stats_path(str(name_or_path)).exists():
        path = bundled_stats_path(str(name_or_path))
    elif not path.exists():
        raise StatsFileError(
            f"no statistics file at {name_or_path!r} and no bundled stats of that name; "
            "create one with `trikv calibrate --model M --text-file FILE --out stats.safetensors`"
        )
    stats = QueryStats.load(path)
    if model is not None:
        stats.check_matches(model, source=f"statistics {path.name}")
    return stats
