"""The marker an engine's ``clear_data()`` puts through the task queue."""

__all__ = ["Clear"]


class Clear:
    """Every rank drops the batches it takes before this marker in the same ``get_tasks()``
    call (and the marker itself), so every rank drops the same set."""

    __slots__ = ("clear_id",)

    def __init__(self, clear_id=0):
        self.clear_id = clear_id

    def __reduce__(self):
        return Clear, (self.clear_id,)

    def __repr__(self):
        return f"Clear({self.clear_id})"
