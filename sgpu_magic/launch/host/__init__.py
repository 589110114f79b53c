"""The per-kernel launch host process (torch elastic, the warm forkserver and its preload modules)."""
