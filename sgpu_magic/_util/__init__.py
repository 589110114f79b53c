"""OS and process helpers shared by every process (layer 0): atomic private writes, prctl, ports, redaction."""
