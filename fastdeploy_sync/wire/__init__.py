"""What travels between processes and how a peer is reached: the wire format (``codec``),
authentication (``auth``), liveness (``liveness``), endpoints and their socket files
(``endpoints``) and the ZeroMQ socket plumbing (``sockets``). Imports nothing of the
library above ``errors``, ``envs`` and ``names``."""
