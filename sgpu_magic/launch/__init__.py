"""Starting ranks (layer 2): GPUs and leases, the kernel's client of the launch host, the host itself, Ray."""
