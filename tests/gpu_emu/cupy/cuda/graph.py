"""``cupy.cuda.Graph``: a captured CUDA graph (made only by ``Stream.end_capture``); the
capture model is ``cupy._capture``'s."""
from __future__ import annotations

__all__ = ["Graph"]


class Graph:
    """The CUDA graph object: ``launch(stream=None)`` runs it, ``upload(stream=None)`` readies it."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("currently this class cannot be initiated by the user and must be created via "
                                  "stream capture")

    @classmethod
    def _from_capture(cls, capture) -> Graph:
        self = object.__new__(cls)
        self._capture = capture
        return self

    def launch(self, stream=None) -> None:
        """Launch the graph on ``stream`` (default: the current stream)."""
        from .. import _capture
        from .stream import resolve_stream
        _capture.launch(self._capture, resolve_stream(stream)._state)

    def upload(self, stream=None) -> None:
        """cudaGraphUpload: nothing to do on the stand-in."""
        return None

    # stand-in only: what the graph holds, for tests
    def standin_nodes(self) -> list[str]:
        """The kinds of the graph's nodes in launch order (stand-in only)."""
        return [n.kind for n in self._capture.nodes]

    def standin_allocations(self) -> int:
        """Pool allocations made while this graph was captured (stand-in only)."""
        return self._capture.allocations
