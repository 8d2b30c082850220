"""What a process sets up around the library: its event loop, its log sink, progress for slow
steps, its home folder (the embedded models) and the platform check."""
