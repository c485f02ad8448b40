"""Optional vLLM backend for ``rollout --engine vllm`` (vLLM cannot share an environment with llmcompressor,
and is CUDA-only, so it is never required). UNTESTED here: no machine of this project has vLLM installed."""

from __future__ import annotations

from .errors import QerlError


def require():
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise QerlError("--engine vllm needs vLLM (pip install 'qerl[vllm]' in a separate environment, CUDA only); "
                        "use --engine ours.") from None
    raise QerlError("--engine vllm is not wired into rollout in this version; use --engine ours.")
