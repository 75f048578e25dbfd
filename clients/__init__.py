"""shuffledp: clients package."""
