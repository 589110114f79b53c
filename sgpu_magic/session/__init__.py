"""Live sessions (layer 3): ranks that keep their namespace from cell to cell; see :mod:`sgpu_magic.session.core`."""
