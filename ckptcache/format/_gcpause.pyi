"""The collector's bookkeeping (``_gcpause.c``), built at install where a C compiler is found."""

from types import TracebackType
from typing import Literal

class paused:
    """A region with no cyclic garbage collection; regions nest, in every thread."""

    def __enter__(self) -> None: ...
    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
        /,
    ) -> Literal[False]: ...

def depth() -> int:
    """How many regions are open now, in every thread."""

def after_fork() -> None:
    """In a forked child: no region open (the collector back on if it was on before)."""
