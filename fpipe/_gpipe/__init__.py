"""The private half of ``fpipe.GPipe``, torchgpipe's face: its arguments and checks
(:mod:`~fpipe._gpipe.arguments`) and how a call runs on the functional core
(:mod:`~fpipe._gpipe.run`)."""

__all__: list[str] = []
