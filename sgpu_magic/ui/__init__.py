"""What the user sees (layer 4): the terminal buffer, the text view, the widget panel."""
