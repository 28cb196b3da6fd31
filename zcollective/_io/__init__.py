"""The drivers: sockets, threads and signals, and no rules. Each socket has one owner thread at a
time (see _server and _interrupts); the rules they feed are in zcollective._protocol."""
