"""What servers and workers both speak: the wire codec and its checked buffers,
element ranges, shared memory, run configs, errors, auth and the flags of both."""
