"""shuffledp: accounting package."""
