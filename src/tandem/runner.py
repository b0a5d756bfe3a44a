"""The runner's public import path (README, "Layout"): `from tandem.runner import UBatchWrapper`
and the other classes below. The code lives in
`tandem.worker` (one step of one rank) and `tandem.engine` (the request loop); this module only
re-exports, lazily, so `import tandem.runner` stays cheap."""

_PUBLIC = {
    "UBatchWrapper": "tandem.worker.ubatch_wrapper",
    "FutureMap": "tandem.worker.future_map",
    "ModelRunner": "tandem.worker.model_runner",
    "Scheduler": "tandem.engine.scheduler",
    "Engine": "tandem.engine.core",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
