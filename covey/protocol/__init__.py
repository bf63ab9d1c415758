"""Wire schemas, content ids and the pure round state machine. No sockets here."""
