"""The serving front end: the engine client that owns the rank processes, and the
OpenAI-compatible HTTP app on top of it."""

# The HTTP app is re-exported lazily: engine-side code importing `tandem.serving.*` does not
# pay for FastAPI / prometheus_client.
_LAZY = {
    "create_app": "tandem.serving.openai.api_server",
    "render_chat": "tandem.serving.openai.chat_template",
    "ChatTemplateError": "tandem.serving.openai.chat_template",
    "ServingMetrics": "tandem.serving.metrics",
    "APIError": "tandem.serving.openai.protocol",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
