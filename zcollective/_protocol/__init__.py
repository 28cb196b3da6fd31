"""The pure rules: a replica's (_member), the coordinator's (_coordinator), who may connect
(_tokens), the ring's schedules (_ring), which chunk a data port takes (_chunks) and who is slow
(_stats). Fed messages and peer events; no socket, thread, signal or file."""
