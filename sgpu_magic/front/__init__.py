"""The front doors (layer 5): the decorator, the magics and their help, the script runner, the doctor."""
