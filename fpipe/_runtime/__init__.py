"""fpipe's engine, private: every public face (``fpipe.pipeline``, ``fpipe.GPipe``,
``fpipe.distributed``) runs on it. Nothing here is API; see ``docs/architecture.md``."""

__all__: list[str] = []
