"""How a rank tells its engine what it has taken: one store on the engine's ack board
(node-local engine), else a cumulative ACK message that never blocks the step."""

from ..shm.ack_board import EPOCH_SHIFT, AckBoard

__all__ = ["Acknowledger"]


class Acknowledger:
    """One rank's acknowledgements (the event loop's; ``welcomed`` is the receiver's).

    A node-local engine (``ipc://``) is acknowledged on its ack board (``shm.ack_board``),
    attached at the engine's first WELCOME, tagged with the worker group's epoch. Otherwise
    (``tcp://``, or no usable board) by an ACK message on the connection's ACK socket,
    which never blocks: one that cannot be queued (the engine's connection down or full;
    the context closing) is kept in ``unsent`` and sent again by the next step call
    (``resend``); a newer one supersedes it. A rank that reconnects says what it has taken
    in its HELLO anyway."""

    def __init__(self, connection, name, dp_id, tp_size, tp_rank, node_local: bool,
                 counters):
        self._connection = connection
        self._name, self._dp_id, self._tp_size, self._rank = name, dp_id, tp_size, tp_rank
        self._board_wanted = node_local
        self.board = None
        self._epoch_tag = 0
        self.unsent = 0  # the cumulative ACK a send could not queue; 0: none
        self._counters = counters

    def welcomed(self, epoch: int, engine: int):
        """Engine instance ``engine`` welcomed this rank into worker group ``epoch``. At the
        first WELCOME of a node-local engine, attach that engine's ack board: returns it
        (None otherwise, or when there is none usable, or the board is another engine's:
        ACK messages then)."""
        self._epoch_tag = epoch << EPOCH_SHIFT
        if not self._board_wanted:
            return None
        self._board_wanted = False
        self.board = AckBoard.attach(self._name, self._dp_id, self._tp_size, engine)
        return self.board

    def acknowledge(self, seq: int) -> None:
        """This rank has taken every batch up to ``seq``. Never blocks, never raises: the
        step has taken its batches, whatever becomes of the acknowledgement."""
        board = self.board
        if board is not None:
            board.publish(self._rank, self._epoch_tag | seq)
        else:
            self._send(seq)

    def resend(self) -> None:
        """Step calls, when an ACK could not be queued before: try it again."""
        self._send(self.unsent)

    def _send(self, seq: int) -> None:
        sent = self._connection.send_ack(seq)
        if sent is None:
            return  # the client is closing: nothing to say any more
        if sent:
            self.unsent = 0
        else:
            self.unsent = seq
            self._counters["acks_deferred"] += 1

    def close(self) -> None:
        """Stop using the board: a take in another thread may still be writing it, so it is
        unmapped when it is garbage (the engine owns its name)."""
        self.board = None
