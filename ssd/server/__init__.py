"""OpenAI-compatible HTTP serving: an asyncio engine front, the FastAPI app, and Prometheus metrics.

``create_app(engine, served_model_name)`` builds the app around an :class:`~ssd.engine.LLMEngine`; the
``ssd serve`` command runs it under uvicorn. Submodules are imported lazily: importing ``ssd.server`` does
not pull in FastAPI.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "create_app": "ssd.server.app",
    "BackgroundServer": "ssd.server.app",
    "AsyncEngine": "ssd.server.async_engine",
    "GenerationRequest": "ssd.server.messages",
    "ServerMetrics": "ssd.server.metrics",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ssd.server' has no attribute {name!r}")


__all__ = list(_EXPORTS)
