"""The Ray backend: one actor per rank on a Ray cluster, supervised from the kernel."""
