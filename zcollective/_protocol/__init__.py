"""The pure rules: a replica's (_member), the coordinator's (_coordinator), who may connect
(_tokens), the ring's schedules (_ring) and who is slow (_stats). Fed messages and peer events;
no socket, thread, signal or file."""
